"""CUDA graphs of decode steps: the launches of a whole forward pass recorded once per batch size and replayed, so a
step on a GPU costs the host a few copies instead of hundreds of kernel launches.

A graph replays fixed addresses, so a step's inputs go into buffers of its own first: the tokens, their RoPE rotations
(computed on the host from the positions, as the eager step does), and for each K/V store the cell each token writes
and the runs of cells each one reads (TokenCells: cells, offsets, lengths). Batches are padded up to a bucket (1, 2, 4,
8, then steps of 16); a padded lane reads and writes only its store's spare cell (KVStore.spare_cell), a row no
sequence holds, so the real cells are left exactly as they were. The attention splits every run a fixed number of
ways (TokenCells.fixed_splits), its launch planned without reading the lengths.

A step fits a graph when every token reads a run of its own (one decode token per sequence, or a few guessed tokens
per sequence being verified), all its outputs are wanted, its memory holds K/V rows only (recurrent states step
eagerly), and the model's layers launch the same kernels whatever the tokens (routed experts do not: they look at
the routing on the host). Anything else, and prompt chunks, runs eagerly. Without a GPU (TRITON_INTERPRET=1) the same
buffers and padded lanes run eagerly, which is how the tests hold a graph's step to the eager one.
"""
from __future__ import annotations

import logging

import torch

from kvlm.core.staging import staged
from kvlm.memory.view import KVView, LayerViews, TokenCells

log = logging.getLogger("kvlm")

MAX_RUN_CELLS = 1 << 22  # cells a step's runs may list in all, per store (32 MiB of int64); more runs eagerly
CELLS_PER_SPLIT = 256    # a split's share of a long run, as the eager attention plans it


def buckets(max_lanes: int) -> list[int]:
    """The batch sizes graphs are recorded for: 1, 2, 4, 8, then steps of 16, up to the first >= max_lanes."""
    sizes = []
    for size in (1, 2, 4, 8):
        sizes.append(size)
        if size >= max_lanes:
            return sizes
    return sizes + list(range(16, max_lanes + 16, 16))


def capturable(decoder) -> bool:
    """Whether the decoder's forward pass launches the same kernels whatever its tokens and positions: not with
    routed experts (the tokens each expert takes are read on the host) nor dynamic NTK (its frequencies follow the
    highest position)."""
    if any(getattr(layer, "moe", None) is not None or getattr(layer, "beside_mlp", None) is not None
           for layer in decoder.layers):
        return False
    return all(getattr(getattr(rope, "scaling", None), "kind", None) != "dynamic" for rope in decoder.layer_ropes)


