"""Old import path of :mod:`ndparallel.checkpoint.lock` (one job per checkpoint folder).

Kept so existing imports work: these are the same objects, re-exported. New code imports them
from the new module (and a test that patches a function patches it there).
"""

from ndparallel.checkpoint.lock import (
    LOCK_FILE,
    CheckpointDirLock,
    check_not_locked,
)

__all__ = ["LOCK_FILE", "CheckpointDirLock", "check_not_locked"]
