"""What `GET /kv` shows: the memory as a whole, then each of its pools (one for the unified KV cache; a full and a
sliding one for iSWA; the attention layers' one for hybrid; none for recurrent) with every used cell's position and
sequence set, each sequence's cells, and how fragmented the pool is; and, for a memory with recurrent layers, its
state slots. Built on the engine thread, so it is a consistent snapshot between steps.

The shape:

    {"kind": "unified" | "iswa" | "hybrid" | "recurrent",
     "n_cells", "n_used", "n_request_cells", "n_prefix_cache_only_cells",   # the memory's: those of its first
                                          # pool, which keeps every position (the unified pool, iSWA's full pool,
                                          # hybrid's attention pool); a recurrent memory's slots, and no cells
                                          # held by requests or the prefix cache (0, 0)
     "kv_bytes",                          # every pool's, and the recurrent state's
     "sequences": [{"seq_id", "request_id", "role", "pos_min", "pos_max"}],  # pos_min: from where it is whole
     "pools": [{"name", "window", "n_layer", "n_cells", "n_used", "n_free", "kv_bytes",
                "n_request_cells", "n_prefix_cache_only_cells",
                "cells": [[cell, pos, [seq_id, ...]], ...],
                "sequences": [{"seq_id", "request_id", "role", "n_cells", "pos_min", "pos_max", "cell_runs"}],
                "fragmentation": {"used_max", "holes", "hole_runs", "largest_free_run", "fragmentation"}}],
     # only for a memory with recurrent layers ("hybrid", "recurrent"): one state slot per sequence id
     "recurrent": {"n_slots", "n_used", "n_layer", "state_bytes", "bytes_per_slot",   # n_layer: recurrent layers
                   "slots": [{"seq_id", "request_id", "role", "pos_min", "pos_max"}],  # the slots in use
                   # with prefix caching: the copies of states kept for reuse (kvlm.engine.state_checkpoints)
                   "state_copies": {"n_states", "capacity", "bytes"}},
     # with --prefix-cache-ram / --prefix-cache-dir: finished sequences' states beyond the cells (prefix_tiers)
     "prefix_tiers": [{"tier": "ram" | "disk", "entries", "bytes", "capacity", "queries", "hits", "hit_tokens"}]}
"""
from __future__ import annotations

import numpy as np

from kvlm.engine.engine import PREFIX_CACHE_SEQ, Engine
from kvlm.memory.memory import KVMemory
from kvlm.memory.recurrent import RecurrentMemory


def _runs(cells: np.ndarray) -> list[list[int]]:
    """Sorted cell indices as [first, last] runs of consecutive cells."""
    if cells.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(cells) != 1)
    starts = np.concatenate(([cells[0]], cells[breaks + 1]))
    ends = np.concatenate((cells[breaks], [cells[-1]]))
    return [[int(s), int(e)] for s, e in zip(starts, ends)]


def _role(seq_id: int) -> str:
    return "prefix_cache" if seq_id == PREFIX_CACHE_SEQ else "request"


def _sequence(seq_id: int, seqs: np.ndarray, pos: np.ndarray, request_id: str | None) -> dict:
    cells = np.flatnonzero(seqs[:, seq_id])
    return {
        "seq_id": seq_id,
        "request_id": request_id,
        "role": _role(seq_id),
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


def _pool(pool: KVMemory, request_of: dict[int, str]) -> dict:
    pos, seqs = pool.cells.pos, pool.cells.seqs
    used = np.flatnonzero(pos >= 0)
    live = np.flatnonzero(seqs.any(axis=0))
    by_requests = np.delete(seqs, PREFIX_CACHE_SEQ, axis=1).any(axis=1)
    cache_only = int(np.count_nonzero(seqs[:, PREFIX_CACHE_SEQ] & ~by_requests))
    return {
        "name": pool.name,
        "window": pool.window,                                   # 0: keeps every position
        "n_layer": pool.store.n_layer,
        "n_cells": pool.n_cells,
        "n_used": int(used.size),
        "n_free": pool.n_free,  # counting the cells the next micro-batch frees from sliding windows
        "kv_bytes": pool.kv_bytes,
        "n_request_cells": int(np.count_nonzero(by_requests)),  # held by at least one running request
        "n_prefix_cache_only_cells": cache_only,                 # held only by the prefix cache: evictable
        "cells": [[int(c), int(pos[c]), [int(s) for s in np.flatnonzero(seqs[c])]] for c in used],
        "sequences": [_sequence(int(s), seqs, pos, request_of.get(int(s))) for s in live],
        "fragmentation": _fragmentation(pos),
    }


def recurrent_part(memory) -> RecurrentMemory | None:
    """The memory's recurrent state slots: itself for "recurrent", its `recurrent` part for "hybrid", else None."""
    if memory.kind == "recurrent":
        return memory
    return memory.recurrent if memory.kind == "hybrid" else None


def _recurrent(slots: RecurrentMemory, request_of: dict[int, str]) -> dict:
    used = np.flatnonzero(slots.last >= 0)
    return {
        "n_slots": slots.n_seq_max,
        "n_used": int(used.size),
        "n_layer": slots.n_layer,
        "state_bytes": slots.kv_bytes,                         # every slot's, allocated whether in use or not
        "bytes_per_slot": slots.kv_bytes // slots.n_seq_max,  # both banks
        "slots": [{"seq_id": int(s), "request_id": request_of.get(int(s)), "role": _role(int(s)),
                   "pos_min": int(slots.first[s]), "pos_max": int(slots.last[s])} for s in used],
    }


def kv_report(engine: Engine) -> dict:
    memory = engine.context.memory
    request_of = {r.seq_id: r.request_id for r in engine.scheduler.running}
    pools = [_pool(pool, request_of) for pool in memory.pools]
    slots = recurrent_part(memory)
    recurrent = _recurrent(slots, request_of) if slots is not None else None
    live = sorted({s["seq_id"] for pool in pools for s in pool["sequences"]} |
                  {s["seq_id"] for s in (recurrent["slots"] if recurrent else ())})
    report = {
        "kind": memory.kind,
        "n_cells": memory.n_cells,
        "n_used": memory.n_used,
        "n_request_cells": pools[0]["n_request_cells"] if pools else 0,
        "n_prefix_cache_only_cells": pools[0]["n_prefix_cache_only_cells"] if pools else 0,
        "kv_bytes": memory.kv_bytes,
        "sequences": [{"seq_id": s, "request_id": request_of.get(s), "role": _role(s),
                       "pos_min": memory.seq_pos_min(s), "pos_max": memory.seq_pos_max(s)} for s in live],
        "pools": pools,
    }
    if engine.tiers is not None:
        report["prefix_tiers"] = [tier_report(tier) for tier in engine.tiers.tiers]
    if recurrent is not None:
        report["recurrent"] = recurrent
        copies = engine.checkpoints
        if copies is not None:
            recurrent["state_copies"] = {"n_states": copies.n_states, "capacity": copies.capacity,
                                         "bytes": copies.n_bytes}
    return report


def tier_report(tier) -> dict:
    stats = tier.stats
    return {"tier": tier.name, "entries": len(tier.entries), "bytes": tier.n_bytes, "capacity": tier.capacity,
            "queries": stats.queries, "hits": stats.hits, "hit_tokens": stats.hit_tokens}
