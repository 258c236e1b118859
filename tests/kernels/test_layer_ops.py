"""The native layer ops (kvlm/kernels/csrc/layer_ops.h) against their torch references (kvlm.model.ops and torch's
own functions), for every instruction set the library is built for here, float32 and bfloat16 activations, every
KV cache dtype, grouped heads, ragged cell lists and odd sizes; and the decoder with them against the decoder
without them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.native_builds import kernels_for
from kvlm.kernels.native import cpu_flags
from kvlm.memory.kv_store import Q8Plane
from kvlm.memory.view import TokenCells
from kvlm.model.moe import route
from kvlm.model.backend import NativeCpuBackend, TorchBackend
from kvlm.core.rope import apply_rope
from kvlm.model.ops import grouped_attention, rms_norm
from kvlm.model.recurrent import delta_step

DTYPES = (torch.float32, torch.bfloat16)


def tolerance(dtype: torch.dtype) -> dict:
    """Float32 summation order, or one bfloat16 rounding (torch rounds after each step, the kernels once)."""
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def planes(kv_dtype: str, n_cells: int, n_kv: int, dim: int, seed: int):
    """K and V planes of one layer as the KV store holds them, and their values as float64 (what is read back)."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(1, n_cells, n_kv, dim, generator=g) for _ in range(2))
    if kv_dtype == "q8_0":
        stored = []
        for values in (k, v):
            plane = Q8Plane(values.shape)
            plane.write(0, torch.arange(n_cells), values[0])
            stored.append((plane.native(0), plane.read(0, n_cells).double()))
        return stored
    dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[kv_dtype]
    return [((values[0].to(dtype), None), values[0].to(dtype).double()) for values in (k, v)]


def per_token(cells: torch.Tensor, lengths: torch.Tensor) -> TokenCells:
    """Each token its own row of cells [T, L], the first lengths[t] of them read (decode tokens' layout)."""
    return TokenCells(cells.flatten().contiguous(), torch.arange(len(cells)) * cells.shape[1], lengths)


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("dtype", DTYPES)
# groups of 1-5 and 7 query heads a KV head, and 12 (taken 8, then 4); 48 and 96 values a head: a last 16, three 32s
@pytest.mark.parametrize("n_head,n_kv,dim", [(4, 4, 32), (10, 5, 32), (9, 3, 64), (8, 2, 96), (20, 4, 32),
                                             (14, 2, 64), (12, 1, 48)])
def test_attention_matches_torch(kernels, kv_dtype, dtype, n_head, n_kv, dim):
    if kv_dtype == "q8_0" and dim % 32:
        pytest.skip("a q8_0 cache takes head sizes of whole 32-value blocks")
    n_cells, n_tokens = 50, 5
    (k_plane, k_values), (v_plane, v_values) = planes(kv_dtype, n_cells, n_kv, dim, seed=n_head + dim)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(n_tokens, n_head, dim, generator=g).to(dtype)
    lengths = torch.tensor([1, 17, 50, 3, 31])  # ragged: each token's own rows, padded to the longest
    cells = torch.zeros(n_tokens, 50, dtype=torch.int64)
    for t, n in enumerate(lengths.tolist()):
        cells[t, :n] = torch.randperm(n_cells, generator=g)[:n]
    out = kernels.layer_ops.attention(q, k_plane, v_plane, per_token(cells, lengths), dim ** -0.5)
    for t, n in enumerate(lengths.tolist()):
        rows = cells[t, :n]
        expected = grouped_attention(q[t:t + 1].double(), k_values[rows], v_values[rows], None)
        torch.testing.assert_close(out[t:t + 1].double(), expected, **tolerance(dtype))


def test_bf16_queries_take_their_scores_by_bf16_dot_products_where_the_cpu_has_them(libraries):
    """This CPU's build takes a bf16 query's scores against a bf16 cache by vdpbf16ps exactly where the CPU runs
    AVX512-BF16 (the tests above then check that path against torch); AVX2's build never does."""
    flags = set(cpu_flags().split())
    native = kernels_for("native", libraries).isa
    assert ("bf16 scores" in native) == ({"avx512_bf16", "avx512vl", "avx512bw"} <= flags), native
    assert "bf16 scores" not in kernels_for("x86-64-v3", libraries).isa