class StoreLanes:
    """One K/V store's step inputs for a graph: the cell each lane writes and the runs of cells each lane reads."""

    def __init__(self, store, n_lanes: int, n_ctx: int) -> None:
        self.store = store
        spare = store.spare_cell
        self.capacity = min(n_lanes * store.n_cells, MAX_RUN_CELLS)
        self.rows = torch.full((n_lanes,), spare, dtype=torch.int64, device=store.device)
        self.offsets = torch.full((n_lanes,), self.capacity, dtype=torch.int64, device=store.device)
        self.lengths = torch.ones(n_lanes, dtype=torch.int64, device=store.device)
        # the runs, then the padded lanes' run: the spare cell alone
        self.cells = torch.full((self.capacity + 1,), spare, dtype=torch.int64, device=store.device)
        self.splits = min(16, max(1, -(-n_ctx // CELLS_PER_SPLIT)))

    def fits(self, view: KVView) -> bool:
        return view.per_token and view.token_cells.cells.numel() <= self.capacity

    def fill(self, view: KVView, n_lanes: int) -> None:
        """This step's rows and runs; lanes past its tokens padded onto the spare cell."""
        cells, n = view.token_cells, len(view.rows)
        self.rows[:n].copy_(view.rows, non_blocking=True)
        self.cells[: cells.cells.numel()].copy_(cells.cells, non_blocking=True)
        self.offsets[:n].copy_(cells.offsets, non_blocking=True)
        self.lengths[:n].copy_(cells.lengths, non_blocking=True)
        self.rows[n:n_lanes].fill_(self.store.spare_cell)
        self.offsets[n:n_lanes].fill_(self.capacity)
        self.lengths[n:n_lanes].fill_(1)

    def view(self, n_lanes: int) -> KVView:
        """The view a graph of `n_lanes` lanes is recorded with (and its replays read, through the buffers)."""
        splits = max(1, min(self.splits, 64 // n_lanes))  # a large batch fills the GPU without splitting
        cells = TokenCells(self.cells, self.offsets[:n_lanes], self.lengths[:n_lanes], fixed_splits=splits)
        return KVView(self.store, self.rows[:n_lanes], self.store.n_cells, [], device_cells=cells)


class DecodeGraphs:
    """The decode steps of one Context's memory, as CUDA graphs per bucket (`capture`), or run eagerly through the
    same buffers (without a GPU). `run` takes a micro-batch if it fits (see the module), else returns None."""

    def __init__(self, decoder, n_lanes: int, n_ctx: int, capture: bool) -> None:
        self.decoder, self.n_ctx, self.capture = decoder, n_ctx, capture
        self.buckets = buckets(n_lanes)
        self.n_lanes = self.buckets[-1]
        device = decoder.device
        self.tokens = torch.zeros(self.n_lanes, dtype=torch.int64, device=device)
        # A buffer per distinct RoPE, known by the first layer using it (a later Context fitting the decoder to its
        # length makes new RoPE objects, in the same places); a padded lane's rotation: none (cos 1, sin 0).
        firsts = {}
        for layer, rope in enumerate(decoder.layer_ropes):
            firsts.setdefault(id(rope), layer)
        self.rope_layers = list(firsts.values())
        self.rotations = [(torch.ones(self.n_lanes, *cos.shape[1:], device=device),
                           torch.zeros(self.n_lanes, *sin.shape[1:], device=device))
                          for cos, sin in self._tables(torch.zeros(1, dtype=torch.int64))]
        self.lanes: dict[int, StoreLanes] = {}  # by id of the store
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}  # bucket -> (graph or None, its logits buffer)
        self.views: dict[int, object] = {}  # bucket -> the memory view its graph reads
        self.pool = None
        self.failed = False  # a capture failed: every step runs eagerly from then on

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, view, output_rows: torch.Tensor) -> torch.Tensor | None:
        n = len(tokens)
        views = _kv_views(view)
        if self.failed or n > self.n_lanes or len(output_rows) != n or views is None:
            return None
        for kv in views:
            if kv.store.spare_cell is None:
                return None
            if id(kv.store) not in self.lanes:
                self.lanes[id(kv.store)] = StoreLanes(kv.store, self.n_lanes, self.n_ctx)
            if not self.lanes[id(kv.store)].fits(kv):
                return None
        bucket = next(size for size in self.buckets if size >= n)
        self._fill(tokens, positions, views, bucket)
        if bucket not in self.graphs:
            self.graphs[bucket] = self._record(bucket, view)
            if self.failed:
                return None
        graph, logits = self.graphs[bucket]
        if graph is None:
            logits.copy_(self._forward(bucket, view))
        else:
            graph.replay()
        return logits[:n]

    def _fill(self, tokens: torch.Tensor, positions: torch.Tensor, views: list[KVView], bucket: int) -> None:
        n = len(tokens)
        self.tokens[:n].copy_(tokens, non_blocking=True)
        self.tokens[n:bucket].zero_()
        for (cos, sin), (cos_buffer, sin_buffer) in zip(self._tables(positions), self.rotations):
            cos_buffer[:n].copy_(staged(cos, cos_buffer.device), non_blocking=True)
            sin_buffer[:n].copy_(staged(sin, sin_buffer.device), non_blocking=True)
        for kv in views:
            self.lanes[id(kv.store)].fill(kv, bucket)

    def _tables(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The rotations at `positions` (on the host), in the order of the buffers."""
        tables, ropes = self.decoder.rotations(positions), self.decoder.layer_ropes
        return [tables[id(ropes[layer])] for layer in self.rope_layers]

    def _forward(self, bucket: int, view) -> torch.Tensor:
        """The step of `bucket` lanes over the buffers: the views of the step's memory view swapped for theirs."""
        ropes = self.decoder.layer_ropes
        rotations = {id(ropes[layer]): (cos[:bucket], sin[:bucket])
                     for layer, (cos, sin) in zip(self.rope_layers, self.rotations)}
        with torch.inference_mode():
            return self.decoder.logits(self.tokens[:bucket], None, self._static_view(view, bucket), None, rotations)

    def _static_view(self, view, bucket: int):
        """`view`'s shape with each store's lanes in place of its views (made once per bucket, kept for the
        attention's launch plan)."""
        if bucket not in self.views:
            by_store = {key: lanes.view(bucket) for key, lanes in self.lanes.items()}
            if isinstance(view, KVView):
                self.views[bucket] = by_store[id(view.store)]
            else:
                self.views[bucket] = LayerViews([(by_store[id(kv.store)], local) for kv, local in view.by_layer])
        return self.views[bucket]

    def _record(self, bucket: int, view) -> tuple[object, torch.Tensor]:
        """The bucket's graph, recorded after a run on a side stream (which compiles the Triton kernels and sets up
        the plans outside the recording); None in place of the graph where none is recorded."""
        if not self.capture:
            return None, torch.empty(bucket, self.decoder.config.vocab_size, device=self.decoder.device)
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(bucket, view)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self._forward(bucket, view)
            return graph, logits
        except Exception as exc:  # noqa: BLE001 - a layer that cannot be recorded: the eager step still works
            log.warning("CUDA graphs are off: recording the decode step of %d lanes failed (%s: %s)", bucket,
                        type(exc).__name__, exc)
            self.failed = True
            return None, torch.empty(0)


def _kv_views(view) -> list[KVView] | None:
    """The distinct K/V views of a step's memory view; None where some layer reads a recurrent state."""
    if isinstance(view, KVView):
        return [view]
    if not isinstance(view, LayerViews) or not all(isinstance(kv, KVView) for kv, _ in view.by_layer):
        return None
    return list({id(kv): kv for kv, _ in view.by_layer}.values())
