"""Speculative decoding's shared pieces: random models of every family and memory kind as GGUF files (and a perturbed
copy of each, a draft), loaded so that a row's bits do not depend on the rows beside it; prompt lookup's settings, a
prompt it finds its own n-grams in, and a proposer that knows the output."""
from __future__ import annotations

import random

import torch

from helpers.family_factory import SPECS, random_model, write_family_gguf
from helpers.gemma3_factory import gguf_of as gemma3_gguf, random_gemma3
from helpers.gemma4_factory import random_gemma4, write_gemma4_gguf
from helpers.qwen35_factory import random_qwen35, write_qwen35_gguf
from helpers.recurrent_factory import lfm2_gguf, mamba2_gguf, random_lfm2, random_mamba2
from kvlm import load_model
from kvlm.kernels import native_kernels

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "adaptive": False}
REPEATING = [5, 6, 7, 8, 9, 10, 11, 12] * 6  # a prompt prompt lookup finds its own n-grams in


def _random_gguf(family: str, folder, perturbed: bool = False):
    """A random model of the family as a GGUF file; `perturbed`: the same with every weight moved a little, a draft
    whose guesses are often but not always the target's."""
    if family in SPECS:
        spec = SPECS[family]
        model = random_model(spec)
        write = lambda m, f: write_family_gguf(m, spec, f / "model.gguf")  # noqa: E731
    else:
        make, write = {"gemma3": (random_gemma3, gemma3_gguf), "lfm2": (random_lfm2, lfm2_gguf),
                       "mamba2": (random_mamba2, mamba2_gguf),
                       # 3 delta-rule layers and an attention layer: the pattern once (the suite's time)
                       "qwen35": (lambda: random_qwen35(num_hidden_layers=4),
                                  lambda m, f: write_qwen35_gguf(m, f / "model.gguf")),
                       # iSWA with two row sizes, layers reading others' K/V, per-layer inputs
                       "gemma4": (random_gemma4, lambda m, f: write_gemma4_gguf(m, f / "model.gguf"))}[family]
        model = make()
    if perturbed:
        generator = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * param.std().nan_to_num(0.1) * 0.5)
    return write(model, folder)


def exact_model(path, default: bool = False):
    """A model whose rows compute the same bits whatever rows are beside them: the native kernels' products (the
    weights requantized to Q8_0, or as the file stores them when `default`), or where those are not built, the
    batch-invariant float32 mode."""
    if native_kernels() is None:
        return load_model(str(path), "float32", batch_invariant=True, progress=False)
    return load_model(str(path), progress=False) if default else load_model(str(path), quant="int8", progress=False)


def oracle_guesses(prompts, outputs, vocab: int):
    """A proposer that knows the unspeculated output and guesses it with one token wrong at a position that moves
    from step to step (none wrong when it falls past the guesses): every count of accepted guesses occurs."""
    def propose(tokens, min_n, max_n, k, max_len=None):
        tokens = list(tokens)
        for prompt, output in zip(prompts, outputs):
            if tokens[: len(prompt)] == prompt and tokens[len(prompt):] == output[: len(tokens) - len(prompt)]:
                done = len(tokens) - len(prompt)
                guesses = list(output[done : done + k])
                wrong = random.Random(done).randrange(k + 1)
                if wrong < len(guesses):
                    guesses[wrong] = (guesses[wrong] + 1) % vocab
                return guesses
        return []
    return propose
