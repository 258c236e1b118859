"""A decoder's layers read from its weights, one tensor at a time, each matrix held as its `ComputeSettings` say:
the records of kvlm.model.layers. What a layer holds follows from the tensors its family declares it to have
(Family.layer_shapes): a bias, a QK-norm, sandwich norms, sinks, a shared expert's gate are read where declared."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvlm.core.config import ModelConfig
from kvlm.core.family import CONV, GATED_DELTA, MAMBA
from kvlm.kernels import BlockMatrix, dequantize
from kvlm.kernels.experts import ExpertBiases
from kvlm.model.backend import float_values
from kvlm.model.embedding import Embedding
from kvlm.model.layers import (
    AttentionSpec,
    ConvLayerWeights,
    DeltaLayerWeights,
    ExpertsBesideMLP,
    LayerWeights,
    MambaLayerWeights,
    PerLayerInput,
)
from kvlm.model.linear import Linear
from kvlm.model.moe import BlockExperts, DenseExperts, MoEWeights
from kvlm.model.per_layer import PerLayerInputs
from kvlm.model.recurrent import DeltaNetWeights, Mamba2Weights, ShortConvWeights
from kvlm.model.settings import FROM_FILE, ComputeSettings

if TYPE_CHECKING:  # the loader's records of the weights (the loader imports the model)
    from kvlm.loader.tensors import Layout, Stored
    from kvlm.loader.weights import ModelWeights


def attention_spec(config: ModelConfig, i: int) -> AttentionSpec:
    """What layer i's attention computes beside its tensors: its heads (a layer's kind may have its own; one reading
    another layer's K/V computes none), its query scale, and the parts its family declares."""
    family, kind = config.family, config.layer_kinds[i]
    n_head_kv, head_dim = config.attention_geometry(kind)
    return AttentionSpec(
        n_head=config.n_head, n_kv=n_head_kv if config.kv_source(i) == i else 0, head_dim=head_dim,
        scale=config.query_scale * (head_dim ** 0.5 if family.unscaled_attention else 1.0),
        output_gate=family.attention_output_gate, whole_qk_norm=family.qk_norm_whole, value_norm=family.value_norm)


