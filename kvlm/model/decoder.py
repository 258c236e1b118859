"""One decoder for every family: embeddings, a walk over the layer kinds, final norm, LM head.

What differs between families (biases, QK-norm, RoPE scaling) is data in the config and its family.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvlm.core.family import ATTENTION, CONV, GATED_DELTA, MAMBA, SLIDING
from kvlm.kernels import BlockMatrix, dequantize, native_kernels
from kvlm.kernels.quantize import BLOCK as QUANT_BLOCK
from kvlm.kernels.quantize import QUANTIZERS
from kvlm.core.config import ModelConfig
from kvlm.memory.view import MemoryView
from kvlm.model.attention import attend_layer
from kvlm.model.embedding import Embedding
from kvlm.model.linear import (
    DenseLinear,
    Linear,
    NativeDenseLinear,
    PackedLinear,
    QuantizedLinear,
    dense_linear,
    linear_kind,
)
from kvlm.model.backend import backend_for
from kvlm.model.moe import BlockExperts, DenseExperts, MoEWeights
from kvlm.kernels.experts import ExpertBiases, NativeExperts
from kvlm.model.recurrent import (
    DeltaNetWeights,
    Mamba2Weights,
    ShortConvWeights,
    gated_delta_net,
    mamba2_mixer,
    short_conv,
)
from kvlm.model.per_layer import PerLayerInputs
from kvlm.core.rope import NoRope, Rope
from kvlm.model.settings import FROM_FILE, ComputeSettings

if TYPE_CHECKING:  # the loader's records of the weights the decoder is built from (the loader imports the model)
    from kvlm.loader.tensors import Stored
    from kvlm.loader.weights import ModelWeights


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: Linear             # Q, K and V projections stacked: one matmul instead of three
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # [n_head + n_head_kv, head_dim]: each Q head's then each K head's weight
    attn_output: Linear
    ffn_norm: torch.Tensor
    gate_up: Linear | None  # gate and up projections stacked (None in a layer of experts)
    down: Linear | None
    post_attention_norm: torch.Tensor | None = None  # sandwich norms (Gemma): on each output, before its add
    post_ffw_norm: torch.Tensor | None = None
    moe: MoEWeights | None = None  # experts in place of the MLP
    output_bias: torch.Tensor | None = None  # the attention output projection's bias (gpt-oss)
    sinks: torch.Tensor | None = None  # [n_head] float32: attention sinks' logits (gpt-oss)
    beside_mlp: ExpertsBesideMLP | None = None  # Gemma 4: experts beside the MLP (`moe`), with their own norms
    per_layer: PerLayerInput | None = None  # Gemma 4: the layer's per-layer input (PLE)
    output_scale: torch.Tensor | None = None  # Gemma 4: the layer's output times it


@dataclass
class ExpertsBesideMLP:
    """Gemma 4's norms around experts that run beside the MLP: the experts read pre_norm(x), the MLP's and the
    experts' outputs are normed apart (mlp_norm, experts_norm) and added."""

    pre_norm: torch.Tensor
    mlp_norm: torch.Tensor
    experts_norm: torch.Tensor


@dataclass
class PerLayerInput:
    """Gemma 4's per-layer input: x + post_norm(proj(gelu(gate(x)) * the layer's per-layer vector))."""

    gate: Linear
    proj: Linear
    post_norm: torch.Tensor


@dataclass
class ConvLayerWeights:
    """A short-convolution layer (LFM2): its norm, the gated convolution, then the same MLP as attention layers."""

    attn_norm: torch.Tensor
    conv: ShortConvWeights
    ffn_norm: torch.Tensor
    gate_up: Linear
    down: Linear


@dataclass
class MambaLayerWeights:
    """A Mamba2 layer: a norm, then the mixer, added to the residual stream (no MLP)."""

    attn_norm: torch.Tensor
    mixer: Mamba2Weights


@dataclass
class DeltaLayerWeights:
    """A Gated DeltaNet layer (Qwen3.5): its norm; the mixer's input projections (Q/K/V, the output gate z, beta's and
    the decay's) stacked in one matrix, split by `in_sizes`; the delta rule's own weights and the output projection;
    then the MLP, or experts, as an attention layer's."""

    attn_norm: torch.Tensor
    in_proj: Linear
    in_sizes: tuple[int, int, int, int]
    mixer: DeltaNetWeights
    out_proj: Linear
    ffn_norm: torch.Tensor
    gate_up: Linear | None
    down: Linear | None
    moe: MoEWeights | None = None


