"""The recurrent layers stepped in torch (kvlm.model.recurrent_steps), what a batch-invariant decoder runs where the
native kernels cannot be built: against kvlm.model.recurrent's chunked torch functions (which test_recurrent_ops and
test_delta_rule check against transformers) up to float rounding, and invariant as the native kernels are: a
sequence's outputs and states have the same bits whether it comes whole or in pieces, alone or among others."""
from __future__ import annotations

import pytest
import torch

from kvlm.model.recurrent_steps import SteppedRecurrentOps
from helpers.recurrent_layers import DTYPES, LAYERS, N_TOKENS, PIECES, assert_equal, assert_near, in_pieces

STEPS = SteppedRecurrentOps()


@pytest.mark.parametrize("n_tokens", [1, N_TOKENS])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", LAYERS)
def test_steps_match_the_chunked_functions(name, dtype, n_tokens):
    """Outputs and new states against torch's chunked functions in float32 on the same values, from non-zero
    states; the states passed in are left as they were."""
    layer, reference = LAYERS[name](dtype), LAYERS[name](torch.float32)
    inputs, states = layer.inputs(2, n_tokens, 1), layer.states(2, 2)
    before = [s.clone() for s in states]
    y, new_states = layer.run(inputs, states, STEPS)
    ref_y, ref_states = reference.run([t.float() for t in inputs], states, None)
    assert y.dtype == dtype and ref_y.abs().max() > 0.1
    assert_near(y.float(), ref_y, dtype)
    for state, expected in zip(new_states, ref_states):
        assert state.dtype == expected.dtype
        assert_near(state, expected, dtype)
    assert all(torch.equal(s, b) for s, b in zip(states, before))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", LAYERS)
def test_pieces_give_the_bits_of_the_whole(name, dtype):
    layer = LAYERS[name](dtype)
    inputs, states = layer.inputs(1, N_TOKENS, 3), layer.states(1, 4)
    whole = layer.run(inputs, states, STEPS)
    assert_equal(in_pieces(layer, inputs, states, PIECES, STEPS), whole)
    assert_equal(in_pieces(layer, inputs, states, [1] * N_TOKENS, STEPS), whole)


@pytest.mark.parametrize("n_tokens", [1, N_TOKENS])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", LAYERS)
def test_other_sequences_leave_the_bits_alone(name, dtype, n_tokens):
    layer = LAYERS[name](dtype)
    inputs, states = layer.inputs(3, n_tokens, 5), layer.states(3, 6)
    together = layer.run(inputs, states, STEPS)
    for s in range(3):
        y, new_states = layer.run([t[s:s + 1] for t in inputs], [t[s:s + 1] for t in states], STEPS)
        assert_equal((together[0][s:s + 1], [t[s:s + 1] for t in together[1]]), (y, new_states))
