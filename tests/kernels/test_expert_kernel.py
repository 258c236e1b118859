"""The native experts call (kvlm.kernels.experts) against a plain loop over the experts in torch on the same blocks:
each chosen expert's gate/up product, the gated activation, the down product (each product as the native products
compute it: activations quantized to 8 bits, kvlm.kernels.reference.quantized_product), weighted and summed per
token. Tokens routed so that some experts get none, one gets exactly one, one gets them all; every block format
the kernels read, in the file's layout and interleaved; float32 and bfloat16 activations."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from kvlm.kernels import NATIVE_TYPES, BlockMatrix, reference
from kvlm.kernels.experts import ExpertBiases, NativeExperts
from helpers.native_builds import kernels_for
from helpers.blocks import block_weights, random_blocks

TYPES = sorted(NATIVE_TYPES, key=int)
N_EXPERT, N_USED = 6, 3


@pytest.fixture(scope="module", params=["native", "x86-64"])
def kernels(request, libraries):
    return kernels_for(request.param, libraries)


def routing(n_tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, 3]: expert 0 for every token, expert 5 for token 0 alone, experts 1-3 for the rest, expert 4 for none;
    weights positive, not summing to 1."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.zeros(n_tokens, N_USED, dtype=torch.int64)
    ids[:, 1] = 1 + torch.randperm(3, generator=generator).repeat(n_tokens)[:n_tokens]
    ids[:, 2] = 1 + (ids[:, 1] % 3)
    ids[0, 2] = 5
    ids = ids[:, torch.randperm(N_USED, generator=generator)]  # the all-tokens expert in any slot
    return ids, torch.rand(n_tokens, N_USED, generator=generator) + 0.1


def experts(qtypes: tuple[T, T, T], n_embd: int, n_ff: int) -> list[BlockMatrix]:
    """gate and up [N_EXPERT * n_ff, n_embd], down [N_EXPERT * n_embd, n_ff], random blocks of each format."""
    shapes = ((N_EXPERT * n_ff, n_embd), (N_EXPERT * n_ff, n_embd), (N_EXPERT * n_embd, n_ff))
    return [BlockMatrix(torch.from_numpy(random_blocks(qtype, rows, cols, seed=i)), qtype, cols)
            for i, (qtype, (rows, cols)) in enumerate(zip(qtypes, shapes))]


def gpt_oss_activation(g: torch.Tensor, u: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """transformers' GptOssExperts._apply_gate on gate and up already split."""
    g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return (u + 1) * (g * torch.sigmoid(g * alpha))


ACTIVATIONS = {"silu": lambda g, u: F.silu(g) * u, "gelu_tanh": lambda g, u: F.gelu(g, approximate="tanh") * u,
               "swiglu_oai": gpt_oss_activation}


def loop_reference(x: torch.Tensor, ids, weights, blocks: list[BlockMatrix], n_ff: int, activation: str,
                   biases: ExpertBiases | None = None) -> torch.Tensor:
    """Per expert: its rows of each matrix, the products as the native products compute them (plus the expert's
    biases), in float64."""
    gate, up, down = blocks
    n_embd = x.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for expert in range(N_EXPERT):
        tokens, slots = torch.nonzero(ids == expert, as_tuple=True)
        if len(tokens) == 0:
            continue
        rows = slice(expert * n_ff, (expert + 1) * n_ff)
        hidden = reference.quantized_product(x[tokens].float(), [gate.rows(rows), up.rows(rows)]).float()
        if biases is not None:
            hidden = hidden + biases.gate_up[expert]
        activated = ACTIVATIONS[activation](*hidden.chunk(2, dim=-1))
        y = reference.quantized_product(activated, [down.rows(slice(expert * n_embd, (expert + 1) * n_embd))])
        if biases is not None:
            y = y + biases.down[expert].double()
        out.index_add_(0, tokens, y * weights[tokens, slots, None].double())
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, relative: float = 2e-3) -> None:
    """float32 sums and an 8-bit rounding of the activation that may fall either side of a level: 2e-3 of the
    output's scale (a wrong expert, weight or activation is off by its whole size)."""
    error = (actual.double() - expected).abs().max().item()
    assert error <= relative * expected.abs().max().item(), f"{error:.3e} of {expected.abs().max().item():.3e}"


def as_laid_out(kernels, blocks: list[BlockMatrix], layout: str) -> list[BlockMatrix]:
    if layout == "file":
        return blocks
    if not all(kernels.tiled(b.qtype) for b in blocks):
        pytest.skip(f"the {kernels.isa} build reads these formats in the file's layout only")
    return [kernels.interleave(BlockMatrix(b.blocks.clone(), b.qtype, b.n_cols)) for b in blocks]


