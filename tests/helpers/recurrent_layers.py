"""Recurrent layers (short convolutions, Mamba2 mixers, the gated delta rule) with seeded random weights, their inputs
and fresh states, run whole or in pieces, and the comparisons test_recurrent_native and test_recurrent_steps make of
their outputs: exactly equal, or near within float32 or bfloat16 rounding."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvlm.model.recurrent import (DeltaNetWeights, Mamba2Weights, ShortConvWeights, gated_delta_net, mamba2_mixer,
                                  short_conv)

DTYPES = (torch.float32, torch.bfloat16)
N_TOKENS = 40
PIECES = [1, 7, N_TOKENS - 8]


def assert_near(ours: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> None:
    """ours against torch's float32 on the same values: within float32 rounding of the reference's scale (stepped
    vs chunked sums); for bfloat16 activations, each value within its one rounding to bfloat16, plus as much of the
    scale for the roundings before it (LFM2's gates: torch's products in bfloat16, in either path)."""
    assert ours.shape == reference.shape
    scale = reference.abs().max().item()
    error = (ours.double() - reference.double()).abs()
    if dtype == torch.float32:
        assert error.max().item() <= 1e-5 * scale, f"{error.max().item():.3g} at scale {scale:.3g}"
    else:
        excess = error - 2 ** -8 * (reference.abs().double() + scale)
        assert excess.max().item() <= 0, f"{excess.max().item():.3g} past bfloat16 rounding at scale {scale:.3g}"


def random(*shape: int, gen: torch.Generator, dtype: torch.dtype, scale: float = 1.0,
           mean: float = 0.0) -> torch.Tensor:
    """Normal values, bfloat16's in either dtype: a float32 layer then computes exactly what a bfloat16 one reads."""
    return (mean + torch.randn(*shape, generator=gen) * scale).bfloat16().to(dtype)


class Identity:
    """A projection as a kvlm Linear ([rows, in] -> [rows, out]) that leaves its input as it is: the layers here
    take their projections' outputs as inputs, and give the kernels' output untouched (a real product's bits may
    depend on the number of rows, which is not what these tests are about)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x


@dataclass
class Layer:
    """One recurrent layer with seeded random weights in `dtype`: its per-token inputs and fresh (non-zero) states
    for n_seq sequences, and a run of it over them."""
    inputs: Callable[[int, int, int], list[torch.Tensor]]  # (n_seq, n_tokens, seed) -> [n_seq, n_tokens, ...] each
    states: Callable[[int, int], list[torch.Tensor]]  # (n_seq, seed) -> [n_seq, ...] each
    run: Callable  # (inputs, states, stepped ops or None) -> (y, new states)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def projected(width: int, dtype: torch.dtype) -> Callable[[int, int, int], list[torch.Tensor]]:
    """A layer's inputs: what its in_proj (the identity) would have made, [n_seq, n_tokens, width]."""
    return lambda n_seq, n_tokens, seed: [random(n_seq, n_tokens, width, gen=generator(seed), dtype=dtype)]


def conv_state(n_seq: int, channels: int, taps: int, gen: torch.Generator) -> torch.Tensor:
    """A convolution's state as kvlm keeps it: float32, holding earlier inputs (so values of the activation dtype)."""
    return random(n_seq, channels, taps - 1, gen=gen, dtype=torch.float32)


def short_conv_layer(dtype: torch.dtype, channels: int = 24, taps: int = 3) -> Layer:
    gen = generator(channels + taps)
    w = ShortConvWeights(in_proj=Identity(), conv=random(channels, taps, gen=gen, dtype=dtype, scale=0.5),
                         out_proj=Identity(), conv_bias=random(channels, gen=gen, dtype=dtype, scale=0.1))

    def states(n_seq: int, seed: int) -> list[torch.Tensor]:
        return [conv_state(n_seq, channels, taps, generator(seed))]

    def run(inputs, states, stepped):
        y, state = short_conv(w, *inputs, *states, stepped=stepped)
        return y, [state]

    return Layer(projected(3 * channels, dtype), states, run)


