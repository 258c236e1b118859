"""kvlm.model.recurrent's gated delta rule (Qwen3.5's linear attention) against transformers' own: its chunked and
recurrent reference functions, and a Qwen3_5GatedDeltaNet layer with seeded random weights whose projections we
do around ours, in float32: whole prompts, prompts cut into pieces that carry the states, several sequences in
one call, and llama.cpp's tiled order of the value heads."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvlm.model.recurrent import DELTA_CHUNK, DeltaNetWeights, gated_delta_net, gated_delta_rule

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_5.modeling_qwen3_5 import (  # noqa: E402
    Qwen3_5GatedDeltaNet, l2norm, torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule)

pytestmark = pytest.mark.usefixtures("one_thread")

HIDDEN = 64
K_HEADS, V_HEADS, K_DIM, V_DIM = 2, 4, 16, 16
TOL = 1e-4


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def assert_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert ours.shape == reference.shape
    assert max_diff(ours, reference) <= TOL


# --- the delta rule alone ---

def delta_rule_inputs(n_tokens: int, n_seq: int = 2, heads: int = V_HEADS, seed: int = 0):
    """q and k unit vectors (unscaled), v, log decays g in [-3, 0], beta in (0, 1) and a non-zero state."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (l2norm(torch.randn(n_seq, n_tokens, heads, K_DIM, generator=gen)) for _ in range(2))
    v = torch.randn(n_seq, n_tokens, heads, V_DIM, generator=gen)
    g = -3 * torch.rand(n_seq, n_tokens, heads, generator=gen)
    beta = torch.rand(n_seq, n_tokens, heads, generator=gen)
    state = torch.randn(n_seq, heads, K_DIM, V_DIM, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("reference", [torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule])
@pytest.mark.parametrize("n_tokens", [1, 5, DELTA_CHUNK, 150])
def test_delta_rule_matches_transformers(reference, n_tokens):
    """One token (our single step), part of a block, one whole block, and 2 blocks and a short one. transformers
    scales q by Dk**-0.5 itself; ours takes it scaled."""
    q, k, v, g, beta, state = delta_rule_inputs(n_tokens)
    ref_out, ref_state = reference(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                                   use_qk_l2norm_in_kernel=False)
    assert ref_out.abs().max() > 0.1
    out, new_state = gated_delta_rule(q * K_DIM ** -0.5, k, v, g, beta, state)
    assert_close(out, ref_out)
    assert_close(new_state, ref_state)


def test_delta_rule_pieces_carry_the_state():
    q, k, v, g, beta, state = delta_rule_inputs(150)
    q = q * K_DIM ** -0.5
    whole, whole_state = gated_delta_rule(q, k, v, g, beta, state)
    outs = []
    for block in (slice(0, 1), slice(1, 71), slice(71, 72), slice(72, 150)):
        out, state = gated_delta_rule(q[:, block], k[:, block], v[:, block], g[:, block], beta[:, block], state)
        outs.append(out)
    assert_close(torch.cat(outs, dim=1), whole)
    assert_close(state, whole_state)


def test_delta_rule_leaves_its_input_state_alone():
    q, k, v, g, beta, state = delta_rule_inputs(70)
    before = state.clone()
    for n_tokens in (1, 70):
        gated_delta_rule(q[:, :n_tokens], k[:, :n_tokens], v[:, :n_tokens], g[:, :n_tokens], beta[:, :n_tokens],
                         state)
        assert torch.equal(state, before)


# --- the whole layer between its projections ---

def qwen35_config():
    return transformers.Qwen3_5TextConfig(
        hidden_size=HIDDEN, linear_num_key_heads=K_HEADS, linear_num_value_heads=V_HEADS,
        linear_key_head_dim=K_DIM, linear_value_head_dim=V_DIM, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
        num_hidden_layers=1, layer_types=["linear_attention"], vocab_size=32, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def module() -> Qwen3_5GatedDeltaNet:
    """A layer whose parameters are spread wider than transformers' init (dt_bias = 1, norm = 1), so that the
    decays per step reach from ~0.96 down to ~0.16 (median ~0.74) and the norm's weights differ."""
    config = qwen35_config()
    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    layer.config = config  # for its cache
    with torch.no_grad():
        for proj in (layer.in_proj_qkv, layer.in_proj_z, layer.in_proj_b, layer.in_proj_a, layer.out_proj):
            proj.weight.normal_(0, 0.1)
        layer.conv1d.weight.normal_(0, 0.3)
        layer.A_log.uniform_(-2.0, 1.0)
        layer.dt_bias.uniform_(-2.0, 1.0)
        layer.norm.weight.uniform_(0.5, 1.5)
    return layer


def delta_net_weights(layer: Qwen3_5GatedDeltaNet, v_heads_tiled: bool = False) -> DeltaNetWeights:
    return DeltaNetWeights(conv=layer.conv1d.weight.squeeze(1), dt_bias=layer.dt_bias,
                           A=-torch.exp(layer.A_log.float()), norm=layer.norm.weight, n_k_heads=layer.num_k_heads,
                           n_v_heads=layer.num_v_heads, k_head_dim=layer.head_k_dim, v_head_dim=layer.head_v_dim,
                           eps=layer.layer_norm_epsilon, v_heads_tiled=v_heads_tiled)


def inputs(n_seq: int, n_tokens: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n_seq, n_tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


def projections(layer: Qwen3_5GatedDeltaNet, x: torch.Tensor) -> list[torch.Tensor]:
    """What the decoder would hand us: qkv, z, b, a."""
    return [F.linear(x, p.weight) for p in (layer.in_proj_qkv, layer.in_proj_z, layer.in_proj_b, layer.in_proj_a)]


def fresh_states(w: DeltaNetWeights, n_seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(n_seq, w.conv_dim, w.conv.shape[1] - 1),
            torch.zeros(n_seq, w.n_v_heads, w.k_head_dim, w.v_head_dim))


def run_ours(w: DeltaNetWeights, projected: list[torch.Tensor], sizes: list[int]):
    """Ours over the projections fed in pieces of `sizes` tokens: y (out_proj's input) and the last states."""
    conv_state, state = fresh_states(w, projected[0].shape[0])
    ys = []
    for piece in zip(*(t.split(sizes, dim=1) for t in projected)):
        y, conv_state, state = gated_delta_net(w, *piece, conv_state, state)
        ys.append(y)
    return torch.cat(ys, dim=1), conv_state, state


def run_layer(layer, x, sizes):
    """The layer's output from ours: projections, ours piece by piece, out_proj. And the last states."""
    y, conv_state, state = run_ours(delta_net_weights(layer), projections(layer, x), sizes)
    return F.linear(y, layer.out_proj.weight), conv_state, state


def test_whole_prompt_matches_transformers(module):
    x = inputs(1, 100)
    reference = module(x)
    assert reference.abs().max() > 0.1
    ours, _, _ = run_layer(module, x, [100])
    assert_close(ours, reference)


@pytest.mark.parametrize("sizes", [[1, 37, 1, 61], [64, 36], [99, 1]])
def test_pieces_carry_the_state(module, sizes):
    x = inputs(2, 100)
    whole, whole_conv, whole_state = run_layer(module, x, [100])
    ours, conv_state, state = run_layer(module, x, sizes)
    assert_close(ours, whole)
    assert_close(conv_state, whole_conv)
    assert_close(state, whole_state)
    assert_close(ours, module(x))


def test_pieces_match_transformers_cached_run(module):
    """transformers' cached run: a prompt (its chunked rule from no state), single tokens (its recurrent rule and
    conv update), and a piece of several tokens from a state; its conv cache keeps K inputs where only the last
    K-1 matter."""
    x, sizes = inputs(2, 70), [37, 1, 1, 1, 20, 1, 9]
    ours, conv_state, state = run_layer(module, x, sizes)
    cache = transformers.DynamicCache(config=module.config)
    reference = torch.cat([module(piece, cache=cache) for piece in x.split(sizes, dim=1)], dim=1)
    assert_close(ours, reference)
    assert_close(state, cache.layers[0].recurrent_states[0])
    assert_close(conv_state, cache.layers[0].conv_states[0][..., 1:])


def test_many_sequences_at_once(module):
    """Three sequences in one call, prefill and decode steps: each equals that sequence alone and the layer."""
    x, sizes = inputs(3, 60), [30, 1, 1, 28]
    together = run_layer(module, x, sizes)
    for s in range(3):
        alone = run_layer(module, x[s:s + 1], sizes)
        for ours, reference in zip(together, alone):
            assert_close(ours[s:s + 1], reference)
        assert_close(together[0][s:s + 1], module(x[s:s + 1]))


def test_low_precision_activations_keep_a_float32_state(module):
    w32 = delta_net_weights(module)
    w16 = DeltaNetWeights(**{**vars(w32), "conv": w32.conv.bfloat16(), "norm": w32.norm.bfloat16()})
    x = inputs(1, 80)
    reference = module(x)
    conv_state, state = fresh_states(w32, 1)
    projected = [t.bfloat16() for t in projections(module, x)]
    y, conv_state, state = gated_delta_net(w16, *projected, conv_state.bfloat16(), state)
    assert y.dtype == conv_state.dtype == torch.bfloat16 and state.dtype == torch.float32
    ours = F.linear(y.float(), module.out_proj.weight)
    assert max_diff(ours, reference) <= 0.05 * reference.abs().max()


# --- llama.cpp's tiled order of the value heads ---

# Tiled value head r*Hk + g is grouped value head g*(Hv/Hk) + r: the one that reads key head g.
TILED = torch.tensor([g * (V_HEADS // K_HEADS) + r for r in range(V_HEADS // K_HEADS) for g in range(K_HEADS)])
GROUPED = torch.argsort(TILED)


def reorder_heads(t: torch.Tensor, order: torch.Tensor, start: int = 0, dim: int = -1) -> torch.Tensor:
    """t with the V_HEADS equal slices of `dim` that begin at `start` put in `order` (the rest unchanged)."""
    t = t.movedim(dim, -1)
    heads = t[..., start:].unflatten(-1, (V_HEADS, -1))[..., order, :].flatten(-2)
    return torch.cat([t[..., :start], heads], dim=-1).movedim(-1, dim)


def tiled_run(layer, x, sizes, v_heads_tiled=True):
    """Ours with the layer's value heads in tiled order (as converted GGUF files have them), the output and
    state put back in grouped order."""
    w = delta_net_weights(layer, v_heads_tiled)
    value_rows = 2 * w.key_dim  # where the v channels begin in qkv and the conv
    w.conv = reorder_heads(w.conv, TILED, value_rows, dim=0)
    w.dt_bias, w.A = (reorder_heads(t, TILED) for t in (w.dt_bias, w.A))
    qkv, z, b, a = projections(layer, x)
    projected = [reorder_heads(qkv, TILED, value_rows)] + [reorder_heads(t, TILED) for t in (z, b, a)]
    y, conv_state, state = run_ours(w, projected, sizes)
    return reorder_heads(y, GROUPED), reorder_heads(conv_state, GROUPED, value_rows, dim=1), state[:, GROUPED]


def test_tiled_value_heads_equal_grouped(module):
    x, sizes = inputs(2, 90), [40, 1, 49]
    grouped = run_ours(delta_net_weights(module), projections(module, x), sizes)
    tiled = tiled_run(module, x, sizes)
    assert max_diff(grouped[0], torch.zeros(())) > 0.1
    for ours, reference in zip(tiled, grouped):
        assert_close(ours, reference)


def test_the_wrong_head_order_is_seen(module):
    """Proof that the tests above can fail: tiled heads read as grouped, or grouped as tiled, differ."""
    x, sizes = inputs(2, 90), [40, 1, 49]
    grouped, _, _ = run_ours(delta_net_weights(module), projections(module, x), sizes)
    tiled_read_as_grouped, _, _ = tiled_run(module, x, sizes, v_heads_tiled=False)
    grouped_read_as_tiled, _, _ = run_ours(delta_net_weights(module, v_heads_tiled=True),
                                           projections(module, x), sizes)
    assert max_diff(tiled_read_as_grouped, grouped) > 1e-2
    assert max_diff(grouped_read_as_tiled, grouped) > 1e-2


def test_rejects_inconsistent_shapes(module):
    w = delta_net_weights(module)
    with pytest.raises(ValueError, match="multiple"):
        DeltaNetWeights(**{**vars(w), "n_v_heads": 3})
    with pytest.raises(ValueError, match="conv"):
        DeltaNetWeights(**{**vars(w), "conv": w.conv[1:]})
