"""Collectives over sets that differ between ranks (e.g. pipeline stages' key names), as tensors: nothing pickled.

:func:`distinct_texts` gives every rank the distinct texts held by the ranks, each sent once (ranks
with equal texts, e.g. the data-parallel replicas of one pipeline stage, cost one digest each).
:func:`any_rank` tells, for each entry of a list every rank indexes the same way, whether some
rank holds it (one all-reduce). Without a process group both are their single-process identity.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ndparallel.distributed.agree import _device, broadcast_text, distributed, gather_text, rank

__all__ = ["any_rank", "distinct_texts"]


def distinct_texts(text: str) -> list[str]:
    """Collective: the distinct ``text`` values of all ranks, on every rank, in the order of the first rank
    holding each. Ranks exchange SHA-256 digests, then the first holder of each distinct text broadcasts it."""
    if not distributed() or dist.get_world_size() == 1:
        return [text]
    digests = gather_text(hashlib.sha256(text.encode()).hexdigest())
    first_holder: dict[str, int] = {}
    for r, digest in enumerate(digests):
        first_holder.setdefault(digest, r)
    if len(first_holder) == 1:
        return [text]
    return [broadcast_text(text if rank() == src else "", src) for src in first_holder.values()]


def any_rank(flags: Sequence[bool]) -> list[bool]:
    """Collective: for each position, whether ``flags[i]`` is true on some rank. Every rank passes a list of
    the same length, indexed the same way (e.g. the sorted keys of one checkpoint file); one all-reduce."""
    if not distributed() or dist.get_world_size() == 1 or not flags:
        return [bool(f) for f in flags]
    held = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32, device=_device())  # device: agree's rule
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    return [bool(v) for v in held.tolist()]
