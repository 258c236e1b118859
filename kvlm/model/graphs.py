"""The two compiled graphs: decode (one new token for each of B sequences) and prefill (one sequence's chunk).

Both trace the decoder's own layer code, but over `StepKV` instead of the cache: the graph gathers the
cached rows it reads and returns the step's K/V, which are written into the cache after it in one copy per
plane (writing into the cache inside a graph makes inductor copy the whole cache every step). So the graph
is a pure function of its inputs: tokens and positions [B, T], the rows each sequence reads [B, L] with an
additive mask [B, T, L], and the cache tensors. Shapes are static where a new one would cost a compile (B,
bucketed to a power of two; the cache's size) and dynamic where they change every step (L, and T for a
prompt chunk).

Compiling costs about a minute per decode bucket on two cores the first time (inductor keeps its results in
$KVLM_HOME/inductor, after which a start takes seconds), so graphs are opt-in (`load_model(compile=True)`,
`--compile`); batches of other shapes (several sequences' prompt chunks at once, shared cells, a q8_0 cache,
chunks of fewer than PREFILL_MIN_TOKENS tokens, models with sliding-window layers) take the eager path, which
computes the same function.
"""
from __future__ import annotations

import os

import torch

from kvlm.home import kvlm_home
from kvlm.memory.view import KVView
from kvlm.model.attention import TracedView, attention_dtype
from kvlm.model.ops import attention_with_own_rows

# Prompt chunks shorter than this run eagerly: the row-adaptive products change kernel at 4 rows, and a
# dynamic T must stay on one side of that to share one graph.
PREFILL_MIN_TOKENS = 8
# The tracer specialises a dynamic size of 0 or 1. Reading no cached rows (a prompt's first chunk) keeps its own
# graph, with nothing to pad; a single row gets a masked second one.
MIN_ROWS = 2
BUCKET_LIMIT = 64  # compiled graphs per step function (the tracer's default of 8 is too few for the buckets)


def check_compiler() -> None:
    """Inductor turns graphs into C++: without a compiler, say so before any model is loaded."""
    from torch._inductor import cpp_builder, exc

    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler as error:
        raise RuntimeError("compile=True needs a C++ compiler for torch.compile's inductor (g++ or clang++ on the "
                           "PATH, or named by $CXX); none was found. Install one or run without --compile") from error


class StepKV(TracedView):
    """What a graph's step reads instead of the cache, and what it hands back to be written after it."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor, old_mask: torch.Tensor,
                 positions: torch.Tensor) -> None:
        self.keys, self.values, self.index = keys, values, index
        # A new token sees the cached rows its view allows and the sequence's new tokens up to its position.
        causal = positions[:, None, :] <= positions[:, :, None]
        own = torch.zeros(causal.shape, dtype=old_mask.dtype).masked_fill(~causal, float("-inf"))
        self.mask = torch.cat((old_mask, own), dim=-1)
        self.new_k: list[torch.Tensor] = []
        self.new_v: list[torch.Tensor] = []

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               batch_invariant: bool = False, native=None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """As attention.attend_layer, traced in torch ops (`native` cannot be traced, so it is not used)."""
        self.new_k.append(k)
        self.new_v.append(v)
        batch, n_old = self.index.shape
        stored = self.keys.dtype
        dtype = attention_dtype(q.dtype, stored, batch_invariant)
        rows = (batch, n_old) + tuple(self.keys.shape[2:])
        old_k = self.keys[layer].index_select(0, self.index.flatten()).view(rows).to(dtype)
        old_v = self.values[layer].index_select(0, self.index.flatten()).view(rows).to(dtype)
        # The step's own K/V rounded as the cache will store them: the same values eager attention reads back.
        new = lambda t: t.to(stored).to(dtype).view(batch, -1, *t.shape[1:])  # noqa: E731
        queries = q.to(dtype).view(batch, -1, *q.shape[1:])
        out = attention_with_own_rows(queries, old_k, old_v, new(k), new(v), self.mask.to(dtype), sinks)
        return out.to(q.dtype)


class StepGraphs:
    """The compiled decode and prefill steps of one decoder; `run` takes a micro-batch if it fits one.

    Not for a batch-invariant decoder: compiled graphs group their sums as the shapes suit them."""

    def __init__(self, decoder, backend: str = "inductor") -> None:
        """`backend` is torch.compile's: "eager" traces the same graphs without compiling them (for tests)."""
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(kvlm_home() / "inductor"))
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, BUCKET_LIMIT)
        self.decoder = decoder
        # Two functions, so each keeps its own compiled graphs; the C++ wrapper calls the kernels without Python.
        options = {"cpp_wrapper": True} if backend == "inductor" else None
        self._decode = torch.compile(self._decode_step, fullgraph=True, backend=backend, options=options)
        self._prefill = torch.compile(self._prefill_step, fullgraph=True, backend=backend, options=options)

    def _step(self, tokens, positions, index, old_mask, keys, values, output_rows):
        kv = StepKV(keys, values, index, old_mask, positions)
        logits = self.decoder.logits(tokens.flatten(), positions.flatten(), kv, output_rows)
        return logits, torch.stack(kv.new_k), torch.stack(kv.new_v)

    def _decode_step(self, *inputs):
        return self._step(*inputs)

    def _prefill_step(self, *inputs):
        return self._step(*inputs)

    @torch.inference_mode()
    def run(self, tokens: torch.Tensor, positions: torch.Tensor, view: KVView,
            output_rows: torch.Tensor) -> torch.Tensor | None:
        """Logits of `output_rows` with the step's K/V written through `view`; None (nothing done) when the
        micro-batch is not one of the graphs' shapes."""
        if not isinstance(view, KVView) or not view.store.dense:  # a view per layer kind: sliding windows
            return None
        cache = (view.store.k.data, view.store.v.data)
        decode = decode_inputs(tokens, positions, view)
        if decode is not None:
            logits, k, v = self._decode(*decode, *cache, None)
            view.store.write_layers(view.rows, k[:, :len(tokens)], v[:, :len(tokens)])
            return logits[output_rows]
        prefill = prefill_inputs(tokens, positions, view)
        if prefill is None:
            return None
        if len(output_rows) > 1:
            torch._dynamo.mark_dynamic(output_rows, 0)
        logits, k, v = self._prefill(*prefill, *cache, output_rows)
        view.store.write_layers(view.rows, k, v)
        return logits


