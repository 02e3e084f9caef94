"""Which stages a pp rank holds, and which pp rank holds the last stage (where the loss is)."""

from __future__ import annotations

from ndparallel.config.pipeline import schedule_spec

__all__ = ["last_stage_rank", "stage_ids"]


def stage_ids(pp_rank: int, pp_size: int, per_rank: int, schedule: str) -> list[int]:
    """Stage indices of ``pp_rank``: loop placement ``r, r + p, r + 2p, ...``; V placement ``r, 2p - 1 - r``
    (torch's V schedules derive this map themselves: the stages built must follow it)."""
    if schedule_spec(schedule).style == "v":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + i * pp_size for i in range(per_rank)]


def last_stage_rank(pp_size: int, per_rank: int, schedule: str) -> int:
    """The pp rank that holds the last stage: ``p - 1`` in loop placement, 0 in V placement."""
    n_stages = pp_size * per_rank
    return next(r for r in range(pp_size) if n_stages - 1 in stage_ids(r, pp_size, per_rank, schedule))
