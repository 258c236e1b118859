"""A random float32 model file of each memory kind, for tests that run every kind through one path: unified (Llama),
iSWA (Gemma 3, window 8), hybrid (LFM2), recurrent (Mamba2). Each function writes its file into a folder."""
from __future__ import annotations

from helpers.family_factory import SPECS, family_gguf_metadata, family_gguf_tensors, random_model
from helpers.gemma3_factory import gguf_of as gemma3_gguf, random_gemma3
from helpers.gguf_factory import write_gguf
from helpers.recurrent_factory import lfm2_gguf, mamba2_gguf, random_lfm2, random_mamba2


def llama_gguf(folder):
    spec = SPECS["llama-llama3"]
    model = random_model(spec)
    return write_gguf(folder / "model.gguf", family_gguf_metadata(model, spec), family_gguf_tensors(model, spec),
                      arch=spec.arch)


KIND_FILES = {"unified-llama": llama_gguf, "iswa-gemma3": lambda folder: gemma3_gguf(random_gemma3(), folder),
              "hybrid-lfm2": lambda folder: lfm2_gguf(random_lfm2(), folder),
              "recurrent-mamba2": lambda folder: mamba2_gguf(random_mamba2(), folder)}
