"""The native recurrent kernels (kvlm/kernels/csrc/recurrent.h) for each instruction set the library is built for:
against kvlm.model.recurrent's torch functions (which test_recurrent_ops and test_delta_rule check against
transformers) up to float rounding, and exactly invariant: a sequence's outputs and states have the same bits
whether it comes whole or in pieces, alone or among other sequences, on one thread or two, in float32 and bfloat16.
And the delta rule stepped over one token gives kvlm_delta_step's bits."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from kvlm.model.recurrent import (DeltaNetWeights, Mamba2Weights, ShortConvWeights, causal_conv, gated_delta_net,
                                  gated_delta_rule, mamba2_mixer, short_conv)
from test_kernels import kernels  # noqa: F401  - the library built for each -march

DTYPES = (torch.float32, torch.bfloat16)
N_TOKENS = 40
PIECES = [1, 7, N_TOKENS - 8]

pytestmark = pytest.mark.usefixtures("one_thread")  # test_threads_leave_the_bits_alone sets two itself


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


# --- against the torch functions ---

@pytest.mark.parametrize("n_tokens", [1, N_TOKENS])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", LAYERS)
def test_layers_match_torch(kernels, name, dtype, n_tokens):  # noqa: F811
    """Each layer natively against torch's functions in float32 on the same values (for bfloat16 activations: what
    they would be without rounding), from non-zero states: outputs and new states."""
    layer, reference = LAYERS[name](dtype), LAYERS[name](torch.float32)
    inputs, states = layer.inputs(2, n_tokens, 1), layer.states(2, 2)
    before = [s.clone() for s in states]
    y, new_states = layer.run(inputs, states, kernels.recurrent)
    ref_y, ref_states = reference.run([t.float() for t in inputs], states, None)
    assert y.dtype == dtype and ref_y.abs().max() > 0.1
    assert_near(y.float(), ref_y, dtype)
    for state, expected in zip(new_states, ref_states):
        assert_near(state, expected, dtype)
    assert all(torch.equal(s, b) for s, b in zip(states, before))  # the states passed in are left as they were


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels,taps", [(24, 3), (48, 4)])
def test_causal_conv_matches_torch(kernels, channels, taps, dtype, bias, silu):  # noqa: F811
    """The convolution alone, against torch's in float32 on the same values: one rounding to bfloat16 at most."""
    gen = generator(channels)
    x = random(3, 10, channels, gen=gen, dtype=dtype)
    state = conv_state(3, channels, taps, gen)
    weight, b = torch.randn(channels, taps, generator=gen), torch.randn(channels, generator=gen) if bias else None
    out, new_state = kernels.recurrent.causal_conv(x, state, weight, b, silu)
    reference, ref_state = causal_conv(x.float().transpose(1, 2), state, weight, b)
    reference = reference.transpose(1, 2)
    reference = torch.nn.functional.silu(reference) if silu else reference
    assert out.dtype == dtype and torch.equal(new_state, ref_state)
    torch.testing.assert_close(out.float(), reference, **(dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32
                                                          else dict(rtol=2 ** -8, atol=1e-5)))


def delta_rule_inputs(n_seq: int, n_tokens: int, heads: int, k_dim: int, v_dim: int, seed: int = 0):
    """q (scaled) and k unit vectors, v, log decays in [-3, 0], beta in (0, 1) and a non-zero state."""
    gen = generator(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(n_seq, n_tokens, heads, k_dim, generator=gen), dim=-1)
            for _ in range(2))
    v = torch.randn(n_seq, n_tokens, heads, v_dim, generator=gen)
    g = -3 * torch.rand(n_seq, n_tokens, heads, generator=gen)
    beta = torch.rand(n_seq, n_tokens, heads, generator=gen)
    return q * k_dim ** -0.5, k, v, g, beta, torch.randn(n_seq, heads, k_dim, v_dim, generator=gen)


@pytest.mark.parametrize("n_tokens", [1, 5, 70])
def test_delta_rule_matches_torch(kernels, n_tokens):  # noqa: F811
    q, k, v, g, beta, state = delta_rule_inputs(2, n_tokens, 4, 32, 16)
    out, new_state = kernels.recurrent.delta_rule(q, k, v, g, beta, state)
    ref_out, ref_state = gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_state, ref_state, rtol=1e-5, atol=1e-5)


def test_one_token_of_the_delta_rule_is_kvlm_delta_step(kernels):  # noqa: F811
    """The multi-token rule over one token is the one-token step, bit for bit."""
    q, k, v, g, beta, state = delta_rule_inputs(3, 1, 4, 64, 32, seed=5)
    out, new_state = kernels.recurrent.delta_rule(q, k, v, g, beta, state)
    step_out, step_state = kernels.layer_ops.delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    assert torch.equal(out, step_out) and torch.equal(new_state, step_state)


# --- invariance ---

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", LAYERS)
def test_pieces_give_the_bits_of_the_whole(kernels, name, dtype):  # noqa: F811
    """A sequence fed whole, and in pieces of 1, 7 and the rest tokens carrying the states: the same bits."""
    layer = LAYERS[name](dtype)
    inputs, states = layer.inputs(1, N_TOKENS, 3), layer.states(1, 4)
    whole = layer.run(inputs, states, kernels.recurrent)
    assert_equal(in_pieces(layer, inputs, states, PIECES, kernels.recurrent), whole)
    assert_equal(in_pieces(layer, inputs, states, [1] * N_TOKENS, kernels.recurrent), whole)


@pytest.mark.parametrize("n_tokens", [1, N_TOKENS])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", LAYERS)
def test_other_sequences_leave_the_bits_alone(kernels, name, dtype, n_tokens):  # noqa: F811
    """A sequence among three in one call (each with its own inputs and states) gives what it gives alone."""
    layer = LAYERS[name](dtype)
    inputs, states = layer.inputs(3, n_tokens, 5), layer.states(3, 6)
    together = layer.run(inputs, states, kernels.recurrent)
    for s in range(3):
        y, new_states = layer.run([t[s:s + 1] for t in inputs], [t[s:s + 1] for t in states], kernels.recurrent)
        assert_equal((together[0][s:s + 1], [t[s:s + 1] for t in together[1]]), (y, new_states))


THREADED_LAYERS = {  # large enough for the kernels to share the work out (kernels.cpp's for_rows)
    "conv": lambda dtype: short_conv_layer(dtype, 768, 4),
    "mamba2": lambda dtype: mamba2_layer(dtype, heads=8, head_dim=64, d_state=16, groups=2),
    "delta": lambda dtype: delta_net_layer(dtype, v_heads_tiled=True),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", THREADED_LAYERS)
def test_threads_leave_the_bits_alone(kernels, name, dtype):  # noqa: F811
    """Two threads, sharing out the sequences' heads or channels, give one thread's bits."""
    layer = THREADED_LAYERS[name](dtype)
    inputs, states = layer.inputs(3, 64, 7), layer.states(3, 8)
    one = layer.run(inputs, states, kernels.recurrent)
    torch.set_num_threads(2)
    assert_equal(layer.run(inputs, states, kernels.recurrent), one)


def test_bad_shapes_are_refused(kernels):  # noqa: F811
    with pytest.raises(ValueError, match="cannot take"):
        kernels.recurrent.causal_conv(torch.zeros(1, 0, 8), torch.zeros(1, 8, 3), torch.zeros(8, 4), None)
    with pytest.raises(ValueError, match="causal_conv got"):
        kernels.recurrent.causal_conv(torch.zeros(1, 2, 8), torch.zeros(1, 8, 2), torch.zeros(8, 4), None)
