"""Which backend a decoder runs on (kvlm.model.backends): the default, KVLM_BACKEND naming one, and the errors that
name a bad value and what is there."""
from __future__ import annotations

import pytest

from kvlm.kernels import native_kernels
from kvlm.model.backend import NativeCpuBackend, TorchBackend
from kvlm.model.backends import backend_for
from kvlm.model.settings import resolve_settings


def test_default_is_native_where_built_and_torch_for_the_reference(monkeypatch):
    monkeypatch.delenv("KVLM_BACKEND", raising=False)
    assert type(backend_for(resolve_settings("float32", None))) is TorchBackend
    expected = NativeCpuBackend if native_kernels() is not None else TorchBackend
    assert type(backend_for(resolve_settings("auto", "auto"))) is expected


def test_the_environment_names_one(monkeypatch):
    monkeypatch.setenv("KVLM_BACKEND", "torch")
    assert type(backend_for(resolve_settings("auto", "auto"))) is TorchBackend
    monkeypatch.setenv("KVLM_BACKEND", "tpu")
    with pytest.raises(ValueError, match=r"KVLM_BACKEND='tpu' is not a backend \(backends: torch, cpu, triton\)"):
        backend_for(resolve_settings("float32", None))


def test_triton_on_the_cpu_asks_for_the_interpreter(monkeypatch):
    monkeypatch.setenv("KVLM_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="on the CPU needs TRITON_INTERPRET=1"):
        backend_for(resolve_settings("float32", None))
