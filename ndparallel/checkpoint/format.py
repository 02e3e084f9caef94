"""The on-disk format: file names, the commit marker (built and checked field by field), and the state JSON.

A checkpoint directory holds DCP's files (``.metadata`` and the ``*.distcp`` shards) and three
JSON files of ours: the stamp (:mod:`~ndparallel.checkpoint.leftovers`), the state JSON and the
marker. The **marker** (``ndparallel_meta.json``) is written last; a directory is a checkpoint
only if it has one that passes :func:`parse_marker` (each field's type and range: a NaN commit
time, a string step or a list where a table belongs makes the whole marker corrupt). Nothing here
trusts a number it has not checked.

The **state JSON** (``ndparallel_state.json``) is the structure of everything saved, with every
tensor replaced by a placeholder ``{"__tensor__": key, "shape": [...], "dtype": "float32"}``:
:func:`split_state` makes it (the tensors go to DCP under their keys), :func:`join_state` puts
the tensors back. Tuples are ``{"__tuple__": [...]}``; dict keys must be strings. So the
optimizer's hyper-parameters, a scheduler's state and ``step`` are JSON, and loading never
unpickles an object of ours.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from ndparallel.errors import CheckpointError

__all__ = [
    "ALWAYS_HASHED",
    "FORMAT",
    "FORMAT_VERSION",
    "MARKER",
    "METADATA_FILE",
    "STATE_FILE",
    "TENSOR_MARK",
    "TUPLE_MARK",
    "build_marker",
    "commit_key",
    "empty_like_placeholder",
    "is_sha256",
    "join_state",
    "parse_marker",
    "placeholder_key",
    "placeholders",
    "split_state",
]

MARKER = "ndparallel_meta.json"
"""Written last, by rank 0: a directory without it is not a (complete) checkpoint."""
STATE_FILE = "ndparallel_state.json"
"""Everything that is not a tensor: the structure of the saved state with tensor placeholders."""
METADATA_FILE = ".metadata"
"""DCP's index of tensor keys, shapes and shard locations (a pickle: see ``dcp_metadata``)."""
FORMAT = "ndparallel-checkpoint"
FORMAT_VERSION = 3
"""3: the state JSON describes every rank's keys (pipeline stages hold different ones) and the optimizer
section is flat (``state.<fqn>.<name>``, ``param_groups.<fqn>.<name>``), so it reshards across pp sizes;
2: ``sha256`` covers every file in ``files``; 1: only ``.metadata`` and the state JSON are hashed.
Versions 1 and 2 (nested optimizer section, one rank's keys) still load."""
ALWAYS_HASHED = (METADATA_FILE, STATE_FILE)
"""DCP's pickle and our JSON: their SHA-256 is checked on every validate."""

TENSOR_MARK, TUPLE_MARK = "__tensor__", "__tuple__"
"""The keys that make a JSON object a tensor placeholder or a tuple (never keys of saved state)."""
_TENSOR, _TUPLE = TENSOR_MARK, TUPLE_MARK


# ----------------------------------------------------------------------------- the marker


