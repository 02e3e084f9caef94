"""Old import path of :mod:`ndparallel.checkpoint.manifest` (the commit marker and checksums).

Kept so existing imports work: these are the same objects, re-exported. New code imports them
from the new module (and a test that patches a function patches it there).
"""

from ndparallel.checkpoint.manifest import (
    ALWAYS_HASHED,
    FORMAT,
    FORMAT_VERSION,
    MARKER,
    STATE_FILE,
    check_files,
    commit_key,
    hash_share,
    is_sha256,
    parse_marker,
    sha256_file,
    verify_share,
)

__all__ = [
    "ALWAYS_HASHED",
    "FORMAT",
    "FORMAT_VERSION",
    "MARKER",
    "STATE_FILE",
    "check_files",
    "commit_key",
    "hash_share",
    "is_sha256",
    "parse_marker",
    "sha256_file",
    "verify_share",
]
