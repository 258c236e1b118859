"""What sets one decoder architecture apart from another: data, not a fork of the decoder."""
from __future__ import annotations

from dataclasses import dataclass

ATTENTION = "attention"  # the layer kinds the decoder knows; sliding-window and recurrent kinds plug in here
LAYER_KINDS = (ATTENTION,)


@dataclass(frozen=True)
class Family:
    """One architecture: how its files name it, and which optional parts its layers have.

    `name` is the GGUF `general.architecture`; `hf_architectures` the `architectures[0]` values of
    config.json (its `model_type` is accepted too). Tensor names follow GGUF's; Hugging Face names are
    mapped onto them by the loader.
    """

    name: str
    hf_architectures: tuple[str, ...]
    hf_model_type: str
    qkv_bias: bool = False      # biases on the Q, K and V projections (not on the output)
    qk_norm: bool = False       # RMSNorm over head_dim on each Q and K head, before RoPE
    permuted_qk: bool = False   # llama.cpp stores Q/K rows of this architecture permuted for its RoPE
    default_head_dim: int | None = None  # config.json's head_dim when absent (transformers' default), else d / heads

    def layer_kinds(self, n_layer: int) -> tuple[str, ...]:
        return (ATTENTION,) * n_layer

    def layer_shapes(self, n_embd: int, n_ff: int, n_head: int, n_head_kv: int, head_dim: int) -> dict[str, tuple]:
        """Shape of every tensor of one layer by GGUF suffix, [out, in] for matrices as torch's linear expects."""
        q_rows, kv_rows = n_head * head_dim, n_head_kv * head_dim
        shapes = {
            "attn_norm.weight": (n_embd,), "attn_q.weight": (q_rows, n_embd), "attn_k.weight": (kv_rows, n_embd),
            "attn_v.weight": (kv_rows, n_embd), "attn_output.weight": (n_embd, q_rows), "ffn_norm.weight": (n_embd,),
            "ffn_gate.weight": (n_ff, n_embd), "ffn_up.weight": (n_ff, n_embd), "ffn_down.weight": (n_embd, n_ff),
        }
        if self.qkv_bias:
            shapes.update({"attn_q.bias": (q_rows,), "attn_k.bias": (kv_rows,), "attn_v.bias": (kv_rows,)})
        if self.qk_norm:
            shapes.update({"attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)})
        return shapes
