"""What `GET /kv` shows: every used cell with its position and sequence set, each sequence's cells, and
how fragmented the pool is. Built on the engine thread, so it is a consistent snapshot between steps."""
from __future__ import annotations

import numpy as np

from kvlm.engine.engine import PREFIX_CACHE_SEQ, Engine


def _runs(cells: np.ndarray) -> list[list[int]]:
    """Sorted cell indices as [first, last] runs of consecutive cells."""
    if cells.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(cells) != 1)
    starts = np.concatenate(([cells[0]], cells[breaks + 1]))
    ends = np.concatenate((cells[breaks], [cells[-1]]))
    return [[int(s), int(e)] for s, e in zip(starts, ends)]


def _sequence(seq_id: int, seqs: np.ndarray, pos: np.ndarray, request_id: str | None) -> dict:
    cells = np.flatnonzero(seqs[:, seq_id])
    return {
        "seq_id": seq_id,
        "request_id": request_id,
        "role": "prefix_cache" if seq_id == PREFIX_CACHE_SEQ else "request",
        "n_cells": int(cells.size),
        "pos_min": int(pos[cells].min()) if cells.size else -1,
        "pos_max": int(pos[cells].max()) if cells.size else -1,
        "cell_runs": _runs(cells),
    }


def _fragmentation(pos: np.ndarray) -> dict:
    used = pos >= 0
    used_max = int(np.flatnonzero(used)[-1]) + 1 if used.any() else 0
    holes = np.flatnonzero(~used[:used_max])
    free = np.flatnonzero(~used)
    return {
        "used_max": used_max,
        "holes": int(holes.size),            # free cells below used_max: attention still spans them
        "hole_runs": len(_runs(holes)),
        "largest_free_run": max((e - s + 1 for s, e in _runs(free)), default=0),
        # llama.cpp's measure (its defrag threshold): the share of the attended span that is empty.
        "fragmentation": round(holes.size / used_max, 4) if used_max else 0.0,
    }


def kv_report(engine: Engine) -> dict:
    cells = engine.context.memory.cells
    pos, seqs = cells.pos, cells.seqs
    used = np.flatnonzero(pos >= 0)
    request_of = {r.seq_id: r.request_id for r in engine.scheduler.running}
    live = np.flatnonzero(seqs.any(axis=0))
    by_requests = np.delete(seqs, PREFIX_CACHE_SEQ, axis=1).any(axis=1)
    cache_only = int(np.count_nonzero(seqs[:, PREFIX_CACHE_SEQ] & ~by_requests))
    return {
        "n_cells": cells.n_cells,
        "n_used": int(used.size),
        "n_request_cells": int(np.count_nonzero(by_requests)),  # held by at least one running request
        "n_prefix_cache_only_cells": cache_only,                 # held only by the prefix cache: evictable
        "cells": [[int(c), int(pos[c]), [int(s) for s in np.flatnonzero(seqs[c])]] for c in used],
        "sequences": [_sequence(int(s), seqs, pos, request_of.get(int(s))) for s in live],
        "fragmentation": _fragmentation(pos),
    }
