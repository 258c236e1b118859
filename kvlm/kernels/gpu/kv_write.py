"""This step's K/V rows into their cells, in Triton: one program per token and KV head. A q8_0 plane is quantized as
kvlm.memory.kv_store's (each block of 32 scaled by its largest magnitude / 127, rounded half to even, the scale kept
as float16), so a cell holds the same bytes whichever device wrote it."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlm.kernels.gpu.reference import Q8_BLOCK


def kv_write(plane: tuple[torch.Tensor, torch.Tensor | None], rows: torch.Tensor, values: torch.Tensor) -> None:
    """values [n, n_kv, d] into cells `rows` [n] (int64) of `plane` = (data [cells, n_kv, d], q8 scales or None)."""
    data, scales = plane
    n, n_kv, dim = values.shape
    if n == 0:
        return
    values = values.contiguous()
    q8 = scales is not None
    _write_rows[(n, n_kv)](data, scales if q8 else data, rows, values, dim, data.stride(0), data.stride(1),
                           (scales if q8 else data).stride(0), (scales if q8 else data).stride(1),
                           values.stride(0), values.stride(1), Q8=q8, Q8_BLOCK=Q8_BLOCK,
                           BLOCK_D=triton.next_power_of_2(dim))


@triton.jit
def _round_half_even(x):
    """torch.round's rounding (the interpreter has no libdevice rint)."""
    down = tl.floor(x)
    fraction = x - down
    odd = down - 2.0 * tl.floor(down * 0.5) == 1.0
    return tl.where((fraction > 0.5) | ((fraction == 0.5) & odd), down + 1.0, down)


@triton.jit
def _write_rows(data_ptr, scales_ptr, rows_ptr, values_ptr, head_dim, stride_dc, stride_dh, stride_sc, stride_sh,
                stride_vt, stride_vh, Q8: tl.constexpr, Q8_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    token, head = tl.program_id(0), tl.program_id(1)
    cell = tl.load(rows_ptr + token)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    x = tl.load(values_ptr + token * stride_vt + head * stride_vh + d, mask=d_ok, other=0.0).to(tl.float32)
    target = data_ptr + cell * stride_dc + head * stride_dh + d
    if Q8:
        blocks = tl.reshape(tl.abs(x), [BLOCK_D // Q8_BLOCK, Q8_BLOCK])
        scale = tl.max(blocks, axis=1) / 127.0  # [blocks]
        b = tl.arange(0, BLOCK_D // Q8_BLOCK)
        tl.store(scales_ptr + cell * stride_sc + head * stride_sh + b, scale.to(tl.float16),
                 mask=b < head_dim // Q8_BLOCK)
        per_value = tl.reshape(tl.broadcast_to(scale[:, None], [BLOCK_D // Q8_BLOCK, Q8_BLOCK]), [BLOCK_D])
        quants = _round_half_even(x / tl.maximum(per_value, 1e-30))
        quants = tl.minimum(tl.maximum(quants, -127.0), 127.0)
        tl.store(target, quants.to(tl.int8), mask=d_ok)
    else:
        tl.store(target, x.to(data_ptr.dtype.element_ty), mask=d_ok)