def test_a_bf16_cache_is_read_by_the_bf16_scores_where_the_build_has_them(kernels):
    """One query of ones over a row K = (1 at value 0, 2^24 at value 8, -2^24 at value 9, zeros) and a row of zeros.
    q . K is 1, but float32 sums that add the 1 to 2^24 before -2^24 lose it. The float32 paths do: one value after
    another, or 8 or 16 lanes (value i in lane i mod lanes, each lane's chain in order, then a tree that first adds
    lanes i and i + 8): values 0 and 8 meet first, score 0. vdpbf16ps adds values 8 and 9 in one lane (0 there) and
    value 0 in another: score 1. So a bf16 cache gives the softmax of (1, 0) where the build has the bf16 scores, and
    of (0, 0), as an f32 cache of the same values does, where it has not: which path ran, seen in the output."""
    k = torch.zeros(2, 1, 32)
    k[0, 0, [0, 8, 9]] = torch.tensor([1.0, 2.0 ** 24, -(2.0 ** 24)])
    v = torch.tensor([1.0, 0.0]).reshape(2, 1, 1).expand(2, 1, 32).contiguous()
    q = torch.ones(1, 1, 32, dtype=torch.bfloat16)
    cells = per_token(torch.tensor([[0, 1]]), torch.tensor([2]))
    read = {dtype: kernels.layer_ops.attention(q, (k.to(dtype), None), (v.to(dtype), None), cells, 1.0)
            for dtype in (torch.bfloat16, torch.float32)}
    bf16_scores = "bf16 scores" in kernels.isa
    expected = torch.sigmoid(torch.tensor(1.0)) if bf16_scores else torch.tensor(0.5)
    assert torch.equal(read[torch.bfloat16], expected.to(torch.bfloat16).expand(1, 32))
    assert torch.equal(read[torch.float32], torch.tensor(0.5, dtype=torch.bfloat16).expand(1, 32))


def sink_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with sinks written out as gpt-oss defines it (transformers' eager_attention_forward): one token's
    q [n_head, d] over k, v [L, n_kv, d], each head's sink logit a last softmax column that is then dropped."""
    n_head, dim = q.shape
    group = n_head // k.shape[1]
    keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, n_head, d]
    scores = torch.einsum("hd,lhd->hl", q, keys) * dim ** -0.5
    weights = torch.softmax(torch.cat([scores, sinks[:, None]], dim=1), dim=1)[:, :-1]
    return torch.einsum("hl,lhd->hd", weights, values).reshape(1, -1)


@pytest.mark.parametrize("kv_dtype", ["f32", "q8_0"])
def test_attention_with_sinks_matches_their_definition(kernels, kv_dtype):
    """gpt-oss's sinks in the native attention (and torch's attention with them as an extra key), over
    lengths of one cell, a chunk and past it (the chunks' merge starts from the sink)."""
    n_cells, n_head, n_kv, dim = 600, 8, 2, 32
    (k_plane, k_values), (v_plane, v_values) = planes(kv_dtype, n_cells, n_kv, dim, seed=3)
    g = torch.Generator().manual_seed(13)
    q = torch.randn(3, n_head, dim, generator=g)
    sinks = torch.randn(n_head, generator=g) * 3
    lengths = torch.tensor([1, 256, 600])
    cells = torch.stack([torch.randperm(n_cells, generator=g) for _ in range(3)])
    out = kernels.layer_ops.attention(q, k_plane, v_plane, per_token(cells, lengths), dim ** -0.5, sinks)
    for t, n in enumerate(lengths.tolist()):
        rows = cells[t, :n]
        expected = sink_attention_reference(q[t].double(), k_values[rows], v_values[rows], sinks.double())
        torch.testing.assert_close(out[t:t + 1].double(), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grouped_attention(q[t:t + 1].double(), k_values[rows], v_values[rows], None,
                                                     sinks.double()), expected)
    without = kernels.layer_ops.attention(q, k_plane, v_plane, per_token(cells, lengths), dim ** -0.5)
    assert (out - without).abs().max() > 1e-2  # the sinks took their share


