"""kvlm on the real Qwen2.5-Coder-0.5B-Instruct GGUF (qwen2: q/k/v biases, Q4_K/Q5_0/Q6_K/Q8_0 tensors)
against transformers reading the same file, dequantized to float32."""
from __future__ import annotations

import pytest
import torch

from helpers.models import full_sequence_logits, reference_logits
from kvlm import LLM, SamplingParams
from kvlm.loader.load import load_model

TOLERANCE = 1e-4
N_GREEDY = 24
RAW_PROMPTS = ["def quicksort(arr):\n", "The three laws of thermodynamics are", "// sum of an array in C\nint sum("]
CHAT_MESSAGES = ["Write a Python function that reverses a string.", "什么是快速排序？"]
LONG_CODE = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}  # 第{i}个\n\n" for i in range(30))


@pytest.fixture(scope="module")
def qwen(qwen_gguf_path):
    return load_model(str(qwen_gguf_path), "float32")


def chat_ids(hf_tokenizer, message: str) -> list[int]:
    text = hf_tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                            add_generation_prompt=True)
    return hf_tokenizer(text).input_ids


def test_config_is_read_as_qwen2(qwen):
    c = qwen.config
    assert (c.architecture, c.n_layer, c.n_embd, c.n_ff) == ("qwen2", 24, 896, 4864)
    assert (c.n_head, c.n_head_kv, c.head_dim, c.vocab_size) == (14, 2, 64, 151936)
    assert c.rope.theta == 1e6 and not c.tie_word_embeddings


@pytest.mark.parametrize("prompt", [*RAW_PROMPTS, LONG_CODE], ids=["raw0", "raw1", "raw2", "long"])
def test_full_sequence_logits_match_transformers(qwen, hf_qwen, hf_qwen_tokenizer, prompt):
    ids = hf_qwen_tokenizer(prompt).input_ids
    if prompt is LONG_CODE:
        assert len(ids) > 500
    assert (full_sequence_logits(qwen, ids) - reference_logits(hf_qwen, ids)).abs().max().item() <= TOLERANCE


def test_greedy_continuations_equal_transformers_generate(qwen_gguf_path, hf_qwen, hf_qwen_tokenizer):
    prompts = [hf_qwen_tokenizer(p).input_ids for p in RAW_PROMPTS]
    prompts += [chat_ids(hf_qwen_tokenizer, m) for m in CHAT_MESSAGES]
    llm = LLM(model=str(qwen_gguf_path), dtype="float32", n_ctx=1024, max_num_seqs=8)
    outputs = llm.generate(prompts,
                           SamplingParams(max_tokens=N_GREEDY, temperature=0), use_tqdm=False)
    for ids, output in zip(prompts, outputs):
        with torch.no_grad():
            expected = hf_qwen.generate(torch.tensor([ids]), max_new_tokens=N_GREEDY, do_sample=False)
        expected = expected[0, len(ids):].tolist()  # transformers stops after <|im_end|> or <|endoftext|>
        assert output.token_ids[: len(expected)] == expected


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_weight_only_quantization_tracks_float32(qwen_gguf_path, qwen, hf_qwen_tokenizer, quant):
    # int4 re-quantizes Q4_K/Q5_0 weights in groups of 32: close to, not equal to, the file's values.
    quantized = load_model(str(qwen_gguf_path), "bfloat16", quant=quant)
    ids = hf_qwen_tokenizer(RAW_PROMPTS[0]).input_ids
    reference = full_sequence_logits(qwen, ids)
    ours = full_sequence_logits(quantized, ids)
    agreement = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    assert agreement >= 0.8, f"{quant}: top-1 agreement with float32 {agreement:.2f}"
