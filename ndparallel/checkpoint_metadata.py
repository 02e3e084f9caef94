"""Old import path of :mod:`ndparallel.checkpoint.dcp_metadata` (DCP's ``.metadata``, read safely).

Kept so existing imports work: these are the same objects, re-exported. New code imports them
from the new module (and a test that patches a function patches it there).
"""

from ndparallel.checkpoint.dcp_metadata import (
    METADATA_FILE,
    SafeFileSystemReader,
    read_metadata,
)

__all__ = ["METADATA_FILE", "SafeFileSystemReader", "read_metadata"]
