"""kvlm.model.recurrent against transformers' own layers (Lfm2ShortConv, Mamba2Mixer) with seeded random
weights, in float32: whole prompts, prompts cut into pieces that carry the state, and several sequences decoded
in one call."""
from __future__ import annotations

import pytest
import torch

from kvlm.model.recurrent import Mamba2Weights, ShortConvWeights, mamba2_mixer, short_conv

transformers = pytest.importorskip("transformers")
from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv  # noqa: E402
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

HIDDEN = 64
TOL = 1e-4


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def inputs(n_seq: int, n_tokens: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n_seq, n_tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def assert_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert ours.shape == reference.shape
    assert max_diff(ours, reference) <= TOL


def pieces(x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(x.split(sizes, dim=1))


# --- LFM2's short convolution ---

def lfm2_conv(conv_bias: bool, conv_L_cache: int = 3) -> Lfm2ShortConv:
    config = transformers.Lfm2Config(hidden_size=HIDDEN, conv_L_cache=conv_L_cache, conv_bias=conv_bias,
                                     num_hidden_layers=1, layer_types=["conv"], vocab_size=32,
                                     intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return Lfm2ShortConv(config, layer_idx=0).eval()


def short_conv_weights(module: Lfm2ShortConv) -> ShortConvWeights:
    bias = module.bias
    return ShortConvWeights(in_proj=module.in_proj.weight, conv=module.conv.weight.squeeze(1),
                            out_proj=module.out_proj.weight,
                            in_proj_bias=module.in_proj.bias if bias else None,
                            conv_bias=module.conv.bias if bias else None,
                            out_proj_bias=module.out_proj.bias if bias else None)


def fresh_conv_state(module: Lfm2ShortConv, n_seq: int) -> torch.Tensor:
    return torch.zeros(n_seq, HIDDEN, module.conv_kernel_size - 1)


def run_short_conv(module, x, sizes):
    """Ours over x [n_seq, T, d] fed in pieces of `sizes` tokens: the outputs concatenated and the last state."""
    w, state, ys = short_conv_weights(module), fresh_conv_state(module, x.shape[0]), []
    for piece in pieces(x, sizes):
        y, state = short_conv(w, piece, state)
        ys.append(y)
    return torch.cat(ys, dim=1), state


@pytest.mark.parametrize("conv_bias", [False, True])
@pytest.mark.parametrize("n_tokens", [10, 300])
def test_short_conv_whole_prompt_matches_transformers(conv_bias, n_tokens):
    module, x = lfm2_conv(conv_bias), inputs(1, n_tokens)
    reference = module(x)
    assert reference.abs().max() > 0.1
    ours, _ = run_short_conv(module, x, [n_tokens])
    assert_close(ours, reference)


@pytest.mark.parametrize("conv_bias", [False, True])
@pytest.mark.parametrize("conv_L_cache", [3, 5])
def test_short_conv_pieces_carry_the_state(conv_bias, conv_L_cache):
    """7 + 1 + rest tokens with our state: the whole prompt's outputs, and transformers' cached run piece by
    piece, whose cache keeps L inputs where only the last L-1 matter."""
    module, x = lfm2_conv(conv_bias, conv_L_cache), inputs(2, 40)
    whole, _ = run_short_conv(module, x, [40])
    ours, state = run_short_conv(module, x, [7, 1, 32])
    assert_close(ours, whole)
    cache = transformers.DynamicCache(config=module.config)
    reference = torch.cat([module(piece, past_key_values=cache) for piece in pieces(x, [7, 1, 32])], dim=1)
    assert_close(ours, reference)
    assert_close(state, cache.layers[0].conv_states[0][..., 1:])


@pytest.mark.parametrize("conv_bias", [False, True])
def test_short_conv_decodes_many_sequences_at_once(conv_bias):
    """Sequences of different prompt lengths, each prefilled alone, then decoded one token per step all in one
    call: each step equals that sequence alone and transformers' whole-sequence output."""
    module = lfm2_conv(conv_bias)
    w = short_conv_weights(module)
    prompt_lengths, n_steps = [1, 3, 8, 20], 5
    full = [inputs(1, n + n_steps, seed=10 + i) for i, n in enumerate(prompt_lengths)]
    states = [short_conv(w, seq[:, :n], fresh_conv_state(module, 1))[1] for seq, n in zip(full, prompt_lengths)]
    state = torch.cat(states)
    for step in range(n_steps):
        tokens = torch.cat([seq[:, n + step: n + step + 1] for seq, n in zip(full, prompt_lengths)])
        y, state = short_conv(w, tokens, state)
        for s, (seq, n) in enumerate(zip(full, prompt_lengths)):
            alone, states[s] = short_conv(w, tokens[s:s + 1], states[s])
            assert_close(y[s:s + 1], alone)
            assert_close(y[s], module(seq[:, :n + step + 1])[0, -1:])
    assert_close(state, torch.cat(states))


# --- Mamba2's mixer ---

def mamba2_module(n_groups: int, time_step_limit=(0.0, float("inf"))) -> Mamba2Mixer:
    """A small mixer whose parameters are spread wider than transformers' init (dt ~ 0.001-0.1, A = -1..-H,
    D = 1, norm = 1), so that the state decays within a prompt, and the clamp, D and the norm all matter."""
    config = transformers.Mamba2Config(hidden_size=HIDDEN, num_heads=8, head_dim=16, state_size=16,
                                       n_groups=n_groups, expand=2, conv_kernel=4, chunk_size=16,
                                       num_hidden_layers=1, vocab_size=32, time_step_limit=time_step_limit)
    torch.manual_seed(0)
    module = Mamba2Mixer(config, layer_idx=0).eval()
    module.config = config  # for its cache, as Lfm2ShortConv keeps its own
    heads = config.num_heads
    module.dt_bias.copy_(torch.empty(heads).uniform_(-3.0, 1.0))  # dt = softplus(dt_bias + ...) ~ 0.05-1.3
    module.A_log.copy_(torch.empty(heads).uniform_(-1.0, 2.0))
    module.D.copy_(torch.randn(heads))
    module.norm.weight.copy_(1 + 0.3 * torch.randn(module.intermediate_size))
    return module


def mamba2_weights(module: Mamba2Mixer) -> Mamba2Weights:
    return Mamba2Weights(in_proj=module.in_proj.weight, conv=module.conv1d.weight.squeeze(1),
                         conv_bias=module.conv1d.bias, dt_bias=module.dt_bias, A_log=module.A_log, D=module.D,
                         norm=module.norm.weight, out_proj=module.out_proj.weight, n_heads=module.num_heads,
                         head_dim=module.head_dim, d_state=module.ssm_state_size, n_groups=module.n_groups,
                         eps=module.norm.variance_epsilon, in_proj_bias=module.in_proj.bias,
                         out_proj_bias=module.out_proj.bias, time_step_limit=tuple(module.time_step_limit))


def fresh_mamba2_states(module: Mamba2Mixer, n_seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(n_seq, module.conv_dim, module.conv_kernel_size - 1),
            torch.zeros(n_seq, module.num_heads, module.head_dim, module.ssm_state_size))


def run_mamba2(module, x, sizes, w=None):
    """Ours over x fed in pieces of `sizes` tokens: the outputs concatenated and the last conv and SSM states."""
    w = w or mamba2_weights(module)
    conv_state, ssm_state = fresh_mamba2_states(module, x.shape[0])
    ys = []
    for piece in pieces(x, sizes):
        y, conv_state, ssm_state = mamba2_mixer(w, piece, conv_state, ssm_state)
        ys.append(y)
    return torch.cat(ys, dim=1), conv_state, ssm_state


@pytest.mark.parametrize("n_groups", [1, 2])
@pytest.mark.parametrize("n_tokens", [10, 300])
def test_mamba2_whole_prompt_matches_transformers(n_groups, n_tokens):
    module, x = mamba2_module(n_groups), inputs(1, n_tokens)
    reference = module(x)
    assert reference.abs().max() > 0.1
    ours, _, _ = run_mamba2(module, x, [n_tokens])
    assert_close(ours, reference)


def test_mamba2_time_step_limit_clamps_dt_as_transformers():
    """Ours clamps dt in every piece, as transformers' uncached forward does. (Its cached single-token step
    does not clamp, so its cached run drifts from its own whole-prompt output when the limit bites.)"""
    limited = mamba2_module(2, time_step_limit=(0.1, 0.4))
    x = inputs(1, 100)
    reference = limited(x)
    for sizes in ([100], [7, 1, 92]):
        ours, _, _ = run_mamba2(limited, x, sizes)
        assert_close(ours, reference)
    unlimited, _, _ = run_mamba2(mamba2_module(2), x, [100])
    assert max_diff(unlimited, reference) > 100 * TOL


@pytest.mark.parametrize("n_groups", [1, 2])
@pytest.mark.parametrize("sizes", [[7, 1, 92], [7, 1, 60, 1, 1, 30], [100]])
def test_mamba2_pieces_carry_the_state(n_groups, sizes):
    """Pieces with our states equal the whole prompt, and transformers' cached run piece by piece (its chunked
    scan from an initial state, and its single-token update): outputs, SSM state, and the conv state, of which
    transformers keeps K inputs where only the last K-1 matter."""
    module, x = mamba2_module(n_groups), inputs(2, 100)
    whole, _, _ = run_mamba2(module, x, [100])
    ours, conv_state, ssm_state = run_mamba2(module, x, sizes)
    assert_close(ours, whole)
    cache = transformers.DynamicCache(config=module.config)
    reference = torch.cat([module(piece, cache_params=cache) for piece in pieces(x, sizes)], dim=1)
    assert_close(ours, reference)
    assert_close(ssm_state, cache.layers[0].recurrent_states[0])
    assert_close(conv_state, cache.layers[0].conv_states[0][..., 1:])


@pytest.mark.parametrize("n_groups", [1, 2])
def test_mamba2_decodes_many_sequences_at_once(n_groups):
    """Sequences of different prompt lengths, each prefilled alone, then decoded one token per step all in one
    call: each step equals that sequence alone and transformers' whole-sequence output."""
    module = mamba2_module(n_groups)
    w = mamba2_weights(module)
    prompt_lengths, n_steps = [1, 5, 17, 70], 4
    full = [inputs(1, n + n_steps, seed=10 + i) for i, n in enumerate(prompt_lengths)]
    states = [run_mamba2(module, seq[:, :n], [n], w)[1:] for seq, n in zip(full, prompt_lengths)]
    conv_state, ssm_state = (torch.cat(s) for s in zip(*states))
    for step in range(n_steps):
        tokens = torch.cat([seq[:, n + step: n + step + 1] for seq, n in zip(full, prompt_lengths)])
        y, conv_state, ssm_state = mamba2_mixer(w, tokens, conv_state, ssm_state)
        for s, (seq, n) in enumerate(zip(full, prompt_lengths)):
            alone, *states[s] = mamba2_mixer(w, tokens[s:s + 1], *states[s])
            assert_close(y[s:s + 1], alone)
            assert_close(y[s], module(seq[:, :n + step + 1])[0, -1:])
    assert_close(ssm_state, torch.cat([s[1] for s in states]))


def test_mamba2_prefills_many_sequences_at_once():
    module = mamba2_module(2)
    x = inputs(3, 90)
    together = run_mamba2(module, x, [20, 70])
    for s in range(3):
        alone = run_mamba2(module, x[s:s + 1], [20, 70])
        for ours, reference in zip(together, alone):
            assert_close(ours[s:s + 1], reference)
        assert_close(together[0][s:s + 1], module(x[s:s + 1]))


def test_mamba2_low_precision_activations_keep_a_float32_state():
    module = mamba2_module(2)
    w32 = mamba2_weights(module)
    w16 = Mamba2Weights(**{**vars(w32), **{name: getattr(w32, name).bfloat16()
                                           for name in ("in_proj", "conv", "conv_bias", "out_proj")}})
    x = inputs(1, 80)
    reference = module(x)
    conv_state, ssm_state = fresh_mamba2_states(module, 1)
    y, conv_state, ssm_state = mamba2_mixer(w16, x.bfloat16(), conv_state.bfloat16(), ssm_state)
    assert y.dtype == conv_state.dtype == torch.bfloat16 and ssm_state.dtype == torch.float32
    assert max_diff(y.float(), reference) <= 0.05 * reference.abs().max()


def test_mamba2_rejects_an_mlp_branch():
    w = mamba2_weights(mamba2_module(1))
    with pytest.raises(ValueError, match="in_proj"):
        Mamba2Weights(**{**vars(w), "in_proj": torch.zeros(w.in_proj.shape[0] + 2 * 32, HIDDEN)})
