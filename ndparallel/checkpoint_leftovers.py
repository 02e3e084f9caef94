"""Old import path of :mod:`ndparallel.checkpoint.leftovers` (the directories a save leaves).

Kept so existing imports work: these are the same objects, re-exported. New code imports them
from the new module (and a test that patches a function patches it there).
"""

from ndparallel.checkpoint.leftovers import (
    STAMP,
    is_leftover,
    leftover_name,
    new_token,
    reserved,
    write_stamp,
)

__all__ = ["STAMP", "is_leftover", "leftover_name", "new_token", "reserved", "write_stamp"]
