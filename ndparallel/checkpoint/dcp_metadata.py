"""DCP's ``.metadata`` read without running code: a restricted unpickler and the StorageReader that uses it.

torch writes a checkpoint's ``.metadata`` (tensor keys, shapes, where each shard lies) with
``pickle``, and its own ``FileSystemReader`` reads it back with plain ``pickle.load``: a forged file
could run any code. Here it is read by an unpickler that resolves only the globals a DCP metadata
file of torch 2.11-2.14 contains (DCP's metadata dataclasses, ``torch.Size``, dtypes, layouts,
``pathlib`` paths) and refuses everything else, naming it. This is Python's documented
``Unpickler.find_class`` restriction: no private torch API. (torch's own restricted unpickler,
``torch.load(weights_only=True)`` under ``torch.serialization.safe_globals``, cannot read the file:
it stops at the protocol-4 FRAME opcode that DCP's pickle starts with, on torch 2.13.)

The result must hold tensor entries only: DCP would load a byte entry with
``torch.load(weights_only=False)`` (ndparallel never writes one), and every shard must lie in a
plain file of the checkpoint's directory. Tensor data itself is read by torch with
``torch.load(weights_only=True)``. :class:`SafeFileSystemReader` is DCP's ``FileSystemReader`` with
this metadata reader; pass it to ``dcp.load`` as ``storage_reader``.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.futures import Future

from ndparallel.checkpoint.format import METADATA_FILE
from ndparallel.errors import CheckpointError

__all__ = ["METADATA_FILE", "SafeFileSystemReader", "read_metadata", "shard_error"]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# (module, name) in the pickle -> (module, name) to resolve. These are the globals of the .metadata
# files torch 2.13 writes (run); torch's metadata.py defines the same classes in 2.9 and on the
# 2.15 development branch (read), so 2.11-2.14 between them should too. A class a later torch
# adds is refused by name until it is listed here (a failing load, never a silent one). Three are
# private to torch (_MEM_FORMAT_ENCODING, _StorageInfo, _get_layout): only named here, resolved
# in _allowed. BytesStorageMetadata is left out on purpose (see above).
_CLASSES = {
    (_DCP_METADATA, "Metadata"): (_DCP_METADATA, "Metadata"),
    (_DCP_METADATA, "TensorStorageMetadata"): (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"): (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "TensorProperties"): (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "MetadataIndex"): (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "StorageMeta"): (_DCP_METADATA, "StorageMeta"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"): (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): (
        "torch.distributed.checkpoint.filesystem",
        "_StorageInfo",
    ),
    ("torch", "Size"): ("torch", "Size"),
    # TensorProperties pickles its layout as _get_layout("torch.strided"): a lookup in a table.
    ("torch.serialization", "_get_layout"): ("torch.serialization", "_get_layout"),
}
# StorageMeta.checkpoint_id is the save's path; Python 3.13 pickles pathlib classes from pathlib._local.
for _module in ("pathlib", "pathlib._local"):
    for _name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
        _CLASSES[(_module, _name)] = ("pathlib", _name)


def _allowed(module: str, name: str) -> Any:
    """The object a DCP metadata pickle may name as ``module.name``, or None."""
    if (module, name) in _CLASSES:
        where, attr = _CLASSES[(module, name)]
        return getattr(importlib.import_module(where), attr, None)
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)  # dtypes are values, not callables
    return None


class _RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose globals are limited to :func:`_allowed` (Python's documented way to
    restrict unpickling); persistent ids are refused by the base class."""

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed(module, name)
        if found is None:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which is not on the allow-list")
        return found


def read_metadata(directory: str | os.PathLike) -> Metadata:
    """DCP metadata of the checkpoint in ``directory``, unpickled without running code; checked for shape.

    Raises :class:`CheckpointError` naming the file for anything that is not plain DCP metadata of
    tensors whose data lies in plain files of ``directory``.
    """
    directory = Path(directory)
    file = directory / METADATA_FILE
    try:
        data = file.read_bytes()
    except OSError as e:
        raise CheckpointError(f"checkpoint {str(directory)!r}: cannot read {METADATA_FILE!r}: {e}") from e
    try:
        metadata = _RestrictedUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # UnpicklingError, or what a malformed pickle raises inside the allowed classes
        raise _refused(directory, str(e)) from e
    _check_shape(metadata, directory)
    return metadata


def _refused(directory: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {str(directory)!r}: {METADATA_FILE!r} is not plain DCP metadata: {why}; refused, nothing in it "
        "was run (a forged checkpoint, or one written by a torch version ndparallel does not support)"
    )


def _check_shape(metadata: Any, directory: Path) -> None:
    if not isinstance(metadata, Metadata):
        raise _refused(directory, f"it holds a {type(metadata).__name__}, not a DCP Metadata")
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict) or not all(
        isinstance(k, str) and isinstance(v, TensorStorageMetadata) for k, v in entries.items()
    ):
        raise _refused(directory, "its entries are not all tensors")
    if not isinstance(metadata.storage_data, dict):
        raise _refused(directory, "it has no storage table")
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not _plain_file_name(name):
            raise _refused(directory, f"a shard lies at {name!r}, not in a file of the checkpoint's directory")
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, StorageMeta):
        raise _refused(directory, "its storage_meta is not a StorageMeta")


def _plain_file_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader``, reading ``.metadata`` with :func:`read_metadata`."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._directory = Path(path)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id:
            self._directory = Path(checkpoint_id)

    def read_data(self, plan: LoadPlan, planner: Any) -> Any:
        """DCP's read, one shard file at a time, so a file torch cannot read (data replaced by a forger who
        recomputed the SHA-256, a file of another format) is named: a :class:`CheckpointError` DCP then
        raises on every rank (see :func:`shard_error`)."""
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as e:
                why = (str(e).strip().splitlines() or [""])[0][:200]
                if "weights_only" in why:  # torch's advice (load with weights_only=False) would run the forger's code
                    why = "torch.load(weights_only=True) refused its content"
                raise CheckpointError(
                    f"checkpoint {str(self._directory)!r}: {name!r} is not a DCP shard torch can read "
                    f"({type(e).__name__}: {why}); the model and optimizer may be partly overwritten: load another "
                    "checkpoint into them, or rebuild them"
                ) from e
        future: Future = Future()
        future.set_result(None)
        return future

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self._directory)
        if metadata.storage_meta is None:  # as torch's reader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


def shard_error(error: CheckpointException, name_rank: bool) -> CheckpointError | None:
    """The :class:`CheckpointError` a rank's :meth:`SafeFileSystemReader.read_data` raised inside DCP's
    ``CheckpointException`` (which DCP raises on every rank), as one line (naming that rank if ``name_rank``);
    None if no rank failed that way."""
    for failed_rank, failure in sorted(error.failures.items()):
        cause = failure[0] if isinstance(failure, tuple) else getattr(failure, "exception", None)
        if isinstance(cause, CheckpointError):
            return CheckpointError(f"rank {failed_rank}: {cause}" if name_rank else str(cause))
    return None
