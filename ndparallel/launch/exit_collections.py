"""Leave the interpreter's garbage collections at exit out of ndparallel's own processes.

While Python finalizes, it runs full garbage collections over every object still alive: after ``import torch``,
DTensor and ``torch._dynamo`` (more so with transformers) a noticeable share of a short process's CPU, spent
freeing memory the operating system takes back anyway. ``gc.freeze()`` in an ``atexit`` handler moves those
objects out of the collector's sight; everything else about exit stays as it was: the other atexit handlers, the
joins of non-daemon threads, the flushing of files and module teardown. Objects that only a reference cycle keeps
alive are then not finalized at exit, which Python never promised anyway; so ndparallel registers this in the
processes whose objects it owns (the ``ndparallel`` command and its ``train`` ranks), never in a user's script.
Measured in docs/architecture.md, "Tests".
"""

from __future__ import annotations

import atexit
import gc

__all__ = ["skip_collections_at_exit"]

_registered = False


def skip_collections_at_exit() -> None:
    """Freeze the heap at exit, before the interpreter's final collections (once per process)."""
    global _registered
    if not _registered:
        atexit.register(gc.freeze)
        _registered = True
