"""Old import path of the commit marker and checksums, now :mod:`ndparallel.checkpoint.format` and ``.checksums``.

Kept so existing imports work: these are the same objects, re-exported. New code imports them
from the new modules (and a test that patches a function patches it there).
"""

from ndparallel.checkpoint.checksums import check_files, hash_share, sha256_file, verify_share
from ndparallel.checkpoint.format import (
    ALWAYS_HASHED,
    FORMAT,
    FORMAT_VERSION,
    MARKER,
    STATE_FILE,
    commit_key,
    is_sha256,
    parse_marker,
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
