"""llama.cpp's decode loop: a batch in, logits out, the KV memory either advanced or exactly as before."""
from __future__ import annotations

import logging
from collections.abc import Callable
from enum import IntEnum

import numpy as np
import torch

from kvlm.core.batch import Batch, InvalidBatch, sanitize
from kvlm.core.staging import staged_together
from kvlm.loader.load import Model
from kvlm.memory.kv_store import KV_DTYPES
from kvlm.memory.layout import memory_for
from kvlm.model.cuda_graphs import DecodeGraphs, capturable

log = logging.getLogger("kvlm")


class DecodeStatus(IntEnum):
    OK = 0
    NO_SLOT = 1          # not enough free cells for the batch; nothing changed
    ABORTED = 2          # abort_callback returned True; the batch was rolled back
    INVALID_BATCH = -1   # the batch failed validation; see Context.last_error
    ALLOC_FAILED = -2    # memory for the computation could not be allocated; rolled back
    COMPUTE_FAILED = -3  # the forward pass raised; rolled back


class Context:
    def __init__(
        self, model: Model, n_ctx: int = 4096, n_batch: int = 2048, n_ubatch: int = 512, n_seq_max: int = 16,
        kv_dtype: str = "f32", abort_callback: Callable[[], bool] | None = None, swa_full: bool = False,
        swa_keep_extra: int = 0, cuda_graphs: bool | None = None,
    ) -> None:
        """`swa_full` keeps every cell of sliding-window layers (one pool, as llama.cpp's --swa-full) instead of
        a second, window-sized pool; `swa_keep_extra`: positions a sequence keeps beyond its window there.
        `cuda_graphs`: decode steps replay CUDA graphs (kvlm.model.cuda_graphs); None: where the model runs on a
        GPU through the Triton backend (True elsewhere runs the graphs' step eagerly, as the tests do)."""
        _check_sizes(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_seq_max)
        if n_ubatch > n_batch:
            raise ValueError(f"n_ubatch ({n_ubatch}) must not exceed n_batch ({n_batch})")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {kv_dtype!r} is not supported (supported: {', '.join(KV_DTYPES)})")
        self.model = model
        self.n_ctx, self.n_batch, self.n_ubatch, self.n_seq_max = n_ctx, n_batch, n_ubatch, n_seq_max
        self.kv_dtype = kv_dtype
        self.abort_callback = abort_callback
        sizes = dict(n_ctx=n_ctx, n_seq_max=n_seq_max, n_ubatch=n_ubatch, kv_dtype=kv_dtype, swa_full=swa_full,
                     swa_keep_extra=swa_keep_extra)
        decoder = model.decoder
        if cuda_graphs is None:
            cuda_graphs = decoder.device == "cuda" and decoder.ops.name == "triton" and model.tensor_parallel is None
        cuda_graphs = cuda_graphs and capturable(decoder)
        memory = memory_for(decoder, **sizes, spare_cell=cuda_graphs)
        # Tensor parallelism: the other ranks hold memories of their own and repeat what changes this one.
        self.memory = memory if model.tensor_parallel is None else model.tensor_parallel.mirrored(memory, sizes)
        self.last_error = ""
        self._logits: torch.Tensor | None = None  # where the model computes them
        self._hidden: torch.Tensor | None = None  # the final norm's output at the output rows, when asked for
        self._host_logits: torch.Tensor | None = None  # copied to the host when a row is asked for there
        self.decode_graphs = (DecodeGraphs(decoder, min(n_seq_max, n_ubatch), n_ctx, decoder.device == "cuda")
                              if cuda_graphs else None)
        for pool in self.memory.pools:
            half = pool.kv_bytes / 2 / 2**20
            which = f" ({pool.name} layers)" if len(self.memory.pools) > 1 else ""
            log.info("KV cache%s: %d cells, %d layers, K (%s): %.2f MiB, V (%s): %.2f MiB",
                     which, pool.n_cells, pool.store.n_layer, kv_dtype, half, kv_dtype, half)

    def decode(self, batch: Batch, embeddings: bool = False) -> DecodeStatus:
        """`embeddings`: also keep the final norm's output at the output rows (`embeddings()`), as llama.cpp's
        llama_set_embeddings; such a batch runs eagerly (the graphs give logits only)."""
        self._logits = self._host_logits = self._hidden = None
        try:
            sanitized = sanitize(batch, vocab_size=self.model.config.vocab_size, n_seq_max=self.n_seq_max,
                                 n_batch=self.n_batch, seq_pos_max=self.memory.seq_pos_max)
        except InvalidBatch as exc:
            return self._fail(DecodeStatus.INVALID_BATCH, str(exc))
        self.memory.apply_shifts()
        ubatches = self.memory.split(sanitized, self.n_ubatch)
        try:
            slots = self.memory.plan(ubatches)
        except InvalidBatch as exc:  # a batch this memory kind cannot take
            return self._fail(DecodeStatus.INVALID_BATCH, str(exc))
        if slots is None:
            free = ", ".join(f"{pool.name} pool {pool.n_free} of {pool.n_cells}" for pool in self.memory.pools)
            return self._fail(DecodeStatus.NO_SLOT,
                              f"no room: the batch needs {len(sanitized.tokens)} cells; free: {free}")
        self.memory.begin()
        outputs, hidden = [], []
        for index, (ubatch, slot) in enumerate(zip(ubatches, slots)):
            where = f"micro-batch {index + 1} of {len(ubatches)}"
            if self.abort_callback is not None and self.abort_callback():
                return self._roll_back(DecodeStatus.ABORTED, f"aborted by abort_callback before {where}")
            try:
                logits = self._compute(ubatch, slot, embeddings)
            except (MemoryError, torch.OutOfMemoryError) as exc:  # (a GPU's is torch's)
                return self._roll_back(DecodeStatus.ALLOC_FAILED, f"out of memory in {where}: {exc}")
            except Exception as exc:  # noqa: BLE001 - any failure of the forward pass is reported, not raised
                return self._roll_back(DecodeStatus.COMPUTE_FAILED,
                                       f"compute failed in {where}: {type(exc).__name__}: {exc}")
            if embeddings:
                logits, states = logits
                hidden.append(states)
            outputs.append(logits)
        self.memory.commit()
        self._logits = _in_batch_order(_joined(outputs), ubatches)
        if embeddings:
            self._hidden = _in_batch_order(_joined(hidden), ubatches).cpu()
        self.last_error = ""
        return DecodeStatus.OK

    def _compute(self, ubatch, slot, with_hidden: bool):
        view = self.memory.place(ubatch, slot)
        device = self.model.decoder.device  # the tokens to where the model computes; positions stay (RoPE's tables
        # are made from them on the host), and so do the logits (Context.logits)
        tokens, output_rows = staged_together(device, torch.from_numpy(ubatch.tokens),
                                              torch.from_numpy(ubatch.output.nonzero()[0]))
        positions = torch.tensor(ubatch.pos)
        for graphs in (self.decode_graphs, self.model.graphs) if not with_hidden else ():
            logits = graphs.run(tokens, positions, view, output_rows) if graphs is not None else None
            if logits is not None:
                return logits
        return self.model.decoder.forward(tokens, positions, view, output_rows, with_hidden)

    def _roll_back(self, status: DecodeStatus, message: str) -> DecodeStatus:
        self.memory.roll_back()
        return self._fail(status, message)

    def _fail(self, status: DecodeStatus, message: str) -> DecodeStatus:
        self.last_error = message
        return status

    @property
    def logits_device(self) -> torch.device:
        """Where the last batch's logits are: the model's device."""
        return torch.device(self.model.decoder.device)

    def get_logits_ith(self, i: int) -> torch.Tensor:
        """Logits of the i-th output token of the last batch (negative counts from the end), on the host (all of
        them copied there at the first call, from a GPU)."""
        logits = self.logits()
        n = logits.shape[0]
        if not -n <= i < n:
            raise IndexError(f"output index {i} is out of range: the last batch had {n} outputs")
        if self._host_logits is None:
            self._host_logits = logits.cpu()
        return self._host_logits[i]

    def argmax_ids(self) -> list[int]:
        """The most likely token of each output row of the last batch (the first, on ties): on a GPU one argmax
        over every row there, only the ids coming back."""
        logits = self.logits()
        if logits.device.type == "cpu":  # numpy's argmax of a row is several times faster than torch's
            return [int(np.argmax(row)) for row in logits.numpy()]
        return logits.argmax(dim=1).tolist()

    def logits(self) -> torch.Tensor:
        """The last batch's logits [n_outputs, vocab] where the model computed them (a GPU's memory), float32."""
        if self._logits is None:
            raise IndexError("no logits: the last decode did not succeed or has not run")
        return self._logits

    def embeddings(self) -> torch.Tensor:
        """The final norm's float32 output [n_outputs, n_embd] at the last batch's output rows, on the host; for a
        batch decoded with `embeddings=True`."""
        if self._hidden is None:
            raise IndexError("no embeddings: the last decode did not succeed or was not asked for them")
        return self._hidden

    # --- sequence state ---
    def state_seq_save(self, seq_id: int) -> bytes:
        return self.memory.state_seq_save(seq_id)

    def state_seq_load(self, data: bytes, dest_seq_id: int) -> None:
        """Restore a saved sequence into `dest_seq_id`, which must be empty; on any error nothing changes."""
        self.memory.state_seq_load(data, dest_seq_id)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The micro-batches' rows as one tensor; a lone micro-batch's as they are (a batch's logits can be tens of MB)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _in_batch_order(logits: torch.Tensor, ubatches) -> torch.Tensor:
    """Outputs of micro-batches that took the batch's tokens out of order (split_equal), put back in order."""
    if ubatches[0].rows is None:
        return logits
    outputs = np.concatenate([ubatch.rows[ubatch.output] for ubatch in ubatches])
    if np.all(outputs[1:] > outputs[:-1]):  # already in order (one sequence's tokens, a lone decode token): no copy
        return logits
    return logits[torch.from_numpy(np.argsort(outputs, kind="stable")).to(logits.device)]


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
