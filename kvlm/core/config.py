"""The one flat description of a model that every other layer reads."""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from functools import cache
from itertools import groupby

from kvlm.core.family import ATTENTION, CONV, GATED_DELTA, LAYER_KINDS, MAMBA, RECURRENT_KINDS, SLIDING, family_named
from kvlm.core.rope import RopeScaling

POOLINGS = ("last", "mean", "cls")  # how an embedding is pooled (kvlm.engine.pooling)
GGUF_POOLING_TYPES = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's LLAMA_POOLING_TYPE_* (0 none, 4 rank)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    name: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    vocab_size: int
    n_ctx_train: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope: RopeScaling = field(default_factory=RopeScaling)
    layer_kinds: tuple[str, ...] = ()  # one per layer; empty means the family's own list
    sliding_window: int = 0  # positions a sliding layer sees, its own included; 0 when there are none
    rope_local: RopeScaling | None = None  # the sliding layers' RoPE, when it differs from `rope`
    query_scale: float = 1.0  # Q is multiplied by it: attention scores are scaled by query_scale / sqrt(head_dim)
    final_logit_softcap: float = 0.0  # logits become cap * tanh(logits / cap); 0 for none
    conv_kernel: int = 0  # the short convolution's width (LFM2's conv_L_cache, Mamba2's conv_kernel); 0 for none
    ssm_inner: int = 0  # Mamba2: the mixer's width (n_head x head_dim: its heads are the SSM's)
    ssm_state: int = 0  # Mamba2: the state size N per head channel
    ssm_groups: int = 0  # Mamba2: groups of heads sharing B and C
    ssm_dt_limit: tuple[float, float] = (0.0, float("inf"))  # Mamba2: time steps are clamped to it
    n_expert: int = 0  # mixture of experts: routed experts per MoE layer (0: every layer has a plain MLP)
    n_expert_used: int = 0  # experts each token is routed to (top-k)
    n_ff_exp: int = 0  # each routed expert's MLP width
    n_ff_shexp: int = 0  # the shared expert's width (every token goes through it too); 0 for none
    expert_weights_norm: bool = False  # the chosen experts' probabilities renormalised to sum to 1
    moe_layers: tuple[bool, ...] = ()  # per layer: experts instead of the MLP; empty means every layer when n_expert
    embedding_multiplier: float = 1.0  # embeddings times it
    residual_multiplier: float = 1.0  # attention and MLP outputs times it before each residual add
    logit_scale: float = 1.0  # logits divided by it
    swiglu_alpha: float = 1.702  # gpt-oss's clamped SwiGLU: its sigmoid's gain ...
    swiglu_limit: float = 7.0  # ... and the clamp of its gate (above) and up (both sides)
    rope_dims: int = 0  # RoPE rotates the first rope_dims of each head (Qwen3.5's quarter); 0: the whole head
    unrotated_layers: tuple[int, ...] = ()  # attention layers without RoPE (SmolLM3's every fourth, "NoPE")
    # Gated DeltaNet layers (Qwen3.5) read ssm_state as the key head size, ssm_groups as the key heads and ssm_inner as
    # all value heads' width; ssm_heads is the number of value heads, a multiple of the key heads. Hugging Face
    # weights group the value heads by key head (value head j reads key head j // (ssm_heads / ssm_groups)); GGUF
    # files tile them (j reads key head j % ssm_groups): llama.cpp's converter reorders them for its broadcasts.
    ssm_heads: int = 0
    ssm_heads_tiled: bool = False
    # Gemma 4: full-attention layers with their own head size and KV heads (0: head_dim, n_head_kv as the others);
    # the last n_kv_shared layers compute no K/V but read those of the last earlier layer of their kind (which
    # the memory then holds once); full layers whose V is their K projection (attention_k_eq_v); a per-layer input
    # embedding of per_layer_embd values per layer (PLE); layer_n_ff: each layer's MLP width (empty: n_ff for all).
    full_head_dim: int = 0
    full_n_head_kv: int = 0
    n_kv_shared: int = 0
    full_v_is_k: bool = False
    per_layer_embd: int = 0
    layer_n_ff: tuple[int, ...] = ()
    pooling: str = "last"  # how an embedding is pooled from the final norm's output (kvlm.engine.pooling)

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "vocab_size", "n_ctx_train"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.n_ff, int) or self.n_ff < 0:  # 0: no layer has an MLP (Mamba2)
            raise ValueError(f"ModelConfig.n_ff must be a non-negative integer, got {self.n_ff!r}")
        if self.n_head % self.n_head_kv:
            raise ValueError(
                f"ModelConfig.n_head ({self.n_head}) must be a multiple of n_head_kv ({self.n_head_kv})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        self._check_full_geometry()
        factors, full_dim = self.rope.freq_factors, self.attention_geometry(ATTENTION)[1]
        if factors is not None and len(factors) != full_dim // 2:
            raise ValueError(f"ModelConfig.rope has {len(factors)} frequency factors; head_dim {full_dim} "
                             f"needs {full_dim // 2}")
        if not self.layer_kinds:
            object.__setattr__(self, "layer_kinds", self.family.layer_kinds(self.n_layer, self.sliding_window > 0))
        object.__setattr__(self, "layer_kinds", tuple(self.layer_kinds))  # hashable: kv_source's cache is keyed by it
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", (self.n_expert > 0,) * self.n_layer)
        self._check_layer_kinds()
        object.__setattr__(self, "unrotated_layers", tuple(self.unrotated_layers))
        if any(not isinstance(i, int) or not 0 <= i < self.n_layer or self.layer_kinds[i] not in (ATTENTION, SLIDING)
               for i in self.unrotated_layers):
            raise ValueError(f"ModelConfig.unrotated_layers must list attention layers of the {self.n_layer}, "
                             f"got {self.unrotated_layers!r}")
        self._check_experts()
        self._check_shared_kv()
        if self.layer_n_ff and (len(self.layer_n_ff) != self.n_layer or min(self.layer_n_ff) < 0):
            raise ValueError(f"ModelConfig.layer_n_ff must give a width >= 0 for each of the {self.n_layer} layers, "
                             f"got {self.layer_n_ff!r}")

    def _check_full_geometry(self) -> None:
        for name in ("full_head_dim", "full_n_head_kv", "per_layer_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"ModelConfig.{name} must be an integer >= 0, got {value!r}")
        n_kv, head_dim = self.attention_geometry(ATTENTION)
        if head_dim % 2 or self.n_head % n_kv:
            raise ValueError(f"ModelConfig: full-attention layers' head_dim ({head_dim}) must be even and n_head "
                             f"({self.n_head}) a multiple of their KV heads ({n_kv})")

    def _check_shared_kv(self) -> None:
        """Each layer that reads another's K/V has an earlier layer of its kind to read from."""
        if not isinstance(self.n_kv_shared, int) or not 0 <= self.n_kv_shared < self.n_layer:
            raise ValueError(f"ModelConfig.n_kv_shared must be an integer in 0..n_layer-1 ({self.n_layer - 1}), "
                             f"got {self.n_kv_shared!r}")
        for layer in range(self.n_layer - self.n_kv_shared, self.n_layer):
            kind = self.layer_kinds[layer]
            if kind not in (ATTENTION, SLIDING) or self.kv_source(layer) == layer:
                raise ValueError(f"ModelConfig.n_kv_shared={self.n_kv_shared}: layer {layer} ({kind}) has no earlier "
                                 f"{kind} layer to share the K/V of")

    def _check_layer_kinds(self) -> None:
        if len(self.layer_kinds) != self.n_layer:
            raise ValueError(f"ModelConfig.layer_kinds has {len(self.layer_kinds)} entries for {self.n_layer} layers")
        unknown = sorted(set(self.layer_kinds) - set(LAYER_KINDS))
        if unknown:
            raise ValueError(f"ModelConfig.layer_kinds has unknown kinds {unknown} (known: {', '.join(LAYER_KINDS)})")
        if SLIDING in self.layer_kinds and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ValueError(f"ModelConfig.sliding_window must be a positive integer for {SLIDING} layers, "
                             f"got {self.sliding_window!r}")
        recurrent = sorted(set(self.layer_kinds) & set(RECURRENT_KINDS))
        if recurrent and (not isinstance(self.conv_kernel, int) or self.conv_kernel < 2):
            raise ValueError(f"ModelConfig.conv_kernel must be an integer >= 2 for {recurrent[0]} layers, "
                             f"got {self.conv_kernel!r}")
        if MAMBA in self.layer_kinds and self.ssm_inner != self.n_head * self.head_dim:
            raise ValueError(f"ModelConfig.ssm_inner ({self.ssm_inner}) must be n_head x head_dim "
                             f"({self.n_head} x {self.head_dim}) for {MAMBA} layers")
        if MAMBA in self.layer_kinds and (self.ssm_state < 1 or self.ssm_groups < 1 or self.n_head % self.ssm_groups):
            raise ValueError(f"ModelConfig.ssm_state ({self.ssm_state}) and ssm_groups ({self.ssm_groups}) must be "
                             f"positive, and n_head ({self.n_head}) a multiple of ssm_groups, for {MAMBA} layers")
        if GATED_DELTA in self.layer_kinds:
            self._check_gated_delta()
        if not (isinstance(self.rope_dims, int) and 0 <= self.rope_dims <= self.head_dim and self.rope_dims % 2 == 0):
            raise ValueError(f"ModelConfig.rope_dims must be an even integer in 0..head_dim ({self.head_dim}), "
                             f"got {self.rope_dims!r}")

    def _check_gated_delta(self) -> None:
        heads, groups = self.ssm_heads, self.ssm_groups
        if min(heads, groups, self.ssm_state, self.ssm_inner) < 1 or heads % groups or self.ssm_inner % heads:
            raise ValueError(f"ModelConfig.ssm_heads ({heads}), ssm_groups ({groups}), ssm_state ({self.ssm_state}) "
                             f"and ssm_inner ({self.ssm_inner}) must be positive, ssm_heads a multiple of ssm_groups "
                             f"and ssm_inner of ssm_heads, for {GATED_DELTA} layers")

    def _check_experts(self) -> None:
        if len(self.moe_layers) != self.n_layer:
            raise ValueError(f"ModelConfig.moe_layers has {len(self.moe_layers)} entries for {self.n_layer} layers")
        if not any(self.moe_layers):
            return
        if not 0 < self.n_expert_used <= self.n_expert:
            raise ValueError(f"ModelConfig.n_expert_used must be in 1..n_expert ({self.n_expert}), "
                             f"got {self.n_expert_used}")
        if self.n_ff_exp <= 0:
            raise ValueError(f"ModelConfig.n_ff_exp must be a positive integer for MoE layers, got {self.n_ff_exp}")
        # Qwen3.5-MoE's delta-rule layers have experts after their mixer, as its attention layers do
        recurrent = [kind for kind, moe in zip(self.layer_kinds, self.moe_layers) if moe and kind in (CONV, MAMBA)]
        if recurrent:
            raise ValueError(f"ModelConfig.moe_layers: experts on {recurrent[0]} layers are not supported")

    def attention_geometry(self, kind: str) -> tuple[int, int]:
        """(KV heads, head size) of an attention layer of this kind: full layers may have their own (Gemma 4)."""
        if kind == SLIDING or not self.full_head_dim:
            return self.n_head_kv, self.head_dim
        return self.full_n_head_kv or self.n_head_kv, self.full_head_dim

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V `layer` attends over: itself, or for one of the last n_kv_shared layers the last
        layer of its kind before them (transformers' rule for Gemma 4)."""
        return _kv_sources(self.layer_kinds, self.n_kv_shared)[layer]

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers whose K/V the memory holds: attention layers that read their own."""
        return _kv_layers(self.layer_kinds, self.n_kv_shared)

    def ff_width(self, layer: int) -> int:
        """The MLP width of a layer."""
        return self.layer_n_ff[layer] if self.layer_n_ff else self.n_ff

    @property
    def rotary_dims(self) -> int:
        """The dimensions of each head RoPE rotates, from the first."""
        return self.rope_dims or self.head_dim

    @property
    def n_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def family(self):
        """The architecture's description in the family registry (raises UnsupportedModelError if unknown)."""
        return family_named(self.architecture)

    @property
    def n_group(self) -> int:
        """Query heads that share one KV head (1 = MHA, n_head = MQA)."""
        return self.n_head // self.n_head_kv

    def describe(self) -> dict[str, object]:
        """The config for people: RoPE by what differs from the plain form, layer kinds as runs."""
        values = dict(self.__dict__)
        family = self.family
        parts = ("qkv_bias", "output_bias", "qk_norm", "attention_sinks", "attention_output_gate")
        values["architecture"] = " ".join([self.architecture, *(p for p in parts if getattr(family, p))])
        values["rope"] = _rope_text(self.rope)
        for name, default in _optional_parts().items():  # parts only some families have: shown when set
            if values[name] == default:
                del values[name]
        if self.rope_local is not None:
            values["rope_local"] = _rope_text(self.rope_local)
        values["layer_kinds"] = ", ".join(f"{len(list(run))} x {kind}" for kind, run in groupby(self.layer_kinds))
        if self.n_expert:
            values["moe_layers"] = ", ".join(f"{len(list(run))} x {'experts' if moe else 'MLP'}"
                                             for moe, run in groupby(self.moe_layers))
        return values


@cache
def _optional_parts() -> dict[str, object]:
    """The fields with a default (parts only some families have) and that default; layer_kinds is always shown."""
    return {f.name: f.default for f in fields(ModelConfig) if f.default is not MISSING and f.name != "layer_kinds"}


@cache
def _kv_sources(layer_kinds: tuple[str, ...], n_kv_shared: int) -> tuple[int, ...]:
    """ModelConfig.kv_source of every layer, found once per layer pattern (the decoder asks at every layer)."""
    first_shared = len(layer_kinds) - n_kv_shared
    last_of_kind = {kind: i for i, kind in enumerate(layer_kinds[:first_shared])}
    return tuple(layer if layer < first_shared else last_of_kind.get(kind, layer)
                 for layer, kind in enumerate(layer_kinds))


@cache
def _kv_layers(layer_kinds: tuple[str, ...], n_kv_shared: int) -> tuple[int, ...]:
    sources = _kv_sources(layer_kinds, n_kv_shared)
    return tuple(i for i, kind in enumerate(layer_kinds) if kind not in RECURRENT_KINDS and sources[i] == i)


def _rope_text(scaling: RopeScaling) -> str:
    """A RoPE by what differs from the plain form."""
    rope = {f.name: getattr(scaling, f.name) for f in fields(scaling)
            if f.name in ("theta", "kind") or getattr(scaling, f.name) != f.default}
    if scaling.freq_factors is not None:
        rope["freq_factors"] = f"{len(scaling.freq_factors)} from rope_freqs.weight"
    for name in ("short_factor", "long_factor"):
        if getattr(scaling, name):
            rope[name] = f"{len(getattr(scaling, name))} values"
    return " ".join(f"{name}={value}" for name, value in rope.items())
