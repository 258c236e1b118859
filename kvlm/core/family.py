"""What sets one decoder architecture apart from another: data, not a fork of the decoder. And the registry of
families by architecture name, which kvlm.families fills on import (so that a config can name its family without
this core importing the families above it)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvlm.core.errors import UnsupportedModelError

ATTENTION = "attention"  # the layer kinds the decoder knows
SLIDING = "sliding_attention"  # attention over only the last `sliding_window` positions (Gemma 3's local layers)
CONV = "conv"  # a gated short convolution whose last inputs are its state (LFM2): a recurrent layer
MAMBA = "mamba"  # a Mamba2 mixer: a convolution state and an SSM state per sequence
# Qwen3.5's linear attention (Gated DeltaNet): a convolution state and a delta-rule state per sequence
GATED_DELTA = "gated_delta"
LAYER_KINDS = (ATTENTION, SLIDING, CONV, MAMBA, GATED_DELTA)
RECURRENT_KINDS = (CONV, MAMBA, GATED_DELTA)
ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")  # swiglu_oai: gpt-oss's clamped SwiGLU (its experts only)


@dataclass(frozen=True)
class Family:
    """One architecture: how its files name it, and which optional parts its layers have.

    `name` is the GGUF `general.architecture`; `hf_architectures` the `architectures[0]` values of
    config.json (its `model_type` is accepted too, and `hf_other_model_types`: those of a second architecture). Tensor names follow GGUF's; Hugging Face names are
    mapped onto them by the loader.
    """

    name: str
    hf_architectures: tuple[str, ...]
    hf_model_type: str
    hf_other_model_types: tuple[str, ...] = ()
    qkv_bias: bool = False      # biases on the Q, K and V projections (not on the output)
    qk_norm: bool = False       # RMSNorm over head_dim on each Q and K head, before RoPE
    permuted_qk: bool = False   # llama.cpp stores Q/K rows of this architecture permuted for its RoPE
    default_head_dim: int | None = None  # config.json's head_dim when absent (transformers' default), else d / heads
    sandwich_norms: bool = False  # RMSNorm on the attention and MLP outputs too, before each residual add
    activation: str = "silu"      # of the gated MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    scaled_embedding: bool = False  # embeddings multiplied by sqrt(n_embd)
    hf_norm_offset: float = 0.0   # config.json norms hold w - offset (the forward multiplies by offset + w)
    sliding_period: int = 0       # with a sliding window, every n-th layer attends fully, the others slide
    hf_layer_names: tuple[tuple[str, str], ...] = ()  # Hugging Face layer parts named otherwise than Llama's
    # GGUF files do not store the query scale; llama.cpp derives it: (n_layer, n_embd, n_head, head_dim) -> scale
    gguf_query_scale: Callable[[int, int, int, int], float] | None = None
    # The chat template for a file that carries none of its own (a base model's GGUF, say); a file's own wins
    default_chat_template: str | None = None
    hf_global_names: tuple[tuple[str, str], ...] = ()  # Hugging Face names of whole-model tensors, where not Llama's
    hf_ff_size: Callable[[dict], int] | None = None  # the MLP width from config.json, when not intermediate_size
    gguf_names: tuple[tuple[str, str], ...] = ()  # (kvlm's name, the family's GGUF name) of whole-model tensors
    fixed_layer_kind: str = ""  # every layer of this kind (Mamba2's), whatever the file says
    hf_prefix: str = "model"
    hf_config: Callable[[dict], dict] | None = None  # config.json -> the ModelConfig layer fields, if not Llama's
    gguf_config: Callable[[Callable, frozenset], dict] | None = None  # the same from GGUF metadata (read by key
    # suffix) and the file's tensor names
    # Fields a Llama-like family adds to the Llama ones (or overrides): from config.json, and from GGUF metadata
    hf_options: Callable[[dict], dict] | None = None
    gguf_options: Callable[[Callable, frozenset], dict] | None = None
    gguf_reshaped: tuple[str, ...] = ()  # tensor name endings a GGUF file stores in another shape, same values  # config.json's tensors are named {hf_prefix}.layers.N...
    # A Hugging Face tensor stored otherwise than GGUF stores it: (GGUF suffix, how to turn one into the other)
    hf_values: tuple[tuple[str, Callable], ...] = ()
    qk_norm_whole: bool = False  # the QK-norm over each token's whole Q and K projections, not per head (OLMoE)
    # Mixture of experts: whether llama.cpp renormalises the chosen experts' weights for a GGUF file that does not
    # say (no {arch}.expert_weights_norm key); a Hugging Face config says with norm_topk_prob (or always, below)
    gguf_expert_weights_norm: bool = False
    hf_expert_weights_norm: bool | None = None  # always (Mixtral, Granite), whatever config.json says; None: it says
    shared_expert_gate: bool = False  # the shared expert's output times sigmoid(a learned row . x) (Qwen2-MoE)
    # gpt-oss: a bias on the attention output too; a learned sink logit per head in each attention softmax; the
    # router's and the experts' products with biases; its experts in Hugging Face folders as [expert, in, out]
    # tensors with gate and up columns interleaved
    output_bias: bool = False
    attention_sinks: bool = False
    expert_biases: bool = False
    hf_experts_interleaved: bool = False
    sliding_rope_base: bool = True  # sliding layers' RoPE has a base of its own (Gemma 3's); else the full layers'
    gguf_yarn_truncate: bool = True  # YaRN's correction range rounded to whole dimensions (llama.cpp's rule)
    gguf_layer_names: tuple[tuple[str, str], ...] = ()  # (kvlm's, the file's) name of a layer tensor, where not Llama's
    # Qwen3.5: the Q projection gives each head its query and then as many gate values; the attention's output is
    # multiplied by sigmoid(gate) before the output projection
    attention_output_gate: bool = False
    # Gemma 4: attention scores not scaled (1, not 1/sqrt(head_dim)); V heads through a weightless RMSNorm; each
    # layer's output times a learned scalar (layer_output_scale); experts beside the MLP, not instead of it: the
    # router reads the residual stream (weightless norm, times a learned vector and 1/sqrt(n_embd)), the experts a
    # norm of their own (pre_ffw_norm_2), each part normed after (post_ffw_norm_1, _2) and the two added
    unscaled_attention: bool = False
    value_norm: bool = False
    layer_output_scale: bool = False
    experts_beside_mlp: Callable[[object], dict] | None = None  # given: the tensors this adds to a MoE layer (c -> shapes)
    # The mixer tensors of its recurrent layers (CONV, MAMBA or GATED_DELTA), GGUF names: ModelConfig -> shapes
    recurrent_shapes: Callable[[object], dict] | None = None
    tensor_parallel: bool = True  # whether kvlm.loader.shard can split its layers over ranks (not Gemma 4's yet)
    # Layer tensors its files store stacked by rows in one: (the stored tensor, the parts it stacks in order), GGUF
    # names; each part is read as its rows (Phi-3's Q/K/V as attn_qkv, its gate and up as ffn_up)
    fused_tensors: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def layer_kinds(self, n_layer: int, sliding: bool = False) -> tuple[str, ...]:
        """llama.cpp's pattern: with a window, layer i slides unless i % period == period - 1."""
        if self.fixed_layer_kind:
            return (self.fixed_layer_kind,) * n_layer
        if not (sliding and self.sliding_period):
            return (ATTENTION,) * n_layer
        return tuple(ATTENTION if i % self.sliding_period == self.sliding_period - 1 else SLIDING
                     for i in range(n_layer))

    def layer_shapes(self, layer: int, c) -> dict[str, tuple]:
        """Shape of every tensor of layer `layer` (for the ModelConfig `c`) by GGUF suffix, [out, in] for matrices as
        torch's linear expects, [expert, out, in] for experts'."""
        kind, moe = c.layer_kinds[layer], c.moe_layers[layer]
        n_embd, n_ff = c.n_embd, c.ff_width(layer)
        dense = {"ffn_gate.weight": (n_ff, n_embd), "ffn_up.weight": (n_ff, n_embd), "ffn_down.weight": (n_embd, n_ff)}
        mlp = self.expert_shapes(c) if moe else dense
        if moe and self.experts_beside_mlp:
            mlp = {**dense, **mlp, **self.experts_beside_mlp(c)}
        shapes = {"attn_norm.weight": (n_embd,)}
        if moe or n_ff:  # (a Mamba2 layer is its mixer alone)
            shapes.update({"ffn_norm.weight": (n_embd,), **mlp})
        if kind in RECURRENT_KINDS:
            if self.recurrent_shapes is None:
                raise UnsupportedModelError(f"{self.name} declares no tensors for its {kind} layers")
            return {**shapes, **self.recurrent_shapes(c)}
        shapes.update(self._attention_shapes(layer, c))
        if c.per_layer_embd:
            shapes.update({"inp_gate.weight": (c.per_layer_embd, n_embd), "proj.weight": (n_embd, c.per_layer_embd),
                           "post_norm.weight": (n_embd,)})
        if self.layer_output_scale:
            shapes["layer_output_scale.weight"] = (1,)
        return shapes

    def _attention_shapes(self, layer: int, c) -> dict[str, tuple]:
        """An attention layer's own tensors; one that reads another layer's K/V has no K or V projection or K norm,
        nor has a full layer whose V is its K any V projection."""
        kind, n_embd, n_head = c.layer_kinds[layer], c.n_embd, c.n_head
        n_head_kv, head_dim = c.attention_geometry(kind)
        q_rows, kv_rows = n_head * head_dim, n_head_kv * head_dim
        shapes = {"attn_q.weight": (q_rows * (2 if self.attention_output_gate else 1), n_embd),
                  "attn_k.weight": (kv_rows, n_embd), "attn_v.weight": (kv_rows, n_embd),
                  "attn_output.weight": (n_embd, q_rows)}
        if self.qkv_bias:
            shapes.update({"attn_q.bias": (q_rows,), "attn_k.bias": (kv_rows,), "attn_v.bias": (kv_rows,)})
        if self.output_bias:
            shapes["attn_output.bias"] = (n_embd,)
        if self.attention_sinks:
            shapes["attn_sinks.weight"] = (n_head,)
        if self.qk_norm:
            q_norm, k_norm = (q_rows, kv_rows) if self.qk_norm_whole else (head_dim, head_dim)
            shapes.update({"attn_q_norm.weight": (q_norm,), "attn_k_norm.weight": (k_norm,)})
        if self.sandwich_norms:
            shapes.update({"post_attention_norm.weight": (n_embd,), "post_ffw_norm.weight": (n_embd,)})
        if c.kv_source(layer) != layer:
            shapes = {name: shape for name, shape in shapes.items() if name.split(".")[0] not in _KV_PARTS}
        elif c.full_v_is_k and kind != SLIDING:
            del shapes["attn_v.weight"]
        return shapes

    def expert_shapes(self, c) -> dict[str, tuple]:
        """A MoE layer's router, experts and shared expert (GGUF names)."""
        n_embd, n_expert, width, shared = c.n_embd, c.n_expert, c.n_ff_exp, c.n_ff_shexp
        shapes = {"ffn_gate_inp.weight": (n_expert, n_embd), "ffn_gate_exps.weight": (n_expert, width, n_embd),
                  "ffn_up_exps.weight": (n_expert, width, n_embd), "ffn_down_exps.weight": (n_expert, n_embd, width)}
        if shared:
            shapes.update({"ffn_gate_shexp.weight": (shared, n_embd), "ffn_up_shexp.weight": (shared, n_embd),
                           "ffn_down_shexp.weight": (n_embd, shared)})
        if shared and self.shared_expert_gate:
            shapes["ffn_gate_inp_shexp.weight"] = (1, n_embd)
        if self.expert_biases:
            shapes.update({"ffn_gate_inp.bias": (n_expert,), "ffn_gate_exps.bias": (n_expert, width),
                           "ffn_up_exps.bias": (n_expert, width), "ffn_down_exps.bias": (n_expert, n_embd)})
        return shapes


_KV_PARTS = ("attn_k", "attn_v", "attn_k_norm")  # what a layer reading another's K/V does without


# Every family by its GGUF `general.architecture`: filled by kvlm.families (imported with kvlm itself).
FAMILIES: dict[str, Family] = {}


def family_named(architecture: object, where: object = "the model") -> Family:
    """The family of a GGUF `general.architecture` (or a ModelConfig's `architecture`)."""
    if architecture not in FAMILIES:
        raise UnsupportedModelError(
            f"{where}: architecture {architecture!r} is not supported (supported: {', '.join(FAMILIES)})"
        )
    return FAMILIES[architecture]