class LayerBuilder:
    """Reads a decoder's tensors into its kernels' forms; `backend` gives the kernels (kvlm.model.backend)."""

    def __init__(self, config: ModelConfig, settings: ComputeSettings, backend) -> None:
        self.config, self.settings, self.ops = config, settings, backend
        self.dtype, self.batch_invariant = settings.torch_dtype, settings.batch_invariant
        self.activation = config.family.activation

    def embedding_scale(self) -> torch.Tensor | None:
        """What embeddings are multiplied by (sqrt(n_embd) where the family scales them, times a multiplier), or
        None for 1."""
        c = self.config
        scale = (c.n_embd ** 0.5 if c.family.scaled_embedding else 1.0) * c.embedding_multiplier
        return torch.tensor(scale).to(self.dtype) if scale != 1.0 else None

    def keeps_blocks(self, stored: Stored) -> bool:
        return isinstance(stored, BlockMatrix) and self.settings.matrix_storage([stored.qtype.name]) == FROM_FILE

    def dense(self, stored: Stored) -> torch.Tensor:
        """A tensor's values in the activation dtype (float32 for the reference mode: gguf's exact values), where
        the backend computes."""
        if isinstance(stored, BlockMatrix):
            return self.ops.place(dequantize(stored, self.dtype))
        return self.ops.place(stored.to(self.dtype))

    def vector(self, stored: Stored) -> torch.Tensor:
        return self.dense(stored)

    def _matrix(self, parts: list[Stored], storage: str | None) -> Linear:
        """One matrix from parts stacked by rows, held as `storage` says (see ComputeSettings.matrix_storage)."""
        return self.ops.matrix(parts, storage, self.dtype, self.batch_invariant)

    def _dense_linear(self, weight: torch.Tensor, dtype: torch.dtype | None = None) -> Linear:
        """A dense matrix's product with activations in `dtype` (default: the model's)."""
        return self.ops.dense_matrix(weight, dtype or self.dtype, self.batch_invariant)

    def _float(self, stored: Stored) -> torch.Tensor:
        """A tensor's values in float32, where the backend computes."""
        return self.ops.place(float_values(stored))

    def layout(self, storage: str | None) -> Layout | None:
        """How a matrix held as `storage` is best read: in the products' layout where its blocks are kept as stored
        (ModelWeights.read then takes it from the tile cache where it can), else as the file stores it (None)."""
        return self.ops.products_layout() if storage == FROM_FILE else None

    def _stacked(self, weights: ModelWeights, i: int, parts: tuple[str, ...]) -> Linear:
        """One matrix from several stacked by rows (one product instead of several)."""
        names = [weights.layer_name(i, p) for p in parts]
        storage = self.settings.matrix_storage([weights.file_type(n) for n in names])
        return self._matrix([weights.read(n, self.layout(storage)) for n in names], storage)

    def head(self, weights: ModelWeights, tied_table: Stored | None) -> Linear:
        """The LM head (the tied embedding's table where given): never requantized below 8 bits (a 4-bit head costs
        more quality than the rest)."""
        storage = self.settings.matrix_storage([weights.file_type(weights.output_name)])
        stored = tied_table if tied_table is not None else weights.output(self.layout(storage))
        return self._matrix([stored], "int8" if storage == "int4" else storage)

    def layer(self, weights: ModelWeights, i: int) -> LayerWeights | ConvLayerWeights | MambaLayerWeights:
        if self.config.layer_kinds[i] == CONV:
            return self._conv_layer(weights, i)
        if self.config.layer_kinds[i] == MAMBA:
            return self._mamba_layer(weights, i)
        if self.config.layer_kinds[i] == GATED_DELTA:
            return self._delta_layer(weights, i)
        c, shapes = self.config, self._shapes(i)
        qkv = tuple(part for part in ("attn_q", "attn_k", "attn_v") if f"{part}.weight" in shapes)
        vector = lambda part, kind="weight": self.vector(weights.layer(i, part, kind))  # noqa: E731
        has = lambda part: part in shapes  # noqa: E731
        moe, beside, has_mlp = c.moe_layers[i], has("pre_ffw_norm_2.weight"), has("ffn_gate.weight")
        spec = attention_spec(c, i)
        k_norm = vector("attn_k_norm") if has("attn_k_norm.weight") else None
        return LayerWeights(
            attn_norm=vector("attn_norm"),
            qkv=self._stacked(weights, i, qkv),
            qkv_bias=torch.cat([vector(p, "bias") for p in qkv]) if has(f"{qkv[0]}.bias") else None,
            qk_norm=self._qk_norm(vector("attn_q_norm"), k_norm, spec) if has("attn_q_norm.weight") else None,
            attn_output=self._stacked(weights, i, ("attn_output",)),
            ffn_norm=vector("ffn_norm"),
            gate_up=self._stacked(weights, i, ("ffn_gate", "ffn_up")) if has_mlp else None,
            down=self._stacked(weights, i, ("ffn_down",)) if has_mlp else None,
            spec=spec,
            moe=self._moe(weights, i) if moe else None,
            output_bias=vector("attn_output", "bias") if has("attn_output.bias") else None,
            sinks=self._float(weights.layer(i, "attn_sinks")).contiguous() if has("attn_sinks.weight") else None,
            beside_mlp=ExpertsBesideMLP(*(vector(n) for n in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2")))
            if beside else None,
            per_layer=PerLayerInput(self._stacked(weights, i, ("inp_gate",)), self._stacked(weights, i, ("proj",)),
                                    vector("post_norm")) if has("inp_gate.weight") else None,
            output_scale=vector("layer_output_scale") if has("layer_output_scale.weight") else None,
            **({name: vector(name) for name in ("post_attention_norm", "post_ffw_norm")}
               if has("post_attention_norm.weight") else {}),
        )

    def _shapes(self, i: int) -> dict[str, tuple]:
        """The tensors layer i has (the family's declaration, see Family.layer_shapes): which optional parts it reads
        and runs follows from them."""
        return self.config.family.layer_shapes(i, self.config)

    def per_layer_inputs(self, weights: ModelWeights) -> PerLayerInputs:
        """The per-layer input table (kept in its file's blocks as the token embedding is) and projection."""
        table, name = weights.read("per_layer_token_embd.weight"), "per_layer_model_proj.weight"
        storage = self.settings.matrix_storage([weights.file_type(name)])
        projection = self._matrix([weights.read(name, self.layout(storage))], storage)
        return PerLayerInputs(self.config, Embedding(table if self.keeps_blocks(table) else self.dense(table),
                                                     self.dtype),
                              projection, self.vector(weights.read("per_layer_proj_norm.weight")), self.ops, self.dtype)

    def _moe(self, weights: ModelWeights, i: int) -> MoEWeights:
        """A layer's router (float32, as the routing is computed), experts and shared expert. Batch-invariant, the
        router's products give a row the same bits whatever the batch (MKL's may differ in their last bits): a
        token's experts and their weights are then the same whatever else is in its batch."""
        c, router = self.config, self._float(weights.layer(i, "ffn_gate_inp"))
        shared = {}
        if c.n_ff_shexp:
            shared = {"shared_gate_up": self._stacked(weights, i, ("ffn_gate_shexp", "ffn_up_shexp")),
                      "shared_down": self._stacked(weights, i, ("ffn_down_shexp",))}
        shapes = self._shapes(i)
        if c.n_ff_shexp and "ffn_gate_inp_shexp.weight" in shapes:
            gate = self._float(weights.layer(i, "ffn_gate_inp_shexp"))
            shared["shared_gate"] = self._dense_linear(gate, torch.float32)
        if "ffn_gate_inp.bias" in shapes:
            shared["router_bias"] = self._float(weights.layer(i, "ffn_gate_inp", "bias"))
        if "ffn_gate_inp.scale" in shapes:  # experts beside the MLP, routed from the residual stream
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
        stored = [weights.read(name, self.layout(storage)) for name in names]
        block_experts = self.ops.block_experts(stored, storage, c.n_expert, self.activation,
                                               self._expert_biases(weights, i, torch.float32),
                                               (c.swiglu_alpha, c.swiglu_limit))
        if block_experts is not None:  # (which may have rearranged `stored` in place)
            return block_experts
        gate, up, down = (self._expert_values(part, c.n_expert) for part in stored)
        return DenseExperts([self._dense_linear(torch.cat([g, u])) for g, u in zip(gate, up)],
                            [self._dense_linear(d) for d in down],
                            self._expert_biases(weights, i, self.dtype), (c.swiglu_alpha, c.swiglu_limit))

    def _expert_biases(self, weights: ModelWeights, i: int, dtype: torch.dtype) -> ExpertBiases | None:
        """The experts' biases (None for experts without)."""
        if "ffn_gate_exps.bias" not in self._shapes(i):
            return None
        gate, up, down = (self._float(weights.layer(i, f"ffn_{part}_exps", "bias")) for part in ("gate", "up", "down"))
        if weights.shard is not None and weights.shard.rank != 0:  # the ranks' partial sums carry it once: rank 0's
            down = torch.zeros_like(down)
        return ExpertBiases(torch.cat([gate, up], dim=1).to(dtype), down.to(dtype))

    def _expert_values(self, stored: Stored, n_expert: int) -> torch.Tensor:
        """A tensor of experts as [expert, rows, cols] in the activation dtype."""
        values = self.dense(stored)
        return values.reshape(n_expert, -1, values.shape[-1])

    def _conv_layer(self, weights: ModelWeights, i: int) -> ConvLayerWeights:
        conv = ShortConvWeights(self._stacked(weights, i, ("shortconv.in_proj",)),
                                self.dense(weights.layer(i, "shortconv.conv")),
                                self._stacked(weights, i, ("shortconv.out_proj",)))
        return ConvLayerWeights(attn_norm=self.dense(weights.layer(i, "attn_norm")), conv=conv,
                                ffn_norm=self.dense(weights.layer(i, "ffn_norm")),
                                gate_up=self._stacked(weights, i, ("ffn_gate", "ffn_up")),
                                down=self._stacked(weights, i, ("ffn_down",)))

    def _mamba_layer(self, weights: ModelWeights, i: int) -> MambaLayerWeights:
        c, layer = self.config, lambda part, kind="weight": self.dense(weights.layer(i, part, kind))
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
            conv=self.dense(weights.layer(i, "ssm_conv1d")), dt_bias=vector("ssm_dt.bias"), A=vector("ssm_a"),
            norm=self.vector(weights.layer(i, "ssm_norm")), n_k_heads=c.ssm_groups, n_v_heads=c.ssm_heads,
            k_head_dim=c.ssm_state, v_head_dim=c.ssm_inner // c.ssm_heads, eps=c.rms_norm_eps,
            v_heads_tiled=c.ssm_heads_tiled)
        return DeltaLayerWeights(
            attn_norm=self.vector(weights.layer(i, "attn_norm")),
            in_proj=self._stacked(weights, i, ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")),
            in_sizes=(2 * c.ssm_groups * c.ssm_state + c.ssm_inner, c.ssm_inner, c.ssm_heads, c.ssm_heads),
            mixer=mixer, out_proj=self._stacked(weights, i, ("ssm_out",)),
            ffn_norm=self.vector(weights.layer(i, "ffn_norm")),
            gate_up=None if moe else self._stacked(weights, i, ("ffn_gate", "ffn_up")),
            down=None if moe else self._stacked(weights, i, ("ffn_down",)),
            moe=self._moe(weights, i) if moe else None)

    @staticmethod
    def _qk_norm(q_norm: torch.Tensor, k_norm: torch.Tensor | None, spec: AttentionSpec) -> torch.Tensor:
        """Q's norm weight for each Q head, then K's for each K head (none in a layer reading another's K/V)."""
        if spec.whole_qk_norm:  # [n_head * head_dim] then [n_head_kv * head_dim]
            return torch.cat([q_norm, k_norm])
        n_kv = spec.n_kv if k_norm is not None else 0
        return torch.cat([q_norm.expand(spec.n_head, -1), *([k_norm.expand(n_kv, -1)] if n_kv else [])])
