"""Random-weight LFM2 and Mamba2 models of real sizes, as GGUF files llama.cpp and kvlm both read.

No LFM2 or Mamba2 weights are reachable here (shared/MODELS.md), and speed does not depend on the values: these
have the shapes of LFM2-350M (16 layers, 6 of them attention, d 1024) and Mamba2-130m (24 layers, d 768, state
128), transformers' own initialization, F16 matrices (kvlm's defaults keep float tensors dense: bf16 here), and
are written by the same converter-faithful writers the tests use. Then measure them side by side:

    python -m bench.random_recurrent_models --out /tmp/recurrent
    python -m bench.multi_sequence --model /tmp/recurrent/lfm2-350m-random.gguf --sequences 1 32 --steps 16 --llama-kv split
    python -m bench.multi_sequence --model /tmp/recurrent/mamba2-130m-random.gguf --sequences 1 32 --steps 16 --llama-kv split
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import gguf
import torch
from transformers import Lfm2Config, Lfm2ForCausalLM, Mamba2Config, Mamba2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from gguf_factory import SPECIAL_TOKENS, byte_level_vocab  # noqa: E402
from test_recurrent_models import lfm2_gguf, mamba2_gguf  # noqa: E402 - the tests' writers, as llama.cpp's converter

NORMAL, CONTROL = 1, 3  # llama.cpp's token types

LFM2_350M = dict(vocab_size=65536, hidden_size=1024, intermediate_size=6656, num_hidden_layers=16,
                 num_attention_heads=16, num_key_value_heads=8, conv_L_cache=3, max_position_embeddings=128000,
                 layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
                 norm_eps=1e-5, bos_token_id=1, eos_token_id=7, pad_token_id=0)
MAMBA2_130M = dict(vocab_size=50288, hidden_size=768, num_heads=24, head_dim=64, state_size=128, n_groups=1, expand=2,
                   conv_kernel=4, num_hidden_layers=24, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
                   pad_token_id=0)


def llama_cpp_vocabulary(vocab_size: int) -> dict:
    """The tests' byte-level vocabulary as llama.cpp loads it: every embedding row has a token (the rest are
    control tokens nobody types) and the pre-tokenizer is called "default"."""
    tokens, _ = byte_level_vocab(vocab_size)
    types = [CONTROL if token in SPECIAL_TOKENS else NORMAL for token in tokens]
    extra = vocab_size - len(tokens)
    return {"tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens + [f"<|extra_{i}|>" for i in range(extra)],
            "tokenizer.ggml.token_type": types + [CONTROL] * extra}


def write(name: str, model, writer, out: Path) -> Path:
    with tempfile.TemporaryDirectory() as folder:
        written = writer(model.eval(), Path(folder), quant=gguf.GGMLQuantizationType.F16,
                         extra=llama_cpp_vocabulary(model.config.vocab_size))
        target = out / f"{name}.gguf"
        shutil.move(written, target)
    print(f"{target}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the two GGUF files")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    write("lfm2-350m-random", Lfm2ForCausalLM(Lfm2Config(**LFM2_350M)), lfm2_gguf, args.out)
    write("mamba2-130m-random", Mamba2ForCausalLM(Mamba2Config(**MAMBA2_130M)), mamba2_gguf, args.out)


if __name__ == "__main__":
    main()