@pytest.mark.parametrize("kv_dtype, dtype", [("f32", torch.float32), ("q8_0", torch.float32),
                                             ("bf16", torch.bfloat16)])
def test_long_contexts_are_attended_in_chunks_merged_exactly(kernels, kv_dtype, dtype):
    """Cells beyond one chunk of 256: the partial softmaxes merged give torch's attention; and the result is the
    same bits whatever the number of threads and the other tokens of the step. (bf16 queries over a bf16 cache: the
    scores from their bf16 values, by vdpbf16ps where the CPU has it.)"""
    n_cells, n_head, n_kv, dim = 1200, 8, 2, 64
    (k_plane, k_values), (v_plane, v_values) = planes(kv_dtype, n_cells, n_kv, dim, seed=5)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(3, n_head, dim, generator=g).to(dtype)
    lengths = torch.tensor([1200, 257, 700])
    cells = torch.stack([torch.randperm(n_cells, generator=g) for _ in range(3)])
    out = kernels.layer_ops.attention(q, k_plane, v_plane, per_token(cells, lengths), dim ** -0.5)
    for t, n in enumerate(lengths.tolist()):
        rows = cells[t, :n]
        expected = grouped_attention(q[t:t + 1].double(), k_values[rows], v_values[rows], None)
        torch.testing.assert_close(out[t:t + 1].double(), expected, **tolerance(dtype))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = kernels.layer_ops.attention(q[2:], k_plane, v_plane, per_token(cells[2:], lengths[2:]), dim ** -0.5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, out[2:])


@pytest.mark.parametrize("kv_dtype, dtype", [("f16", torch.float32), ("q8_0", torch.float32),
                                             ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("window", [0, 300])
def test_a_prompts_tokens_over_shared_cells_compute_what_each_alone_computes(kernels, kv_dtype, dtype, window):
    """A prompt's tokens point into one shared run of cells (each from its window's start up to its own); each gets
    the bits it gets reading its own copy of those cells as a decode token, whatever the other tokens of the call."""
    n_cells, n_head, n_kv, dim, n_tokens = 700, 6, 2, 32, 600
    (k_plane, _), (v_plane, _) = planes(kv_dtype, n_cells, n_kv, dim, seed=9)
    g = torch.Generator().manual_seed(17)
    q = torch.randn(n_tokens, n_head, dim, generator=g).to(dtype)
    shared = torch.randperm(n_cells, generator=g)  # the sequence's cells in position order
    ends = torch.arange(n_cells - n_tokens + 1, n_cells + 1)  # token t sees positions up to its own
    starts = (ends - window).clamp(min=0) if window else torch.zeros_like(ends)
    together = kernels.layer_ops.attention(q, k_plane, v_plane, TokenCells(shared, starts, ends - starts), dim ** -0.5)
    for t in (0, 1, 255, 256, 299, 300, 599):
        own = shared[starts[t]:ends[t]].contiguous()
        own_cells = TokenCells(own, torch.zeros(1, dtype=torch.int64), ends[t:t + 1] - starts[t:t + 1])
        alone = kernels.layer_ops.attention(q[t:t + 1], k_plane, v_plane, own_cells, dim ** -0.5)
        assert torch.equal(alone, together[t:t + 1]), t


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 576), (3, 40), (70, 1000)])
def test_rms_norm_with_and_without_residual(kernels, dtype, rows, width):
    g = torch.Generator().manual_seed(rows)
    x, h = (torch.randn(rows, width, generator=g).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(width, generator=g)).to(dtype)
    out, same = kernels.layer_ops.rms_norm(x, weight, 1e-5)
    assert same is x
    torch.testing.assert_close(out, rms_norm(x.double(), weight.double(), 1e-5).to(dtype), **tolerance(dtype))
    out, total = kernels.layer_ops.rms_norm(x, weight, 1e-5, residual=h)
    assert torch.equal(total, x + h)  # one rounding of the sum: what torch's add gives
    torch.testing.assert_close(out, rms_norm(total.double(), weight.double(), 1e-5).to(dtype), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_tokens,n_heads,dim,rotated", [(1, 12, 64, 64), (7, 3, 2, 2), (33, 5, 128, 128),
                                                          (3, 4, 256, 64), (2, 3, 96, 2)])
