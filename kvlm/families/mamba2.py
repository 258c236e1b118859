"""Mamba2: every layer a norm and a Mamba2 mixer (selective state space with a short convolution), no attention
and no MLP. Its config's heads are the SSM's (n_head = n_head_kv = heads, head_dim = their width)."""
import torch

from kvlm.core.errors import UnsupportedModelError
from kvlm.core.family import MAMBA, Family

def hf_config(raw: dict) -> dict:
    """transformers' Mamba2Config as ModelConfig fields: the mixer's heads stand in for attention heads."""
    heads, head_dim = raw["num_heads"], raw["head_dim"]
    inner = raw.get("expand", 2) * raw["hidden_size"]
    if inner != heads * head_dim:
        raise ValueError(f"expand x hidden_size ({inner}) must equal num_heads x head_dim ({heads} x {head_dim})")
    for option, supported in (("use_bias", False), ("use_conv_bias", True), ("rms_norm", True)):
        if raw.get(option, supported) != supported:
            raise UnsupportedModelError(f"{option}={raw[option]!r} is not supported for mamba2 models")
    return {"n_ff": 0, "n_head": heads, "n_head_kv": heads, "head_dim": head_dim,
            "rms_norm_eps": float(raw.get("layer_norm_epsilon", 1e-5)), "conv_kernel": raw.get("conv_kernel", 4),
            "ssm_inner": inner, "ssm_state": raw["state_size"], "ssm_groups": raw.get("n_groups", 1),
            "ssm_dt_limit": tuple(_float(t) for t in raw.get("time_step_limit", (0.0, float("inf"))))}


def gguf_config(key, tensor_names: frozenset[str]) -> dict:
    """llama.cpp's mamba2 keys: ssm.time_step_rank is the number of heads (its files have no time-step limit; the
    tensors' names say nothing more)."""
    heads, inner = int(key("ssm.time_step_rank")), int(key("ssm.inner_size"))
    return {"n_ff": 0, "n_head": heads, "n_head_kv": heads, "head_dim": inner // heads,
            "conv_kernel": int(key("ssm.conv_kernel")), "ssm_inner": inner, "ssm_state": int(key("ssm.state_size")),
            "ssm_groups": int(key("ssm.group_count"))}


def layer_shapes(c) -> dict[str, tuple]:
    """A Mamba2 mixer's tensors in GGUF naming; A (= -exp(A_log)) and D as vectors, the norm over d_inner."""
    heads, inner, groups, state = c.n_head, c.ssm_inner, c.ssm_groups, c.ssm_state
    conv_dim = inner + 2 * groups * state
    return {"ssm_in.weight": (inner + conv_dim + heads, c.n_embd), "ssm_conv1d.weight": (conv_dim, c.conv_kernel),
            "ssm_conv1d.bias": (conv_dim,), "ssm_dt.bias": (heads,), "ssm_a": (heads,), "ssm_d": (heads,),
            "ssm_norm.weight": (inner,), "ssm_out.weight": (c.n_embd, inner)}


def _float(value) -> float:
    """A number of config.json; transformers writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"]) if isinstance(value, dict) and "__float__" in value else float(value)


FAMILY = Family(
    name="mamba2", hf_architectures=("Mamba2ForCausalLM",), hf_model_type="mamba2", hf_prefix="backbone",
    hf_layer_names=(("norm", "attn_norm"), ("mixer.in_proj", "ssm_in"), ("mixer.conv1d", "ssm_conv1d"),
                    ("mixer.out_proj", "ssm_out"), ("mixer.norm", "ssm_norm"), ("mixer.A_log", "ssm_a"),
                    ("mixer.D", "ssm_d"), ("mixer.dt_bias", "ssm_dt.bias")),
    hf_global_names=(("backbone.embeddings", "token_embd"), ("backbone.norm_f", "output_norm")),
    hf_values=(("ssm_a", lambda a_log: -torch.exp(a_log)),),  # GGUF stores A itself, as llama.cpp's converter
    fixed_layer_kind=MAMBA, recurrent_shapes=layer_shapes, hf_config=hf_config, gguf_config=gguf_config,
    gguf_reshaped=("ssm_a", "ssm_d", "ssm_norm.weight"),  # llama.cpp: A, D as [H, 1], the norm as [G, d_inner / G]
)

FAMILIES = (FAMILY,)
