"""A mixture-of-experts block in place of a layer's MLP: a router picks each token's top-k experts, the token goes
through each (a gated MLP of its own) and their outputs are summed with the router's weights; a shared expert, where
the family has one, adds its output for every token.

Routing is computed in float32 whatever the activations (as transformers and llama.cpp do): softmax over all
experts, the k most probable kept in descending order, their probabilities renormalised to sum to 1 where the model
says so (a softmax over the k chosen logits is the same thing). Routers and experts may add biases to their
products, and experts may meet gate and up in a clamped SwiGLU. The experts themselves run as one native call over the blocks their file stores them in
(kvlm.kernels.experts), or, with dense weights (the reference mode, or no native kernels), as a loop over the experts
that have tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlm.kernels.experts import ExpertBiases, NativeExperts
from kvlm.model.linear import Linear


def route(logits: torch.Tensor, n_used: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, k], weights [T, k] float32) from router logits [T, n_expert]."""
    probabilities = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probabilities, n_used, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """The clamped SwiGLU: the gate clamped above at `limit`, up to [-limit, limit], (up + 1) gate sigmoid(alpha gate)."""
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@dataclass
class DenseExperts:
    """Each expert's gate and up (stacked) and down projection as dense products (kvlm.model.linear); the
    biases and activation parameters where it has them."""

    gate_up: list[Linear]
    down: list[Linear]
    biases: ExpertBiases | None = None  # in the activation dtype
    swiglu: tuple[float, float] = (1.702, 7.0)  # swiglu_oai's alpha and limit

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ops, activation: str) -> torch.Tensor:
        """Each expert once over the tokens routed to it; a token's outputs added in the order of expert ids."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert in torch.unique(ids).tolist():
            tokens, slots = torch.nonzero(ids == expert, as_tuple=True)
            y = self._expert(expert, x[tokens], ops, activation)
            out.index_add_(0, tokens, y.float() * weights[tokens, slots, None])
        return out.to(x.dtype)

    def _expert(self, e: int, x: torch.Tensor, ops, activation: str) -> torch.Tensor:
        if self.biases is None and activation != "swiglu_oai":
            return ops.gated_mlp(x, self.gate_up[e], self.down[e], activation)
        both = self.gate_up[e](x)
        if self.biases is not None:
            both = both + self.biases.gate_up[e]
        gate, up = both.chunk(2, dim=-1)
        if activation == "swiglu_oai":
            hidden = swiglu_oai(gate, up, *self.swiglu)
        else:
            hidden = (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up
        y = self.down[e](hidden)
        return y if self.biases is None else y + self.biases.down[e]


@dataclass
class BlockExperts:
    """All experts' matrices in their file's blocks, multiplied by one native call (`native`)."""

    native: NativeExperts
    blocks: tuple  # the BlockMatrix objects the native call reads (held here for the memory count)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ops, activation: str) -> torch.Tensor:
        return self.native(x, ids, weights)


@dataclass
class MoEWeights:
    router: Linear  # [n_expert, n_embd], float32
    experts: DenseExperts | BlockExperts
    n_used: int
    normalize: bool  # the chosen weights renormalised to sum to 1
    shared_gate_up: Linear | None = None  # the shared expert, every token through it
    shared_down: Linear | None = None
    shared_gate: Linear | None = None  # [1, n_embd]: the shared expert's output times sigmoid of it
    router_bias: torch.Tensor | None = None  # [n_expert] float32
    # Experts beside an MLP: the router reads RMSNorm(x) (no weight) times this [n_embd] vector and 1/sqrt(n_embd); the chosen
    # experts' weights are multiplied by their entry of expert_scale [n_expert]
    router_input_scale: torch.Tensor | None = None
    expert_scale: torch.Tensor | None = None
    router_norm_eps: float = 1e-6

    def __call__(self, x: torch.Tensor, ops, activation: str, router_input: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' output for x [T, n_embd]; routed from `router_input` where it is not x (experts beside an MLP)."""
        routed = (x if router_input is None else router_input).float()
        if self.router_input_scale is not None:
            routed = F.rms_norm(routed, (routed.shape[-1],), eps=self.router_norm_eps) * self.router_input_scale * routed.shape[-1] ** -0.5
        ids, weights = ops.route(self.router(routed), self.n_used, self.normalize, self.router_bias)
        if self.expert_scale is not None:
            weights = weights * self.expert_scale[ids]
        out = self.experts(x, ids, weights, ops, activation)
        if self.shared_gate_up is not None:
            shared = ops.gated_mlp(x, self.shared_gate_up, self.shared_down, activation)
            if self.shared_gate is not None:
                shared = ops.sigmoid_gate(shared, self.shared_gate(x.float()))
            out = out + shared
        return out
