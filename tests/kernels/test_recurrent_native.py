"""The native recurrent kernels (kvlm/kernels/csrc/recurrent.h) for each instruction set the library is built for:
against kvlm.model.recurrent's torch functions (which test_recurrent_ops and test_delta_rule check against
transformers) up to float rounding, and exactly invariant: a sequence's outputs and states have the same bits
whether it comes whole or in pieces, alone or among other sequences, on one thread or two, in float32 and bfloat16.
And the delta rule stepped over one token gives kvlm_delta_step's bits."""
from __future__ import annotations

import pytest
import torch

from helpers.recurrent_layers import (
    DTYPES, LAYERS, N_TOKENS, PIECES, assert_equal, assert_near, conv_state, delta_net_layer, generator, in_pieces,
    mamba2_layer, random, short_conv_layer,
)
from kvlm.core.states import StatesInPlace
from kvlm.model.recurrent import causal_conv, gated_delta_rule

pytestmark = pytest.mark.usefixtures("one_thread")  # test_threads_leave_the_bits_alone sets two itself


# --- against the torch functions ---

@pytest.mark.parametrize("n_tokens", [1, N_TOKENS])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", LAYERS)
def test_layers_match_torch(kernels, name, dtype, n_tokens):
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
def test_causal_conv_matches_torch(kernels, channels, taps, dtype, bias, silu):
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
def test_delta_rule_matches_torch(kernels, n_tokens):
    q, k, v, g, beta, state = delta_rule_inputs(2, n_tokens, 4, 32, 16)
    out, new_state = kernels.recurrent.delta_rule(q, k, v, g, beta, state)
    ref_out, ref_state = gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_state, ref_state, rtol=1e-5, atol=1e-5)


def test_one_token_of_the_delta_rule_is_kvlm_delta_step(kernels):
    """The multi-token rule over one token is the one-token step, bit for bit."""
    q, k, v, g, beta, state = delta_rule_inputs(3, 1, 4, 64, 32, seed=5)
    out, new_state = kernels.recurrent.delta_rule(q, k, v, g, beta, state)
    step_out, step_state = kernels.layer_ops.delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    assert torch.equal(out, step_out) and torch.equal(new_state, step_state)


# --- invariance ---

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", LAYERS)
def test_pieces_give_the_bits_of_the_whole(kernels, name, dtype):
    """A sequence fed whole, and in pieces of 1, 7 and the rest tokens carrying the states: the same bits."""
    layer = LAYERS[name](dtype)
    inputs, states = layer.inputs(1, N_TOKENS, 3), layer.states(1, 4)
    whole = layer.run(inputs, states, kernels.recurrent)
    assert_equal(in_pieces(layer, inputs, states, PIECES, kernels.recurrent), whole)
    assert_equal(in_pieces(layer, inputs, states, [1] * N_TOKENS, kernels.recurrent), whole)


@pytest.mark.parametrize("n_tokens", [1, N_TOKENS])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", LAYERS)
def test_other_sequences_leave_the_bits_alone(kernels, name, dtype, n_tokens):
    """A sequence among three in one call (each with its own inputs and states) gives what it gives alone."""
    layer = LAYERS[name](dtype)
    inputs, states = layer.inputs(3, n_tokens, 5), layer.states(3, 6)
    together = layer.run(inputs, states, kernels.recurrent)
    for s in range(3):
        y, new_states = layer.run([t[s:s + 1] for t in inputs], [t[s:s + 1] for t in states], kernels.recurrent)
        assert_equal((together[0][s:s + 1], [t[s:s + 1] for t in together[1]]), (y, new_states))


def in_banks(states: list[torch.Tensor], slots: list[int], banks: list[int], seed: int) -> list[torch.Tensor]:
    """Each state tensor [n_seq, ...] put into a memory's two banks of 4 slots [2, 4, ...] filled with noise
    elsewhere: sequence i at (banks[i], slots[i])."""
    gen = generator(seed)
    stored = [torch.randn(2, 4, *s.shape[1:], generator=gen).to(s.dtype) for s in states]
    for bank, state in zip(stored, states):
        bank[banks, slots] = state
    return stored


def in_place(stored: list[torch.Tensor], slots: list[int], sources: list[int], targets: list[int]) -> list:
    """StatesInPlace over banks [2, n_slots, ...]: sequence i read from (sources[i], slots[i]), written to
    (targets[i], slots[i])."""
    def addresses(bank, which):
        size = bank[0, 0].numel() * bank.element_size()
        return torch.tensor([bank.data_ptr() + (b * bank.shape[1] + s) * size for b, s in zip(which, slots)])
    return [StatesInPlace((len(slots), *bank.shape[2:]), bank.dtype, addresses(bank, sources),
                          addresses(bank, targets)) for bank in stored]


@pytest.mark.parametrize("own_bank", [False, True], ids=["other-bank", "in-place"])
@pytest.mark.parametrize("n_tokens", [1, N_TOKENS])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", LAYERS)
def test_states_where_the_memory_keeps_them_give_the_bits_of_tensors(kernels, name, dtype, n_tokens, own_bank):
    """States read from and written to a memory's banks (slots out of order, each sequence in its own bank; new
    states to the other bank, or over the state read) give the outputs and new states of the same states passed as
    a tensor, and leave every other slot and bank as it was."""
    layer = LAYERS[name](dtype)
    inputs, states = layer.inputs(3, n_tokens, 9), layer.states(3, 10)
    y, new_states = layer.run(inputs, states, kernels.recurrent)
    slots, sources = [2, 0, 3], [1, 0, 1]
    targets = sources if own_bank else [1 - b for b in sources]
    stored = in_banks(states, slots, sources, seed=11)
    untouched = [bank.clone() for bank in stored]
    handed = in_place(stored, slots, sources, targets)
    y_in_place, returned = layer.run(inputs, handed, kernels.recurrent)
    assert all(r is h for r, h in zip(returned, handed))  # written where they were handed over, nothing new
    assert torch.equal(y_in_place, y)
    for bank, before, new in zip(stored, untouched, new_states):
        assert torch.equal(bank[targets, slots], new)
        before[targets, slots] = new
        assert torch.equal(bank, before)  # the rest as it was


THREADED_LAYERS = {  # large enough for the kernels to share the work out (kernels.cpp's for_rows)
    "conv": lambda dtype: short_conv_layer(dtype, 768, 4),
    "mamba2": lambda dtype: mamba2_layer(dtype, heads=8, head_dim=64, d_state=16, groups=2),
    "delta": lambda dtype: delta_net_layer(dtype, v_heads_tiled=True),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", THREADED_LAYERS)
def test_threads_leave_the_bits_alone(kernels, name, dtype):
    """Two threads, sharing out the sequences' heads or channels, give one thread's bits."""
    layer = THREADED_LAYERS[name](dtype)
    inputs, states = layer.inputs(3, 64, 7), layer.states(3, 8)
    one = layer.run(inputs, states, kernels.recurrent)
    torch.set_num_threads(2)
    assert_equal(layer.run(inputs, states, kernels.recurrent), one)


def test_bad_shapes_are_refused(kernels):
    with pytest.raises(ValueError, match="cannot take"):
        kernels.recurrent.causal_conv(torch.zeros(1, 0, 8), torch.zeros(1, 8, 3), torch.zeros(8, 4), None)
    with pytest.raises(ValueError, match="causal_conv got"):
        kernels.recurrent.causal_conv(torch.zeros(1, 2, 8), torch.zeros(1, 8, 2), torch.zeros(8, 4), None)