def mamba2_layer(dtype: torch.dtype, heads: int = 4, head_dim: int = 8, d_state: int = 16, groups: int = 2,
                 taps: int = 4) -> Layer:
    gen = generator(heads * head_dim)
    d_inner = heads * head_dim
    conv_dim = d_inner + 2 * groups * d_state
    w = Mamba2Weights(
        in_proj=Identity(), conv=random(conv_dim, taps, gen=gen, dtype=dtype, scale=0.5),
        conv_bias=random(conv_dim, gen=gen, dtype=dtype, scale=0.1),
        dt_bias=torch.empty(heads).uniform_(-3.0, 1.0, generator=gen),
        A_log=torch.empty(heads).uniform_(-1.0, 2.0, generator=gen), D=torch.randn(heads, generator=gen),
        norm=random(d_inner, gen=gen, dtype=dtype, scale=0.3, mean=1.0), out_proj=Identity(), n_heads=heads,
        head_dim=head_dim, d_state=d_state, n_groups=groups, eps=1e-5)

    def states(n_seq: int, seed: int) -> list[torch.Tensor]:
        gen = generator(seed)
        return [conv_state(n_seq, conv_dim, taps, gen), torch.randn(n_seq, heads, head_dim, d_state, generator=gen)]

    def run(inputs, states, stepped):
        y, *states = mamba2_mixer(w, *inputs, *states, stepped=stepped)
        return y, states

    return Layer(projected(d_inner + conv_dim + heads, dtype), states, run)


def delta_net_layer(dtype: torch.dtype, v_heads_tiled: bool = False, k_heads: int = 2, v_heads: int = 4,
                    dim: int = 32, taps: int = 4) -> Layer:
    gen = generator(v_heads * dim + v_heads_tiled)
    w = DeltaNetWeights(conv=random(2 * k_heads * dim + v_heads * dim, taps, gen=gen, dtype=dtype, scale=0.3),
                        dt_bias=torch.empty(v_heads).uniform_(-2.0, 1.0, generator=gen),
                        A=-torch.exp(torch.empty(v_heads).uniform_(-2.0, 1.0, generator=gen)),
                        norm=torch.empty(dim).uniform_(0.5, 1.5, generator=gen).bfloat16().to(dtype),
                        n_k_heads=k_heads, n_v_heads=v_heads, k_head_dim=dim, v_head_dim=dim, eps=1e-6,
                        v_heads_tiled=v_heads_tiled)

    def inputs(n_seq: int, n_tokens: int, seed: int) -> list[torch.Tensor]:
        """qkv, z, b and a as slices of one projection's output, as the decoder hands them over."""
        sizes = [w.conv_dim, w.value_dim, v_heads, v_heads]
        return list(random(n_seq, n_tokens, sum(sizes), gen=generator(seed), dtype=dtype).split(sizes, dim=-1))

    def states(n_seq: int, seed: int) -> list[torch.Tensor]:
        gen = generator(seed)
        return [conv_state(n_seq, w.conv_dim, taps, gen), torch.randn(n_seq, v_heads, dim, dim, generator=gen)]

    def run(inputs, states, stepped):
        y, *states = gated_delta_net(w, *inputs, *states, stepped=stepped)
        return y, states

    return Layer(inputs, states, run)


LAYERS = {
    "conv24_k3": lambda dtype: short_conv_layer(dtype, 24, 3),
    "conv48_k4": lambda dtype: short_conv_layer(dtype, 48, 4),
    "mamba2": mamba2_layer,
    "delta_grouped": lambda dtype: delta_net_layer(dtype, v_heads_tiled=False),
    "delta_tiled": lambda dtype: delta_net_layer(dtype, v_heads_tiled=True),
}


def in_pieces(layer: Layer, inputs: list[torch.Tensor], states: list[torch.Tensor], sizes: list[int], stepped):
    """The layer over its inputs cut into pieces of `sizes` tokens, each from the states the one before left."""
    ys = []
    for piece in zip(*(t.split(sizes, dim=1) for t in inputs)):
        y, states = layer.run(piece, states, stepped)
        ys.append(y)
    return torch.cat(ys, dim=1), states


def assert_equal(ours: tuple, reference: tuple) -> None:
    """(y, states) with the same bits."""
    (y, states), (ref_y, ref_states) = ours, reference
    assert torch.equal(y, ref_y)
    assert len(states) == len(ref_states) and all(torch.equal(s, r) for s, r in zip(states, ref_states))