def _int(minimum: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _finite_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _mesh(v: Any) -> bool:
    return isinstance(v, list) and all(
        isinstance(m, dict)
        and isinstance(m.get("dims"), list)
        and all(isinstance(d, str) for d in m["dims"])
        and isinstance(m.get("shape"), list)
        and all(_int(1)(s) for s in m["shape"])
        for m in v
    )


def _file_name(name: Any) -> bool:
    """A path inside the checkpoint directory: relative, no ``..``, no empty parts."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        return False
    parts = PurePosixPath(name).parts
    return not PurePosixPath(name).is_absolute() and all(p not in ("", ".", "..") for p in parts)


def _files(v: Any) -> bool:
    return (
        isinstance(v, dict)
        and all(_file_name(k) and _int(0)(size) for k, size in v.items())
        and all(name in v for name in ALWAYS_HASHED)
    )


def is_sha256(digest: Any) -> bool:
    return isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest) is not None


# field -> (rule, what it must be). Fields not listed are informational and not relied on.
_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "format_version": (_int(1), "a positive integer"),
    "step": (lambda v: v is None or _int(0)(v), "null or an integer >= 0"),
    "world_size": (_int(1), "an integer >= 1"),
    "mesh": (_mesh, "a list of {dims: [str], shape: [int >= 1]}"),
    "has_optimizer": (lambda v: isinstance(v, bool), "true or false"),
    "rng_ranks": (_int(0), "an integer >= 0"),
    "created": (lambda v: isinstance(v, str), "a string"),
    "created_unix": (_finite_number, "a finite number (the commit time)"),
    "files": (_files, f"a table of relative file names to sizes >= 0, listing {' and '.join(ALWAYS_HASHED)}"),
    "sha256": (
        lambda v: isinstance(v, dict) and all(isinstance(k, str) and is_sha256(d) for k, d in v.items()),
        "a table of file names to 64 lowercase hex digits",
    ),
}


def build_marker(
    info: dict[str, Any], created: str, created_unix: float, files: dict[str, int], sha256: dict[str, str]
) -> dict[str, Any]:
    """The marker of a save: ``info`` (step, world_size, mesh, has_optimizer, rng_ranks) and the commit's facts."""
    return dict(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        **info,
        created=created,
        created_unix=created_unix,
        torch_version=torch.__version__,
        files=files,
        sha256=sha256,
    )


def parse_marker(marker_path: Path) -> dict[str, Any]:
    """Read and check the marker at ``marker_path`` field by field; raises :class:`CheckpointError` naming the field."""
    directory = marker_path.parent
    try:
        marker = json.loads(marker_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{str(marker_path)!r} is unreadable or not JSON: {e}") from e
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise CheckpointError(f"{str(marker_path)!r} is not an ndparallel checkpoint marker")
    version = marker.get("format_version")
    if _int(1)(version) and version > FORMAT_VERSION:
        raise CheckpointError(
            f"{str(directory)!r} has format_version {version}; this ndparallel reads versions up to "
            f"{FORMAT_VERSION}: upgrade ndparallel"
        )
    for field, (rule, wanted) in _FIELDS.items():
        if field not in marker or not rule(marker[field]):
            got = repr(marker[field]) if field in marker else "missing"
            raise CheckpointError(
                f"checkpoint {str(directory)!r} is corrupt: {MARKER} field {field!r} is {got[:200]}, must be {wanted}"
            )
    unhashed = sorted(set(marker["files"]) - set(marker["sha256"]))
    if version >= 2 and unhashed:
        raise CheckpointError(f"checkpoint {str(directory)!r} is corrupt: {MARKER} has no SHA-256 for {unhashed[:5]}")
    unlisted = sorted(set(marker["sha256"]) - set(marker["files"]))
    if unlisted:
        raise CheckpointError(
            f"checkpoint {str(directory)!r} is corrupt: {MARKER} hashes unlisted files {unlisted[:5]}"
        )
    return marker


def commit_key(marker: dict[str, Any], path: Path) -> tuple[float, int, str]:
    """Commit order of a parsed marker: ``created_unix`` (rank 0's commit time), then the step, then the name."""
    step = marker["step"]
    return float(marker["created_unix"]), -1 if step is None else step, path.name


# ----------------------------------------------------------------------------- state <-> (JSON, tensors)


def split_state(obj: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON skeleton of ``obj``; every tensor goes to ``tensors[key]`` and leaves a placeholder."""
    if isinstance(obj, torch.Tensor):
        tensors[key] = obj
        return {_TENSOR: key, "shape": list(obj.shape), "dtype": str(obj.dtype).removeprefix("torch.")}
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str) or k in (_TENSOR, _TUPLE):
                raise CheckpointError(
                    f"checkpoint state {_display(key)!r} has key {k!r}: dict keys must be strings "
                    f"(and not {_TENSOR!r}/{_TUPLE!r}); convert the key, e.g. str({k!r})"
                )
            out[k] = split_state(v, f"{key}.{k}" if key else k, tensors)
        return out
    if isinstance(obj, list):
        return [split_state(v, f"{key}.{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {_TUPLE: [split_state(v, f"{key}.{i}", tensors) for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(
        f"checkpoint state {_display(key)!r} is a {type(obj).__name__}: extra state must be tensors or JSON values "
        "(int, float, str, bool, None, and lists, tuples and str-keyed dicts of them); e.g. pass "
        "scheduler.state_dict(), not the scheduler, and int(x) for numpy integers"
    )


def _display(key: str) -> str:
    return key.removeprefix("extra.") if key.startswith("extra.") else key or "<root>"


def join_state(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split_state`."""
    if isinstance(skeleton, dict):
        if _TENSOR in skeleton:
            return tensors[skeleton[_TENSOR]]
        if _TUPLE in skeleton:
            return tuple(join_state(v, tensors) for v in skeleton[_TUPLE])
        return {k: join_state(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [join_state(v, tensors) for v in skeleton]
    return skeleton


def placeholders(skeleton: Any) -> list[dict]:
    """Every tensor placeholder in ``skeleton``; each one's key is ``p["__tensor__"]``."""
    if isinstance(skeleton, dict):
        if _TENSOR in skeleton:
            return [skeleton]
        return [p for v in skeleton.values() for p in placeholders(v)]
    if isinstance(skeleton, list):
        return [p for v in skeleton for p in placeholders(v)]
    return []


def placeholder_key(p: dict) -> str:
    """The DCP key of the tensor a placeholder stands for."""
    return p[_TENSOR]


def empty_like_placeholder(p: dict) -> torch.Tensor:
    """An empty tensor of the placeholder's shape and dtype (DCP reads into it)."""
    name = p.get("dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):  # the JSON names a torch attribute: only a dtype may come back
        raise CheckpointError(f"{STATE_FILE} gives tensor {p.get(_TENSOR)!r} the dtype {name!r}, not a torch dtype")
    return torch.empty(p["shape"], dtype=dtype)
