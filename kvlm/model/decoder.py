"""One decoder for every family: embeddings, its layers' blocks in turn, the final norm, the LM head.

What its layers hold is read by kvlm.model.build (from the tensors each family declares), what they compute is
kvlm.model.blocks, over the hot ops of kvlm.model.backend.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvlm.core.config import ModelConfig
from kvlm.core.family import ATTENTION, SLIDING
from kvlm.core.rope import NoRope, Rope
from kvlm.core.staging import staged
from kvlm.kernels import BlockMatrix
from kvlm.memory.view import MemoryView
from kvlm.model.backends import backend_for
from kvlm.model.blocks import Blocks
from kvlm.model.build import LayerBuilder
from kvlm.model.embedding import Embedding
from kvlm.model.linear import DenseLinear, Linear, NativeDenseLinear, PackedLinear, QuantizedLinear, float32_product, linear_kind
from kvlm.model.settings import ComputeSettings

if TYPE_CHECKING:  # the loader's records of the weights the decoder is built from (the loader imports the model)
    from kvlm.loader.weights import ModelWeights


class Decoder(Blocks):
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
        self.stored_as = sorted({weights.file_type(name) for name in weights.names()})  # the file's tensor types
        self.dtype = self.settings.torch_dtype
        self.batch_invariant = self.settings.batch_invariant
        # The hot ops' table (kvlm.model.backend): the native CPU kernels, or torch's in the reference mode and where
        # no compiler builds them. Recurrent layers step every token (a prompt as a run of decode steps) where the
        # backend offers it; otherwise prompts take torch's chunked scans.
        self.ops = backend_for(settings)
        self._recurrent = self.ops.recurrent
        build = LayerBuilder(config, settings, self.ops)
        self.activation = build.activation
        self.layers = [build.layer(weights, i) for i in range(config.n_layer)]
        # Decode steps run each attention layer as one native call where its matrices are quantized.
        self.decode_layers = self.ops.decode_layers(config, self.layers, self.dtype, self.activation)
        self.output_norm = build.vector(weights.read("output_norm.weight"))
        tied = weights.output_name == "token_embd.weight" and weights.shard is None
        # A tied table is read in the LM head's layout, which the embedding then reads too.
        storage = self.settings.matrix_storage([weights.file_type("token_embd.weight")])
        table = weights.read("token_embd.weight", build.layout(storage) if tied else None)
        self.token_embd = Embedding(table if build.keeps_blocks(table) else build.dense(table), self.dtype)
        self.output = build.head(weights, table if tied else None)
        self.layer_ropes = self._layer_ropes(None)
        self.blocks = self.blocks_by_kind()
        self.per_layer_inputs = build.per_layer_inputs(weights) if config.per_layer_embd else None
        self.embedding_scale = build.embedding_scale()
        # Tensor parallelism: this rank holds a share of each layer's heads and MLP width; the attention output
        # and the MLP output are partial sums, added up over the ranks (torch.distributed.all_reduce).
        self.all_reduce: Callable[[torch.Tensor], object] | None = None
        # ... and a share of the vocabulary: its logits go to rank 0 (which gets them all) through gather_logits.
        self.gather_logits: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def device(self) -> str:
        """Where its weights are and it computes ("cpu" or "cuda"); its memory is made there too."""
        return self.settings.device

    @property
    def quantized(self) -> bool:
        """Whether its matrices may be kept quantized (the fast mode), not all dense (the reference mode)."""
        return self.settings.quant is not None

    def describe(self) -> str:
        """The chosen settings and how many matrices each kernel got, for logs and `kvlm inspect`."""
        counts = Counter(linear_kind(m) for m in self.matrices())
        kinds = ", ".join(f"{n} {kind}" for kind, n in counts.most_common())
        return f"{self.settings.describe(self.stored_as)}; matrices: {kinds}"

    def matrices(self) -> list[Linear]:
        return [self.output] + [m for layer in self.layers for m in vars(layer).values() if isinstance(m, Linear)]

    @property
    def nbytes(self) -> int:
        """The memory its weights take: blocks, dense copies, tables and vectors (shared storage counted once)."""
        seen: set[int] = set()
        return sum(_held(part, seen) for part in (self.token_embd, self.output, self.output_norm, *self.layers))

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, kv: MemoryView, output_rows: torch.Tensor | None = None,
        with_hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """float32 logits [n_out, vocab] for the tokens at `output_rows` (all tokens when None); `with_hidden`:
        (logits, hidden), hidden the final norm's float32 output [n_out, n_embd] at those rows (what embeddings
        are pooled from).

        Each layer writes the K/V of `tokens` through `kv` before attending over the visible rows;
        nothing here makes those rows visible to later calls: the cache's commit does that.
        """
        hidden = self.hidden(tokens, positions, kv, output_rows)
        logits = self.head(hidden)
        return (logits, hidden.float()) if with_hidden else logits

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor | None, kv, output_rows: torch.Tensor | None,
               rotations: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
        """`forward` without its inference mode, for graphs to trace; `kv`: the memory's view, or a graph's
        TracedView. `rotations`: `self.rotations(positions)` where the caller has them (a CUDA graph's step keeps
        them in buffers of its own), positions then unused."""
        return self.head(self.hidden(tokens, positions, kv, output_rows, rotations))

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor | None, kv, output_rows: torch.Tensor | None,
               rotations: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
        """The final norm's output at `output_rows`: what the output head reads."""
        x = self.token_embd(tokens)
        if self.embedding_scale is not None:
            x = x * self.embedding_scale
        per_layer = self.per_layer_inputs(tokens, x) if self.per_layer_inputs is not None else None
        if rotations is None:
            rotations = {key: _on(table, x.device) for key, table in self.rotations(positions).items()}
        blocks = self.blocks
        for index, (kind, layer) in enumerate(zip(self.config.layer_kinds, self.layers)):
            rotation = rotations[id(self.layer_ropes[index])]
            if per_layer is None:
                x = blocks[kind](index, layer, x, *rotation, kv)
            else:  # only attention layers have per-layer inputs (Gemma 4's)
                x = blocks[kind](index, layer, x, *rotation, kv, per_layer[:, index])
        if output_rows is not None:
            x = x[output_rows]
        return self.ops.norm(x, self.output_norm, self.config.rms_norm_eps)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of the final norm's output (rank 0's all of them, under tensor parallelism)."""
        logits = float32_product(self.output, hidden)
        if self.config.logit_scale != 1.0:
            logits = logits / self.config.logit_scale
        cap = self.config.final_logit_softcap
        logits = self.ops.softcap(logits.contiguous(), cap) if cap else logits
        return logits if self.gather_logits is None else self.gather_logits(logits)

    def rotations(self, positions: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """RoPE's float32 cos and sin [n_tokens, 1, head_dim] at `positions`, computed on the host, for each distinct
        RoPE of the layers (by id: a few, each computed once)."""
        ropes = {id(rope): rope for rope in self.layer_ropes}
        return {key: rope.cos_sin(positions.cpu(), torch.float32) for key, rope in ropes.items()}

    def fit_context(self, n_ctx: int) -> list[Rope | NoRope]:
        """Rotate as a context of n_ctx positions needs (LongRoPE's factors depend on it, see
        RopeScaling.for_context): the memory made for that context re-rotates its keys with the same RoPEs, which
        this returns, one per layer. A decoder serves one context length at a time."""
        self.layer_ropes = self._layer_ropes(n_ctx)
        return self.layer_ropes

    def _layer_ropes(self, n_ctx: int | None) -> list[Rope | NoRope]:
        """Each layer's RoPE: sliding layers may have their own base (local layers), some layers none."""
        c = self.config
        full = Rope(c.rope.for_context(n_ctx), c.rope_dims or c.attention_geometry(ATTENTION)[1])
        local = Rope(c.rope_local.for_context(n_ctx), c.rope_dims or c.attention_geometry(SLIDING)[1]) \
            if c.rope_local else full
        none = NoRope(full.head_dim) if c.unrotated_layers else None
        return [none if i in c.unrotated_layers else local if kind == SLIDING else full
                for i, kind in enumerate(c.layer_kinds)]


def _on(tensors: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """RoPE's tables (computed from the positions on the host) where the step runs."""
    return tensors if device.type == "cpu" else tuple(staged(t, device) for t in tensors)


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