@pytest.mark.parametrize("layout", ["file", "tiles"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_experts_equal_a_loop_over_experts(kernels, qtype, layout):
    n_embd, n_ff = {256: (256, 512), 64: (128, 192), 32: (96, 160)}[block_weights(qtype)]
    blocks = experts((qtype, qtype, qtype), n_embd, n_ff)
    x = torch.randn(7, n_embd, generator=torch.Generator().manual_seed(1))
    ids, weights = routing(7)
    native = NativeExperts(kernels, *as_laid_out(kernels, blocks, layout), N_EXPERT, activation="silu")
    assert_close(native(x, ids, weights), loop_reference(x, ids, weights, blocks, n_ff, "silu"))


@pytest.mark.parametrize("n_tokens", [1, 2, 33])
def test_mixed_formats_gelu_and_bfloat16(kernels, n_tokens):
    """A Q4_K_M file's experts (gate and up Q4_K, down Q6_K), GeGLU, bfloat16 activations, one to many tokens."""
    blocks = experts((T.Q4_K, T.Q4_K, T.Q6_K), 256, 256)
    x = torch.randn(n_tokens, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    ids, weights = routing(n_tokens, seed=3)
    native = NativeExperts(kernels, *as_laid_out(kernels, blocks, "tiles" if kernels.tiles else "file"), N_EXPERT,
                           activation="gelu_tanh")
    out = native(x, ids, weights)
    assert out.dtype == torch.bfloat16
    # bfloat16 rounds the gate/up outputs and the result to 8 bits (4e-3)
    assert_close(out.float(), loop_reference(x.float(), ids, weights, blocks, 256, "gelu_tanh"), relative=1e-2)


@pytest.mark.parametrize("n_tokens", [1, 9])
def test_gpt_oss_experts_with_biases_and_the_clamped_swiglu(kernels, n_tokens):
    """MXFP4 experts (as gpt-oss's files store them) with biases on gate, up and down, and gates wide enough that the
    clamp at 7 cuts many of them."""
    blocks = experts((T.MXFP4, T.MXFP4, T.MXFP4), 96, 64)
    generator = torch.Generator().manual_seed(8)
    x = 20 * torch.randn(n_tokens, 96, generator=generator)
    biases = ExpertBiases(torch.randn(N_EXPERT, 128, generator=generator), torch.randn(N_EXPERT, 96, generator=generator))
    ids, weights = routing(n_tokens, seed=9)
    native = NativeExperts(kernels, *as_laid_out(kernels, blocks, "tiles" if kernels.tiles else "file"), N_EXPERT,
                           activation="swiglu_oai", biases=biases)
    expected = loop_reference(x, ids, weights, blocks, 64, "swiglu_oai", biases)
    gate = reference.quantized_product(x, [blocks[0]]) + biases.gate_up[:, :64].reshape(1, -1)
    assert (gate > 7).float().mean() > 0.1  # the clamp is exercised
    assert_close(native(x, ids, weights), expected)
    assert (native(x, ids, weights).double() - loop_reference(x, ids, weights, blocks, 64, "silu", biases)).abs().max() > 1


def test_each_row_is_the_same_whatever_is_beside_it(kernels):
    """Batch invariance: a token's output bit for bit alone or among others routed elsewhere."""
    blocks = experts((T.Q8_0, T.Q8_0, T.Q8_0), 96, 160)
    native = NativeExperts(kernels, *blocks, N_EXPERT, activation="silu")
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(4))
    ids, weights = routing(9, seed=5)
    together = native(x, ids, weights)
    for t in (0, 4, 8):
        assert torch.equal(native(x[t:t + 1], ids[t:t + 1], weights[t:t + 1])[0], together[t])


def test_a_fused_gate_up_tensor_reads_as_two(kernels):
    """GGUF's ffn_gate_up_exps ([expert, 2 n_ff, n_embd]): expert e's gate rows then its up rows."""
    gate, up, down = experts((T.Q8_0, T.Q8_0, T.Q8_0), 96, 160)
    fused = torch.cat([torch.cat([gate.blocks[e * 160:(e + 1) * 160], up.blocks[e * 160:(e + 1) * 160]])
                       for e in range(N_EXPERT)])
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(6))
    ids, weights = routing(5, seed=7)
    separate = NativeExperts(kernels, gate, up, down, N_EXPERT, activation="silu")(x, ids, weights)
    together = NativeExperts(kernels, BlockMatrix(fused, T.Q8_0, 96), None, down, N_EXPERT, activation="silu")(x, ids, weights)
    assert torch.equal(separate, together)


def test_an_expert_id_out_of_range_is_refused(kernels):
    blocks = experts((T.Q8_0, T.Q8_0, T.Q8_0), 96, 160)
    native = NativeExperts(kernels, *blocks, N_EXPERT, activation="silu")
    with pytest.raises(ValueError, match="ids must lie in 0..5"):
        native(torch.randn(2, 96), torch.tensor([[0, 6, 1], [1, 2, 3]]), torch.ones(2, 3))
