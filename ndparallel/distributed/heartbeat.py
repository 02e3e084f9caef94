"""One rank's heartbeat: where its main thread is (phase, code position, the collective it waits in), read off
its stack without stopping it, and every rank's last heartbeat read back from the job store.

The watchdog (``ndparallel/distributed/watchdog.py``) posts them; the verdicts
(``ndparallel/distributed/verdict.py``) and ``notebook_launcher``'s deadline read them.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from dataclasses import dataclass
from types import FrameType

import torch.distributed as dist

__all__ = ["Beat", "main_thread_position", "read_beats"]


@dataclass
class Beat:
    """One rank's heartbeat: where its main thread is, and since when."""

    rank: int
    node: int
    host: str
    seq: int
    """How many phases this rank has entered (all ranks go through the same phases in order)."""
    phase: str
    age: float
    """Seconds spent in ``phase`` so far, on this rank's clock."""
    count: int
    """Grows with every post; a count that stops moving means the rank is gone or frozen."""
    where: str
    """The innermost frame of the main thread outside torch: ``function (file:line)``."""
    collective: str
    """The torch.distributed call the main thread is blocked in ("" if none)."""


def read_beats(store: dist.Store, world_size: int) -> dict[int, Beat]:
    """Every rank's last heartbeat in ``store`` (rank -> Beat; a rank that never posted is missing)."""
    keys = [f"beat/{r}" for r in range(world_size)]
    if not store.check(keys):
        keys = [k for k in keys if store.check([k])]
    values = store.multi_get(keys) if keys else []
    beats = [Beat(**json.loads(v)) for v in values]
    return {b.rank: b for b in beats}


def _short(filename: str) -> str:
    parts = filename.replace(os.sep, "/").split("/")
    return "/".join(parts[-3:])


def _is_collective(filename: str, name: str) -> bool:
    path = filename.replace(os.sep, "/")
    if "/torch/distributed/" not in path:
        return False
    return path.endswith(("/distributed_c10d.py", "/_functional_collectives.py")) or "wait" in name


def main_thread_position() -> tuple[str, str, FrameType | None]:
    """(where, collective, its frame) of the main thread: its innermost frame outside torch, and the
    ``torch.distributed`` collective it is inside ("" and None if none). The frame object is the same
    while that one call runs, and a new one for the next call, even at the same line."""
    # sys._current_frames is documented CPython API ("for internal and specialized purposes"):
    # the only way to see what a blocked thread is doing without stopping it.
    frame = sys._current_frames().get(threading.main_thread().ident)
    where = collective = ""
    call = None
    while frame is not None:
        code = frame.f_code
        in_torch = "/torch/" in code.co_filename.replace(os.sep, "/")
        if call is None and _is_collective(code.co_filename, code.co_name):
            collective, call = code.co_name, frame
        if not where and not in_torch:
            where = f"{code.co_name} ({_short(code.co_filename)}:{frame.f_lineno})"
        frame = frame.f_back
    return where, collective, call
