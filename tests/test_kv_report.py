"""`GET /kv`'s report, checked against a cell-by-cell count on a pool with holes and shared cells."""
from __future__ import annotations

import numpy as np

from kvlm.engine.engine import PREFIX_CACHE_SEQ, Engine
from kvlm.server.kv_report import kv_report


def place(cells, cell_ids, positions, seq_ids) -> None:
    mask = np.zeros((len(cell_ids), cells.n_seq_max), dtype=bool)
    for row, seqs in enumerate(seq_ids):
        mask[row, list(seqs)] = True
    cells.apply(np.array(cell_ids), np.array(positions), mask)


def test_report_counts_cells_sequences_runs_and_holes(smollm2):
    engine = Engine(smollm2, n_ctx=32, max_num_seqs=3)
    cells = engine.context.memory.cells
    # cells 0-3: a cached prefix shared by seq 1; 4-5: seq 1 alone; 8-9: seq 2; 12: cache only; 6-7, 10-11 free
    place(cells, [0, 1, 2, 3], [0, 1, 2, 3], [{PREFIX_CACHE_SEQ, 1}] * 4)
    place(cells, [4, 5], [4, 5], [{1}] * 2)
    place(cells, [8, 9], [0, 1], [{2}] * 2)
    place(cells, [12], [0], [{PREFIX_CACHE_SEQ}])
    report = kv_report(engine)

    used = [c for c in range(32) if cells.pos[c] >= 0]
    assert report["n_cells"] == 32 and report["n_used"] == len(used) == 9
    assert report["cells"] == [[c, int(cells.pos[c]), [int(s) for s in np.flatnonzero(cells.seqs[c])]] for c in used]
    assert report["n_request_cells"] == 8          # 0-5 and 8-9
    assert report["n_prefix_cache_only_cells"] == 1  # 12
    by_seq = {s["seq_id"]: s for s in report["sequences"]}
    assert set(by_seq) == {PREFIX_CACHE_SEQ, 1, 2}
    assert by_seq[PREFIX_CACHE_SEQ]["role"] == "prefix_cache"
    assert by_seq[PREFIX_CACHE_SEQ]["cell_runs"] == [[0, 3], [12, 12]]
    assert by_seq[1]["cell_runs"] == [[0, 5]] and (by_seq[1]["pos_min"], by_seq[1]["pos_max"]) == (0, 5)
    assert by_seq[2]["cell_runs"] == [[8, 9]] and by_seq[2]["n_cells"] == 2
    fragmentation = report["fragmentation"]
    assert fragmentation["used_max"] == 13
    assert fragmentation["holes"] == 4 and fragmentation["hole_runs"] == 2  # 6-7 and 10-11
    assert fragmentation["largest_free_run"] == 32 - 13
    assert fragmentation["fragmentation"] == round(4 / 13, 4)
    assert all(s["request_id"] is None for s in report["sequences"])  # no request is running


def test_report_of_an_empty_pool(smollm2):
    report = kv_report(Engine(smollm2, n_ctx=16, max_num_seqs=2))
    assert report["n_used"] == 0 and report["cells"] == [] and report["sequences"] == []
    assert report["fragmentation"] == {"used_max": 0, "holes": 0, "hole_runs": 0, "largest_free_run": 16,
                                       "fragmentation": 0.0}
