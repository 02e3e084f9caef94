"""Which blocks each pipeline stage holds: contiguous runs, balanced by parameter count, or given explicitly."""

from __future__ import annotations

from collections.abc import Sequence

from ndparallel.config.pipeline import check_pp_split
from ndparallel.errors import ConfigError

__all__ = ["balanced_split", "stage_ranges"]


def balanced_split(block_sizes: Sequence[int], n_stages: int, first_extra: int = 0, last_extra: int = 0) -> list[range]:
    """Contiguous block ranges, one non-empty range per stage, minimising the largest stage's parameter count.

    ``block_sizes``: parameters of each block; ``first_extra`` / ``last_extra``: what the first stage (the
    embedding) and the last (final norm and output) hold besides their blocks. Ties keep earlier stages
    no larger than later ones' choice (dynamic programming over split points: exact, O(stages x blocks^2)).
    """
    n = len(block_sizes)
    if n_stages > n:
        raise ConfigError(
            f"{n_stages} pipeline stages (pp_size x pp_stages_per_rank) but the model has {n} blocks: every stage "
            f"needs at least one; use at most {n} stages"
        )
    prefix = [0]
    for size in block_sizes:
        prefix.append(prefix[-1] + size)

    def cost(stage: int, first: int, last: int) -> int:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == n_stages - 1 else 0)
        return prefix[last] - prefix[first] + extra

    inf = float("inf")
    # best[s][j]: the smallest possible largest stage over stages 0..s-1 holding blocks 0..j-1.
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for s in range(1, n_stages + 1):
        for j in range(s, n - (n_stages - s) + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], cost(s - 1, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    ranges, end = [], n
    for s in range(n_stages, 0, -1):
        start = cut[s][end]
        ranges.append(range(start, end))
        end = start
    return ranges[::-1]


def stage_ranges(
    block_sizes: Sequence[int],
    n_stages: int,
    explicit: Sequence[Sequence[int]] | None = None,
    first_extra: int = 0,
    last_extra: int = 0,
) -> list[range]:
    """``explicit`` (``pp_split``: ``[first, last)`` per stage), checked against the model; else balanced."""
    if explicit is None:
        return balanced_split(block_sizes, n_stages, first_extra, last_extra)
    check_pp_split(explicit, n_stages=n_stages, n_blocks=len(block_sizes))
    return [range(first, last) for first, last in explicit]