def decode_inputs(tokens: torch.Tensor, positions: torch.Tensor, view: KVView):
    """[B, 1] tokens of B sequences (B padded to a power of two), each reading its own rows; None otherwise."""
    rows = _single_group(view, len(tokens))
    if rows is None:
        return None
    index, mask = rows
    if index.dim() == 1:
        if len(tokens) != 1:
            return None
        index = index[None]
    if len(tokens) > 1 and bool(((mask == 0) & torch.isin(index, view.rows)).sum(dim=1).gt(1).any()):
        return None  # a run of one sequence's tokens (guesses being verified): each reads the others' new rows
    mask = mask.masked_fill(index == view.rows[:, None], float("-inf"))[:, None, :]
    index, mask = _at_least_rows(index, mask)
    pad = _bucket(len(tokens)) - len(tokens)
    tokens, positions = _padded(tokens, pad, 0), _padded(positions, pad, 0)
    index, mask = _padded(index, pad, 0), _padded(mask, pad, float("-inf"))  # padding rows see only themselves
    torch._dynamo.mark_static(tokens, 0)
    torch._dynamo.mark_dynamic(index, 1)
    torch._dynamo.mark_dynamic(mask, 2)
    return tokens[:, None], positions[:, None], index, mask


def prefill_inputs(tokens: torch.Tensor, positions: torch.Tensor, view: KVView):
    """One sequence's chunk of at least PREFILL_MIN_TOKENS tokens as [1, T]; None otherwise."""
    rows = _single_group(view, len(tokens)) if len(tokens) >= PREFILL_MIN_TOKENS else None
    if rows is not None and rows[0].dim() == 2:
        rows = _as_shared_rows(*rows)
    if rows is None:
        return None
    index, mask = rows
    cached = ~torch.isin(index, view.rows)  # the chunk's own cells come from the graph's inputs
    index, mask = _at_least_rows(index[cached][None], mask[:, cached][None])
    tokens, positions = tokens[None], positions[None]
    dynamic = [(tokens, 1), (positions, 1), (mask, 1)]
    if index.shape[1]:
        dynamic += [(index, 1), (mask, 2)]
    for tensor, dim in dynamic:
        torch._dynamo.mark_dynamic(tensor, dim)
    return tokens, positions, index, mask


def _single_group(view: KVView, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The cells [L] (shared) or [n, L] (per token) the step reads and its mask [n, L], if one group reads all."""
    if view.groups is None:
        index, mask = torch.arange(view.n_visible), view.mask
    elif len(view.groups) == 1:
        index, mask = view.groups[0].index, view.groups[0].mask
    else:
        return None
    if mask is None:
        mask = torch.zeros(n_tokens, index.shape[-1])
    return index, mask


def _as_shared_rows(index: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A short run of one sequence laid out per token (each token's cells a prefix of the last one's, as
    memory.attention_groups lays out runs it reads as decode tokens) as the last token's cells and a mask; None
    when the tokens read other rows (several sequences)."""
    real = mask == 0
    lengths = real.sum(dim=1)
    columns = torch.arange(index.shape[1])
    prefix = columns[None, :] < lengths[:, None]
    last = index[-1]
    if not torch.equal(real, prefix) or not bool(((index == last[None, :]) | ~prefix).all()):
        return None
    shared = last[: int(lengths[-1])]
    return shared, torch.zeros(prefix[:, : len(shared)].shape).masked_fill_(~prefix[:, : len(shared)], float("-inf"))


def _at_least_rows(index: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    short = MIN_ROWS - index.shape[1]
    if short <= 0 or index.shape[1] == 0:
        return index, mask
    index = torch.cat((index, index.new_zeros(index.shape[0], short)), dim=1)
    hidden = mask.new_full(mask.shape[:-1] + (short,), float("-inf"))
    return index, torch.cat((mask, hidden), dim=-1)


def _bucket(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _padded(t: torch.Tensor, pad: int, value: float) -> torch.Tensor:
    if pad == 0:
        return t
    return torch.cat((t, t.new_full((pad,) + tuple(t.shape[1:]), value)))