def test_rope_in_place_on_a_strided_view(kernels, dtype, n_tokens, n_heads, dim, rotated):
    """Whole heads, or their first `rotated` values (partial RoPE: Qwen3.5's quarter), the rest as they were."""
    g = torch.Generator().manual_seed(dim)
    qkv = torch.randn(n_tokens, (n_heads + 1) * dim, generator=g).to(dtype)  # one more head after the rotated ones
    angles = torch.rand(n_tokens, 1, rotated // 2, generator=g) * 100
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    expected = apply_rope(qkv[:, :n_heads * dim].double().view(n_tokens, n_heads, dim), cos.double(), sin.double())
    untouched, before = qkv[:, n_heads * dim:].clone(), qkv[:, :n_heads * dim].clone()
    view = qkv[:, :n_heads * dim].view(n_tokens, n_heads, dim)
    kernels.layer_ops.rope_(view, cos, sin)
    torch.testing.assert_close(view.double(), expected, **tolerance(dtype))
    assert torch.equal(qkv[:, n_heads * dim:], untouched)
    if dtype == torch.float32:  # torch's float32 multiplies and add round as the kernel's: the same bits
        assert torch.equal(view, apply_rope(before.view(n_tokens, n_heads, dim), cos, sin))


def test_rope_refuses_more_rotated_values_than_a_head_has(kernels):
    x, cos = torch.zeros(2, 3, 32), torch.ones(2, 1, 64)
    with pytest.raises(ValueError, match="at most its 32; got 64"):
        kernels.layer_ops.rope_(x, cos, cos)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_tokens,n_heads,dim", [(1, 6, 64), (5, 3, 32), (9, 2, 256)])
def test_head_norm_in_place_on_a_strided_view(kernels, dtype, n_tokens, n_heads, dim):
    """QK-norm: each head normed over its d values, times its own weight; the other heads of the row untouched."""
    g = torch.Generator().manual_seed(dim)
    qkv = torch.randn(n_tokens, (n_heads + 1) * dim, generator=g).to(dtype)
    weight = (1 + 0.2 * torch.randn(n_heads, dim, generator=g)).to(dtype)
    heads = qkv[:, :n_heads * dim].view(n_tokens, n_heads, dim)
    expected = F.rms_norm(heads.double(), (dim,), eps=1e-6) * weight.double()
    untouched = qkv[:, n_heads * dim:].clone()
    assert kernels.layer_ops.head_norm_(heads, weight, 1e-6) is heads
    torch.testing.assert_close(heads.double(), expected.to(dtype).double(), **tolerance(dtype))
    assert torch.equal(qkv[:, n_heads * dim:], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows,width", [(1, 1536), (5, 7), (64, 2048)])
def test_gated_activation(kernels, dtype, activation, rows, width):
    gate_up = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(width)).to(dtype)
    out = kernels.layer_ops.gated(gate_up, activation == "gelu_tanh")
    gate, up = gate_up.double().chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    torch.testing.assert_close(out.double(), (act * up).to(dtype).double(), **tolerance(dtype))


def delta_inputs(n_seq: int, n_heads: int, k_dim: int, v_dim: int, decay: str, seed: int) -> tuple:
    """One token's q, k, v, g, beta and a state as Qwen3.5's delta rule sees them: k normalized, q normalized and
    scaled, log decays near 0 ("weak") or far below it ("strong")."""
    g = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(n_seq, n_heads, k_dim, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(n_seq, n_heads, v_dim, generator=g)
    scale = 0.05 if decay == "weak" else 5.0
    log_decay = -scale * torch.rand(n_seq, n_heads, generator=g)
    beta = torch.rand(n_seq, n_heads, generator=g)
    state = torch.randn(n_seq, n_heads, k_dim, v_dim, generator=g)
    return q * k_dim ** -0.5, k, v, log_decay, beta, state


@pytest.mark.parametrize("decay", ["weak", "strong"])
@pytest.mark.parametrize("k_dim,v_dim", [(128, 128), (64, 32)])
@pytest.mark.parametrize("n_heads", [4, 16])
@pytest.mark.parametrize("n_seq", [1, 3])
def test_delta_step_matches_torch(kernels, n_seq, n_heads, k_dim, v_dim, decay):
    """The gated delta rule's one-token step natively: torch's output and new state up to float32 summation
    order, and the state passed in untouched (it may be a view of the committed state)."""
    q, k, v, g, beta, state = delta_inputs(n_seq, n_heads, k_dim, v_dim, decay, seed=n_seq * n_heads + k_dim)
    before = state.clone()
    out, new_state = kernels.layer_ops.delta_step(q, k, v, g, beta, state)
    expected_out, expected_state = delta_step(q, k, v, g, beta, state.clone())
    assert out.shape == expected_out.shape == (n_seq, 1, n_heads, v_dim)
    assert new_state.shape == state.shape and new_state.data_ptr() != state.data_ptr()
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new_state, expected_state, rtol=1e-5, atol=1e-6)
    assert torch.equal(state, before)


def test_delta_step_takes_views_and_leaves_them(kernels):
    """Non-contiguous inputs (q, k, v as slices of one projection, the state a slice of a larger store) give what
    their contiguous copies give; the store is untouched."""
    q, k, v, g, beta, _ = delta_inputs(2, 4, 64, 32, "weak", seed=1)
    store = torch.randn(3, 4, 64, 32)
    before = store.clone()
    qkv = torch.cat([q, k, torch.nn.functional.pad(v, (0, 32))], dim=-1)  # [2, 4, 192]: views at a stride
    out, new_state = kernels.layer_ops.delta_step(qkv[..., :64], qkv[..., 64:128], qkv[..., 128:160], g, beta,
                                                  store[1:])
    expected_out, expected_state = delta_step(q, k, v, g, beta, store[1:].clone())
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new_state, expected_state, rtol=1e-5, atol=1e-6)
    assert torch.equal(store, before)
    ops = NativeCpuBackend(kernels)
    torch.testing.assert_close(ops.delta_step(q, k, v, g, beta, store[1:])[0], expected_out, rtol=1e-5, atol=1e-6)


