"""Per-rank bytes of parameters + gradients + optimizer state shrink by dp_shard x cp x tp (within 5%).

Reads the memory numbers of the parity runs in tests/parallel/test_parallelize.py (same spawned groups,
shared through ``tests.parity.run_cached``). ``python -m tests.bench.test_memory`` prints the table
that docs/parallelize.md shows.

Deviation from the exact ratio: under TP the RMSNorm weights are replicated on every tp rank
(SequenceParallel), and AdamW's per-parameter ``step`` scalars are not counted (0-dim); for the
tiny model the norm weights are 5 x 64 of 131,392 parameters, so the excess is < 0.5%.
"""

from __future__ import annotations

import math

import pytest

from tests.parallel.test_parallelize import ALL_RUNS, reference_for, results

TOLERANCE = 0.05
KINDS = ("param_bytes", "grad_bytes", "optim_bytes")


def shard_factor(parallel: dict) -> int:
    """How many ways parameters, gradients and optimizer state are split: dp_shard x cp x tp."""
    return math.prod(parallel.get(f"{d}_size", 1) for d in ("dp_shard", "cp", "tp"))


def memory_rows(world_sizes: tuple[int, ...] = tuple(ALL_RUNS)) -> list[dict]:
    """One row per run: shape, per-rank bytes (max over ranks), expected bytes and their ratio.

    The single-process total is the run's own reference (same dtype: float64 runs hold 8 bytes per value)."""
    rows = []
    for world_size in world_sizes:
        runs = ALL_RUNS[world_size]
        for label, ranks in results(world_size).items():
            parallel, kwargs = runs[label]
            total = sum(reference_for(kwargs)["memory"][k] for k in KINDS)
            per_rank = max(sum(r["memory"][k] for k in KINDS) for r in ranks)
            expected = total / shard_factor(parallel)
            rows.append(
                dict(
                    label=label,
                    world_size=world_size,
                    factor=shard_factor(parallel),
                    per_rank=per_rank,
                    expected=expected,
                    ratio=per_rank / expected,
                    single=total,
                )
            )
    return rows


# The 8-rank group is slow, as its parity test in tests/parallel/test_parallelize.py (the fast tier never spawns it)
@pytest.mark.parametrize("world_size", [pytest.param(n, marks=pytest.mark.slow) if n == 8 else n for n in ALL_RUNS])
def test_per_rank_memory_divides_by_shard_factor(world_size):
    for row in memory_rows((world_size,)):
        assert abs(row["ratio"] - 1) <= TOLERANCE, (
            f"{row['label']}: {row['per_rank']} B per rank vs {row['expected']:.0f} B expected "
            f"(single process {row['single']} B / {row['factor']})"
        )


def format_table(rows: list[dict]) -> str:
    lines = [
        "| run | ranks | dp_shard x cp x tp | per-rank bytes (params+grads+AdamW) | single / factor | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['world_size']} | {r['factor']} | {r['per_rank']:,} | {r['expected']:,.0f} "
            f"| {r['ratio']:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    rows = memory_rows()
    print(f"single process: {rows[0]['single']:,} bytes (params + grads + AdamW state, float64, tiny preset)")
    print(format_table(rows))
