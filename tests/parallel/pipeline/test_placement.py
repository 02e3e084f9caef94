"""Which stages a pp rank holds per schedule style, and where the last stage (the loss) lives
(``ndparallel/parallel/pipeline/placement.py``). No ranks."""

from __future__ import annotations

from ndparallel.parallel.pipeline import last_stage_rank, stage_ids


def test_stage_placement_per_schedule_style():
    assert [stage_ids(r, 2, 1, "1f1b") for r in range(2)] == [[0], [1]]
    assert [stage_ids(r, 4, 2, "interleaved_1f1b") for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stage_ids(r, 4, 2, "zbv") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert last_stage_rank(4, 2, "interleaved_zb") == 3 and last_stage_rank(4, 2, "dualpipev") == 0