class Decoder:
    """`settings` say the activation dtype and how each matrix is stored (see kvlm.model.settings).

    The weights are read one tensor at a time, each turned into its kernel's form as it is read.

    `settings.batch_invariant` (every mode but the reference one) makes a token's logits independent of what else
    is in its batch, of how the batch is cut into micro-batches and of whether its prefix came from the prefix
    cache, bit for bit on one machine. With the native kernels that holds by construction: every token attends
    through the native attention, per token over its own cells in position order; the native products give a row
    the same bits at any row count (dense matrices go through oneDNN's packed products, which do too); the layer
    ops compute an element from its row alone. Without them (and in the reference mode when asked), torch's
    attention runs in float64 and dense products through oneDNN. The reference mode otherwise keeps
    transformers' own MKL products and attention, whose logits it then matches to ~1e-5.
    """

    def __init__(self, config: ModelConfig, weights: ModelWeights, settings: ComputeSettings) -> None:
        self.settings = settings
        self.config = config
        self.dtype = self.settings.torch_dtype
        self.batch_invariant = self.settings.batch_invariant
        # The hot ops' table (kvlm.model.backend): the native CPU kernels, or torch's in the reference mode and where
        # no compiler builds them. Recurrent layers step every token (a prompt as a run of decode steps) where the
        # backend offers it; otherwise prompts take torch's chunked scans.
        self.ops = backend_for(settings)
        self.kernels = self.ops.kernels
        self._recurrent = self.ops.recurrent
        self.layers = [self._layer(weights, i) for i in range(config.n_layer)]
        # Decode steps run each attention layer as one native call where its matrices are quantized.
        self.decode_layers = self.ops.decode_layers(config, self.layers, self.dtype)
        self.output_norm = self._vector(weights.read("output_norm.weight"))
        table = weights.read("token_embd.weight")
        tied = weights.output_name == "token_embd.weight" and weights.shard is None
        if tied and self._keeps_blocks(table):  # the LM head's layout, which the embedding then reads too
            table = native_kernels().interleave(table)
        self.token_embd = Embedding(table if self._keeps_blocks(table) else self._dense(table), self.dtype)
        self.output = self._head(weights, table if tied else weights.output())
        self.layer_ropes = self._layer_ropes(None)
        self.per_layer_inputs = self._per_layer_inputs(weights) if config.per_layer_embd else None
        scale = (config.n_embd ** 0.5 if config.family.scaled_embedding else 1.0) * config.embedding_multiplier
        self.embedding_scale = torch.tensor(scale).to(self.dtype) if scale != 1.0 else None
        # Tensor parallelism: this rank holds a share of each layer's heads and MLP width; the attention output
        # and the MLP output are partial sums, added up over the ranks (torch.distributed.all_reduce).
        self.all_reduce: Callable[[torch.Tensor], object] | None = None
        # ... and a share of the vocabulary: its logits go to rank 0 (which gets them all) through gather_logits.
        self.gather_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._blocks = {ATTENTION: self._attention_block, SLIDING: self._attention_block,  # by layer kind
                        CONV: self._conv_block, MAMBA: self._mamba_block, GATED_DELTA: self._delta_block}

    @property
    def quantized(self) -> bool:
        """Whether its matrices may be kept quantized (the fast mode), not all dense (the reference mode)."""
        return self.settings.quant is not None

    def describe(self) -> str:
        """The chosen settings and how many matrices each kernel got, for logs and `kvlm inspect`."""
        counts = Counter(linear_kind(m) for m in self.matrices())
        kinds = ", ".join(f"{n} {kind}" for kind, n in counts.most_common())
        return f"{self.settings.describe()}; matrices: {kinds}"

    def matrices(self) -> list[Linear]:
        return [self.output] + [m for layer in self.layers for m in vars(layer).values() if isinstance(m, Linear)]

    @property
    def nbytes(self) -> int:
        """The memory its weights take: blocks, dense copies, tables and vectors (shared storage counted once)."""
        seen: set[int] = set()
        return sum(_held(part, seen) for part in (self.token_embd, self.output, self.output_norm, *self.layers))

    def _keeps_blocks(self, stored: Stored) -> bool:
        return isinstance(stored, BlockMatrix) and self.settings.matrix_storage([stored.qtype.name]) == FROM_FILE

    def _dense(self, stored: Stored) -> torch.Tensor:
        """A tensor's values in the activation dtype (float32 for the reference mode: gguf's exact values)."""
        if isinstance(stored, BlockMatrix):
            return dequantize(stored, self.dtype)
        return stored.to(self.dtype)

    def _vector(self, stored: Stored) -> torch.Tensor:
        return self._dense(stored)

    def _matrix(self, parts: list[Stored], storage: str | None) -> Linear:
        """One matrix from parts stacked by rows, held as `storage` says (see ComputeSettings.matrix_storage)."""
        kernels = native_kernels()
        if storage == FROM_FILE:  # parts read for this matrix alone: rearranged in place for the products
            return QuantizedLinear([kernels.interleave(part) for part in parts], self.dtype, kernels)
        weight = torch.cat([self._unpacked(part) if storage is None else self._float(part) for part in parts])
        if storage is None or weight.shape[-1] % QUANT_BLOCK:  # rows not of whole blocks stay dense when
            # requantizing (Gemma 4's 16-wide per-layer inputs in a small model)
            return self._dense_linear(weight)
        return QuantizedLinear([kernels.interleave(QUANTIZERS[storage](weight))], self.dtype, kernels)

    def _dense_linear(self, weight: torch.Tensor, dtype: torch.dtype | None = None) -> Linear:
        """A dense matrix's product with activations in `dtype` (default: the model's); see linear.dense_linear."""
        return dense_linear(weight, dtype or self.dtype, self.batch_invariant, self.kernels)

    def _unpacked(self, stored: Stored) -> torch.Tensor:
        """A dense matrix as its file stores it (float16 and bfloat16 kept: the native dense product reads them),
        or dequantized to the activation dtype from a format the kernels do not read."""
        return dequantize(stored, self.dtype) if isinstance(stored, BlockMatrix) else stored

    @staticmethod
    def _float(stored: Stored) -> torch.Tensor:
        return dequantize(stored) if isinstance(stored, BlockMatrix) else stored.float()

    def _stacked(self, weights: ModelWeights, i: int, parts: tuple[str, ...]) -> Linear:
        """One matrix from several stacked by rows (one product instead of several)."""
        names = [weights.layer_name(i, p) for p in parts]
        storage = self.settings.matrix_storage([weights.file_type(n) for n in names])
        return self._matrix([weights.read(n) for n in names], storage)

    def _head(self, weights: ModelWeights, stored: Stored) -> Linear:
        """The LM head: never requantized below 8 bits (a 4-bit head costs more quality than the rest)."""
        storage = self.settings.matrix_storage([weights.file_type(weights.output_name)])
        return self._matrix([stored], "int8" if storage == "int4" else storage)

    def _layer(self, weights: ModelWeights, i: int) -> LayerWeights | ConvLayerWeights | MambaLayerWeights:
        if self.config.layer_kinds[i] == CONV:
            return self._conv_layer(weights, i)
        if self.config.layer_kinds[i] == MAMBA:
            return self._mamba_layer(weights, i)
        if self.config.layer_kinds[i] == GATED_DELTA:
            return self._delta_layer(weights, i)
        c, family = self.config, self.config.family
        shapes = family.layer_shapes(i, c)  # which of Q, K and V the layer has (see Family.layer_shapes)
        qkv = tuple(part for part in ("attn_q", "attn_k", "attn_v") if f"{part}.weight" in shapes)
        vector = lambda part, kind="weight": self._vector(weights.layer(i, part, kind))  # noqa: E731
        moe, beside = c.moe_layers[i], c.moe_layers[i] and family.experts_beside_mlp
        has_mlp = not moe or beside
        k_norm = vector("attn_k_norm") if "attn_k_norm.weight" in shapes else None
        return LayerWeights(
            attn_norm=vector("attn_norm"),
            qkv=self._stacked(weights, i, qkv),
            qkv_bias=torch.cat([vector(p, "bias") for p in qkv]) if family.qkv_bias else None,
            qk_norm=self._qk_norm(vector("attn_q_norm"), k_norm, i) if family.qk_norm else None,
            attn_output=self._stacked(weights, i, ("attn_output",)),
            ffn_norm=vector("ffn_norm"),
            gate_up=self._stacked(weights, i, ("ffn_gate", "ffn_up")) if has_mlp else None,
            down=self._stacked(weights, i, ("ffn_down",)) if has_mlp else None,
            moe=self._moe(weights, i) if moe else None,
            output_bias=vector("attn_output", "bias") if family.output_bias else None,
            sinks=self._float(weights.layer(i, "attn_sinks")).contiguous() if family.attention_sinks else None,
            beside_mlp=ExpertsBesideMLP(*(vector(n) for n in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2")))
            if beside else None,
            per_layer=PerLayerInput(self._stacked(weights, i, ("inp_gate",)), self._stacked(weights, i, ("proj",)),
                                    vector("post_norm")) if c.per_layer_embd else None,
            output_scale=vector("layer_output_scale") if family.layer_output_scale else None,
            **({name: vector(name) for name in ("post_attention_norm", "post_ffw_norm")}
               if family.sandwich_norms else {}),
        )

    def _per_layer_inputs(self, weights: ModelWeights) -> PerLayerInputs:
        """Gemma 4's per-layer input table (kept in its file's blocks as the token embedding is) and projection."""
        table, name = weights.read("per_layer_token_embd.weight"), "per_layer_model_proj.weight"
        projection = self._matrix([weights.read(name)], self.settings.matrix_storage([weights.file_type(name)]))
        return PerLayerInputs(self.config, Embedding(table if self._keeps_blocks(table) else self._dense(table),
                                                     self.dtype),
                              projection, self._vector(weights.read("per_layer_proj_norm.weight")), self.ops, self.dtype)

    def _moe(self, weights: ModelWeights, i: int) -> MoEWeights:
        """A layer's router (float32, as the routing is computed), experts and shared expert. Batch-invariant, the
        router's products give a row the same bits whatever the batch (MKL's may differ in their last bits): a
        token's experts and their weights are then the same whatever else is in its batch."""
        c, router = self.config, self._float(weights.layer(i, "ffn_gate_inp"))
        shared = {}
        if c.n_ff_shexp:
            shared = {"shared_gate_up": self._stacked(weights, i, ("ffn_gate_shexp", "ffn_up_shexp")),
                      "shared_down": self._stacked(weights, i, ("ffn_down_shexp",))}
        if c.n_ff_shexp and c.family.shared_expert_gate:
            gate = self._float(weights.layer(i, "ffn_gate_inp_shexp"))
            shared["shared_gate"] = self._dense_linear(gate, torch.float32)
        if c.family.expert_biases:
            shared["router_bias"] = self._float(weights.layer(i, "ffn_gate_inp", "bias"))
        if c.family.experts_beside_mlp:
            shared["router_input_scale"] = self._float(weights.layer(i, "ffn_gate_inp", "scale"))
            shared["expert_scale"] = self._float(weights.layer(i, "ffn_down_exps", "scale"))
            shared["router_norm_eps"] = c.rms_norm_eps
        return MoEWeights(self._dense_linear(router, torch.float32), self._experts(weights, i),
                          c.n_expert_used, c.expert_weights_norm, **shared)

    def _experts(self, weights: ModelWeights, i: int) -> DenseExperts | BlockExperts:
        """The experts in their file's blocks (or requantized) for the native call; dense, one product per expert,
        where the settings keep matrices dense or a part's format is not one the kernels read."""
        c, names = self.config, [weights.layer_name(i, f"ffn_{part}_exps") for part in ("gate", "up", "down")]
        storage = self.settings.matrix_storage([weights.file_type(n) for n in names])
        kernels = native_kernels()
        if storage is not None and kernels is not None:
            blocks = []
            for name in names:
                stored = weights.read(name)
                if storage != FROM_FILE:  # requantized: every expert's rows in turn, as the file stacks them
                    values = self._float(stored)
                    stored = QUANTIZERS[storage](values.reshape(-1, values.shape[-1]))
                blocks.append(kernels.interleave(stored))
            biases = self._expert_biases(weights, i, torch.float32)
            native = NativeExperts(kernels, blocks[0], blocks[1], blocks[2], c.n_expert, c.family.activation,
                                   biases, c.swiglu_alpha, c.swiglu_limit)
            return BlockExperts(native, (*blocks, biases))
        gate, up, down = (self._expert_values(weights.read(name), c.n_expert) for name in names)
        return DenseExperts([self._dense_linear(torch.cat([g, u])) for g, u in zip(gate, up)],
                            [self._dense_linear(d) for d in down],
                            self._expert_biases(weights, i, self.dtype), (c.swiglu_alpha, c.swiglu_limit))

    def _expert_biases(self, weights: ModelWeights, i: int, dtype: torch.dtype) -> ExpertBiases | None:
        """gpt-oss's experts' biases (None for a family without them)."""
        if not self.config.family.expert_biases:
            return None
        gate, up, down = (self._float(weights.layer(i, f"ffn_{part}_exps", "bias")) for part in ("gate", "up", "down"))
        if weights.shard is not None and weights.shard.rank != 0:  # the ranks' partial sums carry it once: rank 0's
            down = torch.zeros_like(down)
        return ExpertBiases(torch.cat([gate, up], dim=1).to(dtype), down.to(dtype))

    def _expert_values(self, stored: Stored, n_expert: int) -> torch.Tensor:
        """A tensor of experts as [expert, rows, cols] in the activation dtype."""
        values = self._dense(stored)
        return values.reshape(n_expert, -1, values.shape[-1])

    def _conv_layer(self, weights: ModelWeights, i: int) -> ConvLayerWeights:
        conv = ShortConvWeights(self._stacked(weights, i, ("shortconv.in_proj",)),
                                self._dense(weights.layer(i, "shortconv.conv")),
                                self._stacked(weights, i, ("shortconv.out_proj",)))
        return ConvLayerWeights(attn_norm=self._dense(weights.layer(i, "attn_norm")), conv=conv,
                                ffn_norm=self._dense(weights.layer(i, "ffn_norm")),
                                gate_up=self._stacked(weights, i, ("ffn_gate", "ffn_up")),
                                down=self._stacked(weights, i, ("ffn_down",)))

    def _mamba_layer(self, weights: ModelWeights, i: int) -> MambaLayerWeights:
        c, layer = self.config, lambda part, kind="weight": self._dense(weights.layer(i, part, kind))
        a = self._float(weights.read(f"blk.{i}.ssm_a"))
        mixer = Mamba2Weights(
            in_proj=self._stacked(weights, i, ("ssm_in",)), conv=layer("ssm_conv1d"),
            conv_bias=layer("ssm_conv1d", "bias"),
            dt_bias=self._float(weights.layer(i, "ssm_dt", "bias")), A_log=torch.log(-a),
            D=self._float(weights.read(f"blk.{i}.ssm_d")),
            norm=layer("ssm_norm"), out_proj=self._stacked(weights, i, ("ssm_out",)), n_heads=c.n_head,
            head_dim=c.head_dim,
            d_state=c.ssm_state, n_groups=c.ssm_groups, eps=c.rms_norm_eps, time_step_limit=c.ssm_dt_limit)
        return MambaLayerWeights(attn_norm=layer("attn_norm"), mixer=mixer)

    def _delta_layer(self, weights: ModelWeights, i: int) -> DeltaLayerWeights:
        """A and the time-step bias in float32 (as the delta rule runs, and as Mamba2's), the convolution and the
        gated norm's weight in the activation dtype, the projections as any matrix."""
        c, moe = self.config, self.config.moe_layers[i]
        vector = lambda name: self._float(weights.read(f"blk.{i}.{name}")).contiguous()  # noqa: E731
        mixer = DeltaNetWeights(
            conv=self._dense(weights.layer(i, "ssm_conv1d")), dt_bias=vector("ssm_dt.bias"), A=vector("ssm_a"),
            norm=self._vector(weights.layer(i, "ssm_norm")), n_k_heads=c.ssm_groups, n_v_heads=c.ssm_heads,
            k_head_dim=c.ssm_state, v_head_dim=c.ssm_inner // c.ssm_heads, eps=c.rms_norm_eps,
            v_heads_tiled=c.ssm_heads_tiled)
        return DeltaLayerWeights(
            attn_norm=self._vector(weights.layer(i, "attn_norm")),
            in_proj=self._stacked(weights, i, ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")),
            in_sizes=(2 * c.ssm_groups * c.ssm_state + c.ssm_inner, c.ssm_inner, c.ssm_heads, c.ssm_heads),
            mixer=mixer, out_proj=self._stacked(weights, i, ("ssm_out",)),
            ffn_norm=self._vector(weights.layer(i, "ffn_norm")),
            gate_up=None if moe else self._stacked(weights, i, ("ffn_gate", "ffn_up")),
            down=None if moe else self._stacked(weights, i, ("ffn_down",)),
            moe=self._moe(weights, i) if moe else None)

    def _qk_norm(self, q_norm: torch.Tensor, k_norm: torch.Tensor | None, i: int) -> torch.Tensor:
        """Q's norm weight for each Q head, then K's for each K head (none in a layer reading another's K/V)."""
        c = self.config
        if c.family.qk_norm_whole:  # [n_head * head_dim] then [n_head_kv * head_dim]
            return torch.cat([q_norm, k_norm])
        n_kv = c.attention_geometry(c.layer_kinds[i])[0] if k_norm is not None else 0
        return torch.cat([q_norm.expand(c.n_head, -1), *([k_norm.expand(n_kv, -1)] if n_kv else [])])

    def _ones(self, n: int) -> torch.Tensor:
        """The weight of a weightless RMSNorm (Gemma 4's V norm), for the layer ops' norm."""
        return torch.ones(n, dtype=self.dtype)

    def _whole_qk_norm(self, qk: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """OLMoE's QK-norm: RMSNorm over each token's whole Q projection, and over its whole K projection."""
        c = self.config
        n_tokens, q_size = qk.shape[0], c.n_head * c.head_dim
        q, k = qk.reshape(n_tokens, -1).split((q_size, c.n_head_kv * c.head_dim), dim=-1)
        q = self.ops.norm(q.contiguous(), weight[:q_size], c.rms_norm_eps)
        k = self.ops.norm(k.contiguous(), weight[q_size:], c.rms_norm_eps)
        return torch.cat([q, k], dim=-1).view(qk.shape)

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, kv: MemoryView, output_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """float32 logits [n_out, vocab] for the tokens at `output_rows` (all tokens when None).

        Each layer writes the K/V of `tokens` through `kv` before attending over the visible rows;
        nothing here makes those rows visible to later calls: the cache's commit does that.
        """
        return self.logits(tokens, positions, kv, output_rows)

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor, kv,
               output_rows: torch.Tensor | None) -> torch.Tensor:
        """`forward` without its inference mode, for graphs to trace; `kv`: the memory's view, or a graph's
        TracedView."""
        x = self.token_embd(tokens)
        if self.embedding_scale is not None:
            x = x * self.embedding_scale
        per_layer = self.per_layer_inputs(tokens, x) if self.per_layer_inputs is not None else None
        rotations = {id(rope): rope.cos_sin(positions, torch.float32) for rope in self.layer_ropes}
        for index, (kind, layer) in enumerate(zip(self.config.layer_kinds, self.layers)):
            x = self._blocks[kind](index, layer, x, *rotations[id(self.layer_ropes[index])], kv)
            if per_layer is not None:
                x = self.per_layer_inputs.add(layer.per_layer, x, per_layer[:, index])
            if getattr(layer, "output_scale", None) is not None:
                x = x * layer.output_scale
        if output_rows is not None:
            x = x[output_rows]
        logits = self.output(self.ops.norm(x, self.output_norm, self.config.rms_norm_eps)).float()
        if self.config.logit_scale != 1.0:
            logits = logits / self.config.logit_scale
        cap = self.config.final_logit_softcap
        logits = self.ops.softcap(logits.contiguous(), cap) if cap else logits
        return logits if self.gather_logits is None else self.gather_logits(logits)

    def fit_context(self, n_ctx: int) -> list[Rope | NoRope]:
        """Rotate as a context of n_ctx positions needs (LongRoPE's factors depend on it, see
        RopeScaling.for_context): the memory made for that context re-rotates its keys with the same RoPEs, which
        this returns, one per layer. A decoder serves one context length at a time."""
        self.layer_ropes = self._layer_ropes(n_ctx)
        return self.layer_ropes

    def _layer_ropes(self, n_ctx: int | None) -> list[Rope | NoRope]:
        """Each layer's RoPE: sliding layers may have their own base (Gemma 3's local layers), some layers none."""
        c = self.config
        full = Rope(c.rope.for_context(n_ctx), c.rope_dims or c.attention_geometry(ATTENTION)[1])
        local = Rope(c.rope_local.for_context(n_ctx), c.rope_dims or c.attention_geometry(SLIDING)[1]) \
            if c.rope_local else full
        none = NoRope(full.head_dim) if c.unrotated_layers else None
        return [none if i in c.unrotated_layers else local if kind == SLIDING else full
                for i, kind in enumerate(c.layer_kinds)]

    def _attention_block(self, index: int, layer: LayerWeights, x, cos, sin, kv: MemoryView) -> torch.Tensor:
        """Pre-norm attention then a pre-norm gated MLP, each added to the residual stream (each output normed
        once more first, for sandwich-norm families); one native call for decode tokens where it can be."""
        activation = self.config.family.activation
        if self.decode_layers is not None and self.all_reduce is None:
            done = self.decode_layers.run(index, layer, x, cos, sin, kv)
            if done is not None:
                x, experts_input = done
                return x if experts_input is None else x + layer.moe(experts_input, self.ops, activation)
        eps, ops, residual = self.config.rms_norm_eps, self.ops, self.config.residual_multiplier
        h = self._summed(self._attention(index, layer, ops.norm(x, layer.attn_norm, eps), cos, sin, kv))
        if layer.output_bias is not None:  # after the ranks' partial sums are added up: once
            h = h + layer.output_bias
        if layer.post_attention_norm is not None:
            h = ops.norm(h, layer.post_attention_norm, eps)
        normed, x = ops.add_norm(x, h if residual == 1.0 else h * residual, layer.ffn_norm, eps)
        h = self._mlp(layer, normed) if layer.beside_mlp is None else self._mlp_and_experts(layer, normed, x)
        h = h if layer.post_ffw_norm is None else ops.norm(h, layer.post_ffw_norm, eps)
        return x + (h if residual == 1.0 else h * residual)

    def _mlp(self, layer: LayerWeights | DeltaLayerWeights, normed: torch.Tensor) -> torch.Tensor:
        """The layer's gated MLP, or its experts, summed over the tensor-parallel ranks."""
        activation = self.config.family.activation
        return self._summed(layer.moe(normed, self.ops, activation) if layer.moe is not None else
                            self.ops.gated_mlp(normed, layer.gate_up, layer.down, activation))

    def _mlp_and_experts(self, layer: LayerWeights, normed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Gemma 4's MLP (on `normed`) and experts (on their own norm of the residual stream x, routed from x
        itself), each output normed, then added."""
        eps, ops, activation, norms = self.config.rms_norm_eps, self.ops, self.config.family.activation, layer.beside_mlp
        mlp = ops.norm(ops.gated_mlp(normed, layer.gate_up, layer.down, activation), norms.mlp_norm, eps)
        experts = layer.moe(ops.norm(x, norms.pre_norm, eps), ops, activation, router_input=x)
        return mlp + ops.norm(experts, norms.experts_norm, eps)

    def _summed(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel product's partial sum, added up over the tensor-parallel ranks (if any)."""
        if self.all_reduce is not None:
            self.all_reduce(partial)
        return partial

    def _conv_block(self, index: int, layer: ConvLayerWeights, x, cos, sin, kv) -> torch.Tensor:
        """The gated short convolution over each sequence's tokens (the micro-batch holds them as [n_seqs,
        n_tokens], see kvlm.memory.recurrent), from and to the sequence's state; then the MLP."""
        eps = self.config.rms_norm_eps
        state = kv.recurrent(index)
        h = self.ops.norm(x, layer.attn_norm, eps).view(*state.shape, -1)
        y, conv_state = short_conv(layer.conv, h, *state.read(), stepped=self._recurrent)
        state.write([conv_state])
        normed, x = self.ops.add_norm(x, y.reshape(x.shape), layer.ffn_norm, eps)
        return x + self.ops.gated_mlp(normed, layer.gate_up, layer.down, self.config.family.activation)

    def _delta_block(self, index: int, layer: DeltaLayerWeights, x, cos, sin, kv) -> torch.Tensor:
        """Qwen3.5's linear attention over each sequence's tokens (as [n_seqs, n_tokens], see _conv_block) from and
        to its convolution and delta-rule states; then the MLP."""
        eps, state = self.config.rms_norm_eps, kv.recurrent(index)
        projected = layer.in_proj(self.ops.norm(x, layer.attn_norm, eps)).view(*state.shape, -1)
        y, conv_state, delta_state = gated_delta_net(layer.mixer, *projected.split(layer.in_sizes, dim=-1),
                                                     *state.read(), step=self.ops.delta_step, stepped=self._recurrent)
        state.write([conv_state, delta_state])
        normed, x = self.ops.add_norm(x, layer.out_proj(y.reshape(x.shape[0], -1)), layer.ffn_norm, eps)
        return x + self._mlp(layer, normed)

    def _mamba_block(self, index: int, layer: MambaLayerWeights, x, cos, sin, kv) -> torch.Tensor:
        state = kv.recurrent(index)
        h = self.ops.norm(x, layer.attn_norm, self.config.rms_norm_eps).view(*state.shape, -1)
        y, conv_state, ssm_state = mamba2_mixer(layer.mixer, h, *state.read(), stepped=self._recurrent)
        state.write([conv_state, ssm_state])
        return x + y.reshape(x.shape)

    def _attention(self, index: int, layer: LayerWeights, h, cos, sin, kv: MemoryView) -> torch.Tensor:
        c, family = self.config, self.config.family
        kind = c.layer_kinds[index]
        n_head_kv, head_dim = c.attention_geometry(kind)
        # A layer reading another's K/V (Gemma 4) computes Q alone; one whose V is its K (before K's norm) no V.
        n_kv = n_head_kv if c.kv_source(index) == index else 0
        q_size, kv_size = c.n_head * head_dim, n_kv * head_dim
        n_tokens = h.shape[0]
        qkv = layer.qkv(h)
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        gate = None
        if family.attention_output_gate:  # each head's query, then its gate: Q and K heads put side by side
            q_gate, k, v = qkv.split((2 * q_size, kv_size, kv_size), dim=-1)
            q, gate = q_gate.view(n_tokens, c.n_head, 2, head_dim).unbind(2)
            qk = torch.cat([q, k.view(n_tokens, n_kv, head_dim)], dim=1)
        else:
            qk, v = qkv[:, :q_size + kv_size], qkv[:, q_size + kv_size:]
        if n_kv and v.shape[-1] == 0:  # V = K as projected
            v = qk[:, q_size:]
        v = v.view(n_tokens, n_kv, head_dim) if n_kv else None
        if v is not None and family.value_norm:  # before the QK-norm, which may run in place on K
            v = self.ops.norm(v.reshape(-1, head_dim).contiguous(), self._ones(head_dim), c.rms_norm_eps).view(v.shape)
        # Q and K heads side by side take their norm and rotation in one go.
        qk = qk.view(n_tokens, c.n_head + n_kv, head_dim)
        if layer.qk_norm is not None and family.qk_norm_whole:  # over each token's whole Q, then whole K
            qk = self._whole_qk_norm(qk, layer.qk_norm)
        elif layer.qk_norm is not None:
            qk = self.ops.head_norm(qk, layer.qk_norm, c.rms_norm_eps)
        q, k = self.ops.rope(qk, cos, sin).split((c.n_head, n_kv), dim=1)
        scale = c.query_scale * (head_dim ** 0.5 if family.unscaled_attention else 1.0)  # scores: q.k scale / sqrt(d)
        if scale != 1.0:
            q = q * scale
        out = attend_layer(kv, index, q, k if n_kv else None, v, self.batch_invariant, self.ops.attention_kernel(),
                           layer.sinks)
        if gate is not None:
            out = self.ops.sigmoid_gate(out, gate.reshape(n_tokens, -1))
        return layer.attn_output(out)


def _held(value, seen: set[int]) -> int:
    """Bytes held by a weight, a Linear, an Embedding or a dataclass of them; storage in `seen` is not counted."""
    if isinstance(value, torch.Tensor):
        if value.data_ptr() in seen:
            return 0
        seen.add(value.data_ptr())
        return value.numel() * value.element_size()
    if isinstance(value, BlockMatrix):
        return _held(value.blocks, seen)
    if isinstance(value, Embedding):
        return _held(value.blocks if value.blocks is not None else value.dense, seen)
    if isinstance(value, QuantizedLinear):
        return sum(_held(part, seen) for part in value.parts)
    if isinstance(value, (DenseLinear, PackedLinear, NativeDenseLinear)):
        return value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(_held(item, seen) for item in value)
    if dataclasses.is_dataclass(value):
        return sum(_held(getattr(value, f.name), seen) for f in dataclasses.fields(value))
    return 0