def test_layer_ops_fall_back_to_torch_without_the_library():
    """The torch backend: torch's ops, as in the reference mode and where no compiler built the library."""
    ops = TorchBackend()
    assert ops.kernels is None and ops.decode_layers(None, [], torch.float32) is None and ops.recurrent is None
    x, h, weight = torch.randn(3, 16), torch.randn(3, 16), torch.rand(16) + 0.5
    assert ops.attention_kernel() is None
    torch.testing.assert_close(ops.norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6), rtol=0, atol=0)
    normed, total = ops.add_norm(x, h, weight, 1e-6)
    assert torch.equal(total, x + h)
    torch.testing.assert_close(normed, rms_norm(x + h, weight, 1e-6), rtol=0, atol=0)
    up = torch.nn.Linear(16, 32, bias=False)
    down = torch.nn.Linear(16, 16, bias=False)
    gate, value = up(x).chunk(2, dim=-1)
    with torch.no_grad():
        torch.testing.assert_close(ops.gated_mlp(x, up, down), down(F.silu(gate) * value), rtol=0, atol=0)
    q, k, v, g, beta, state = delta_inputs(2, 3, 16, 8, "weak", seed=0)
    for got, expected in zip(ops.delta_step(q, k, v, g, beta, state), delta_step(q, k, v, g, beta, state)):
        assert torch.equal(got, expected)


def prompt_then_steps(model, prompt: list[int], n_prompt: int, kv_dtype: str) -> torch.Tensor:
    """Logits of every prompt token (one batch) and of each later token decoded alone; two sequences each step so
    decode goes through per-token cell lists, and a lone one through all cells."""
    from kvlm import Batch, Context
    from helpers.models import decode_ok

    ctx = Context(model, n_ctx=128, n_batch=64, n_ubatch=64, n_seq_max=2, kv_dtype=kv_dtype)
    decode_ok(ctx, Batch(tokens=prompt[:n_prompt], seq_ids=[0] * n_prompt, logits=[True] * n_prompt))
    rows = [ctx.get_logits_ith(i).clone() for i in range(n_prompt)]
    decode_ok(ctx, Batch(tokens=prompt[:3], seq_ids=[1] * 3, logits=[False, False, True]))
    for p in range(n_prompt, len(prompt)):
        decode_ok(ctx, Batch(tokens=[prompt[p], prompt[p - n_prompt + 3]], pos=[p, p - n_prompt + 3],
                             seq_ids=[0, 1], logits=[True, True]))
        rows += [ctx.get_logits_ith(0).clone(), ctx.get_logits_ith(1).clone()]
    return torch.stack(rows)


