"""A mixture-of-experts block's experts as one native call (csrc/experts.h): tokens grouped by expert, each chosen
expert's gate, up and down read once from the blocks its file stores them in. Its reference is a plain loop over
the experts in torch with the products' exact definition (kvlm.kernels.reference.quantized_product), which
tests/kernels/test_expert_kernel.py compares it with."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvlm.kernels.blocks import BlockMatrix

_i32, _i64, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p


class ExpertMatrix(ctypes.Structure):
    _fields_ = [("type", _i32), ("base", _ptr), ("stride", _i64), ("rows", _i64), ("interleaved", _i32)]


class ExpertsSpec(ctypes.Structure):
    _fields_ = [("n_embd", _i64), ("n_ff", _i64), ("n_expert", _i32), ("activation", _i32), ("gate", ExpertMatrix),
                ("up", ExpertMatrix), ("down", ExpertMatrix), ("alpha", ctypes.c_float), ("limit", ctypes.c_float),
                ("gate_up_bias", _ptr), ("down_bias", _ptr)]


# The experts' activations (csrc/experts.h ExpertActivation), by kvlm's names (kvlm.core.family.ACTIVATIONS)
ACTIVATION_IDS = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}


@dataclass(frozen=True)
class ExpertBiases:
    """gpt-oss's experts' biases, float32: gate_up [n_expert, 2 n_ff] (each expert's gate bias, then its up bias),
    down [n_expert, n_embd]."""

    gate_up: torch.Tensor
    down: torch.Tensor


def _expert_matrix(matrix: BlockMatrix, n_expert: int, offset_rows: int = 0, rows: int | None = None) -> ExpertMatrix:
    """Experts stacked by rows in one matrix: expert e's rows begin at e * (its rows / n_expert) + offset_rows."""
    per_expert = matrix.shape[0] // n_expert
    row_bytes = matrix.blocks.shape[1]
    return ExpertMatrix(int(matrix.qtype), matrix.blocks.data_ptr() + offset_rows * row_bytes, per_expert * row_bytes,
                        per_expert if rows is None else rows, int(matrix.interleaved))


class NativeExperts:
    """`gate` and `up` [n_expert * n_ff, n_embd] and `down` [n_expert * n_embd, n_ff] blocks; `up` None when `gate`
    holds each expert's gate and up rows stacked ([n_expert * 2 n_ff, n_embd], a fused tensor)."""

    def __init__(self, kernels, gate: BlockMatrix, up: BlockMatrix | None, down: BlockMatrix, n_expert: int,
                 activation: str, biases: ExpertBiases | None = None, alpha: float = 1.702, limit: float = 7.0) -> None:
        """`activation` one of ACTIVATION_IDS; `alpha` and `limit` are swiglu_oai's."""
        self._call = kernels.experts_function
        biases = None if biases is None else ExpertBiases(biases.gate_up.float().contiguous(),
                                                          biases.down.float().contiguous())
        self._keep = (gate, up, down, biases)  # the pointers below stay valid
        n_ff, n_embd = down.n_cols, gate.n_cols
        self.spec = ExpertsSpec(
            n_embd, n_ff, n_expert, ACTIVATION_IDS[activation],
            _expert_matrix(gate, n_expert, rows=n_ff),
            _expert_matrix(up, n_expert) if up is not None else _expert_matrix(gate, n_expert, n_ff, n_ff),
            _expert_matrix(down, n_expert), alpha, limit,
            None if biases is None else biases.gate_up.data_ptr(), None if biases is None else biases.down.data_ptr())
        self.n_embd = n_embd

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, n_embd] (float32 or bfloat16); ids [T, k] of experts, weights [T, k] float32 -> [T, n_embd]."""
        x = x.contiguous()
        ids = ids.to(torch.int32).contiguous()
        weights = weights.to(torch.float32).contiguous()
        out = torch.empty_like(x)
        status = self._call(ctypes.byref(self.spec), x.data_ptr(), x.dtype == torch.bfloat16, x.shape[0],
                            ids.shape[1], ids.data_ptr(), weights.data_ptr(), out.data_ptr(), torch.get_num_threads())
        if status:
            raise ValueError(f"the native experts cannot take x {list(x.shape)}, ids {list(ids.shape)} with "
                             f"{self.spec.n_expert} experts (status {status}; ids must lie in 0..{self.spec.n_expert - 1})")
        return out
