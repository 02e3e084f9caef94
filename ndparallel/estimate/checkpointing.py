"""Activation checkpointing policies with torchtitan's meanings: which blocks are recomputed, which of a block's
matmuls re-run in backward, and what the per-op policy saves.

* ``none``: nothing is recomputed.
* ``full``: every block keeps only its input and re-runs its whole forward in backward.
* ``selective`` + ``N`` (per layer): every N-th block is checkpointed as under ``full``. ``N = 2`` is
  ndparallel's ``selective`` (every other block, the first included: ``ceil(n / 2)`` blocks).
* ``selective`` + ``op`` (per op, torchtitan's default): inside every block the outputs of the matmuls, of the
  attention kernel and of reduce-scatters are saved, except every second matmul (in forward order wq, wk, wv,
  wo, w1, w3, w2: wk, wo and w3 re-run); every other op is recomputed. Under compile the partitioner keeps only
  what backward reads, which drops w2's output (the block's output is not needed by its own backward).

ndparallel's trainer runs ``none``, ``full`` and per-layer ``2``; the planner models the others so that a
published torchtitan row can be typed in as it was run.
"""

from __future__ import annotations

import math

__all__ = [
    "BLOCK_LINEARS",
    "PER_OP_RECOMPUTED",
    "blocks_after_last_checkpointed",
    "checkpointed_count",
    "per_op",
    "recomputed_linears",
]

BLOCK_LINEARS = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")
"""The block's matmuls in forward order (what the per-op policy counts)."""
PER_OP_RECOMPUTED = BLOCK_LINEARS[1::2]
"""Every second matmul: wk, wo, w3."""


def per_op(mode: str, option: str) -> bool:
    return mode == "selective" and option == "op"


def checkpointed_count(n_layers: int, mode: str, option: str = "2") -> int:
    """Blocks wrapped in a checkpoint: all (``full``, per-op ``selective``), every ``N``-th (per-layer
    ``selective``: ``ceil(n / N)``, the first included), none."""
    if mode == "none":
        return 0
    if mode == "full" or per_op(mode, option):
        return n_layers
    return math.ceil(n_layers / int(option))


def blocks_after_last_checkpointed(n_layers: int, mode: str, option: str = "2") -> int:
    """Blocks after the last checkpointed one (none under ``full`` and per-op; per layer, the last is block
    ``N (ceil(n / N) - 1)``): their backward runs, freeing what they saved, before that block is recomputed."""
    count = checkpointed_count(n_layers, mode, option)
    if not count or mode == "full" or per_op(mode, option):
        return 0
    return n_layers - 1 - int(option) * (count - 1)


def recomputed_linears(mode: str, option: str) -> tuple[str, ...]:
    """The matmuls of a checkpointed block that run again in backward."""
    if mode == "none":
        return ()
    return PER_OP_RECOMPUTED if per_op(mode, option) else BLOCK_LINEARS
