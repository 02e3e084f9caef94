"""The one sequence-length rule: which global sequence lengths a mesh can split.

Context parallel cuts the sequence into ``cp_size`` pieces, or ``2 * cp_size`` chunks with load
balancing (head-tail layout: each rank holds one chunk from the front and its mirror from the
back). Sequence parallel then splits each rank's tokens over ``tp_size``. So a global sequence
length ``S`` works when

    S % (2 * cp_size if load balancing else cp_size) == 0   and   (S / cp_size) % tp_size == 0

The trainer's pre-flight check, ``ndparallel plan``, the bench, ``context_parallel`` and the
Hugging Face input checks all ask this module (docs/context-parallel.md, "Sequence lengths").
"""

from __future__ import annotations

import math

from ndparallel.errors import ConfigError

__all__ = ["check_sequence_length", "cp_chunks", "sequence_multiple", "sequence_problem"]


def cp_chunks(cp_size: int, load_balance: bool) -> int:
    """How many equal pieces context parallel cuts the sequence into."""
    return 2 * cp_size if cp_size > 1 and load_balance else cp_size


def sequence_multiple(cp_size: int, tp_size: int, load_balance: bool) -> int:
    """The smallest valid global sequence length; every valid one is a multiple of it."""
    return math.lcm(cp_chunks(cp_size, load_balance), cp_size * tp_size)


def sequence_problem(
    seq_len: int, cp_size: int, tp_size: int = 1, load_balance: bool = True, what: str = "sequence length"
) -> str | None:
    """Why ``seq_len`` cannot be split over ``cp_size`` x ``tp_size`` (naming ``what`` and the fix), or None."""
    chunks = cp_chunks(cp_size, load_balance)
    multiple = sequence_multiple(cp_size, tp_size, load_balance)
    if seq_len % chunks:
        if chunks != cp_size:
            return (
                f"{what} {seq_len} is not divisible by 2 x cp_size = {chunks} (cp_load_balance=true cuts it into 2 "
                f"chunks per rank): pad or crop it to a multiple of {multiple}, or set cp_load_balance=false"
            )
        return f"{what} {seq_len} is not divisible by cp_size={cp_size}: pad or crop it to a multiple of {multiple}"
    if (seq_len // cp_size) % tp_size:
        per_rank = seq_len // cp_size
        where = f" split over cp_size={cp_size} leaves {per_rank} tokens per rank," if cp_size > 1 else " is"
        return (
            f"{what} {seq_len}{where} not divisible by tp_size={tp_size} (sequence parallel splits each rank's "
            f"tokens over tp): use a multiple of {multiple}"
        )
    return None


def check_sequence_length(
    seq_len: int, cp_size: int, tp_size: int = 1, load_balance: bool = True, what: str = "sequence length"
) -> None:
    """Raise :class:`ConfigError` unless ``seq_len`` splits over ``cp_size`` x ``tp_size`` (see the module doc)."""
    problem = sequence_problem(seq_len, cp_size, tp_size, load_balance, what)
    if problem:
        raise ConfigError(problem)