def test_decoder_with_native_ops_matches_torch_ops(smollm2):
    """The reference model (dense float32, f32 cache) with the native layer ops in place of torch's: only summation
    order changes. Anything that rounds on the way (8-bit activations of quantized products, a q8_0 or bf16 cache)
    would turn that float32 noise into whole rounding steps, so this shows the ops themselves; every cache dtype is
    tested op by op above."""
    from kvlm.kernels import native_kernels

    library = native_kernels()
    if library is None:
        pytest.skip("the native kernels are not built here")
    assert smollm2.decoder.ops.name == "torch"  # the reference mode runs torch's ops
    prompt = [1, 504, 3575, 282, 4649, 314, 253, 1345, 28, 653, 1584, 11164, 12816, 288, 9568, 2026]
    torch_ops = prompt_then_steps(smollm2, prompt, 8, "f32")
    smollm2.decoder.ops = NativeCpuBackend(library)
    try:
        native = prompt_then_steps(smollm2, prompt, 8, "f32")
    finally:
        smollm2.decoder.ops = TorchBackend()
    torch.testing.assert_close(native, torch_ops, atol=1e-4, rtol=0)
    assert torch.equal(native.argmax(-1), torch_ops.argmax(-1))


def test_qwen35_decoder_with_the_native_delta_step_matches_torch(tmp_path, monkeypatch):
    """A random Qwen3.5 (float32) decoding one and two sequences a token at a time with the native layer ops, the
    delta rule's step among them, against the torch ops: float32 summation order only."""
    from kvlm import load_model
    from kvlm.kernels import native_kernels
    from helpers.qwen35_factory import random_qwen35, write_qwen35_gguf
    from helpers.models import token_ids

    library = native_kernels()
    if library is None:
        pytest.skip("the native kernels are not built here")
    model = load_model(str(write_qwen35_gguf(random_qwen35(), tmp_path / "model.gguf")), "float32")
    assert model.decoder.ops.name == "torch"
    prompt = token_ids(1000, 16, seed=3)
    torch_ops = prompt_then_steps(model, prompt, 8, "f32")
    calls = []
    native_step = type(library.layer_ops).delta_step
    monkeypatch.setattr(type(library.layer_ops), "delta_step",
                        lambda self, *args: calls.append(1) or native_step(self, *args))
    model.decoder.ops = NativeCpuBackend(library)
    try:
        native = prompt_then_steps(model, prompt, 8, "f32")
    finally:
        model.decoder.ops = TorchBackend()
    assert calls  # the decode steps went through it
    torch.testing.assert_close(native, torch_ops, atol=1e-4, rtol=0)
    assert torch.equal(native.argmax(-1), torch_ops.argmax(-1))


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("n_tokens,n_expert,k", [(1, 32, 4), (7, 64, 8), (3, 512, 10), (5, 4, 4)])
def test_route_chooses_as_torch(kernels, n_tokens, n_expert, k, normalize):
    """A router's choice natively: the same experts in the same order as moe.route's softmax and top-k, their
    weights within float32 rounding (softmax's exp is libm's here, torch's own there); with a bias added first."""
    g = torch.Generator().manual_seed(n_expert)
    logits, bias = torch.randn(n_tokens, n_expert, generator=g) * 3, torch.randn(n_expert, generator=g)
    for b in (None, bias):
        ids, weights = kernels.layer_ops.route(logits, k, normalize, b)
        expected_ids, expected_weights = route(logits if b is None else logits + b, k, normalize)
        assert ids.dtype == torch.int32 and torch.equal(ids.long(), expected_ids)
        torch.testing.assert_close(weights, expected_weights, rtol=2e-6, atol=1e-7)


def test_route_refuses_more_experts_than_there_are(kernels):
    with pytest.raises(ValueError, match="cannot choose 5 of 4 experts"):
        kernels.layer_ops.route(torch.zeros(2, 4), 5, True)
