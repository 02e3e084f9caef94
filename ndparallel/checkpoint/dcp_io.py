"""Every call into ``torch.distributed.checkpoint`` (DCP): write, write in the background, read.

DCP writes and reads the tensors (DTensor shards included) as ``.distcp`` files plus a
``.metadata`` index, so a checkpoint saved on one mesh loads on any other. Reads always go through
:class:`~ndparallel.checkpoint.dcp_metadata.SafeFileSystemReader` (no code runs from
``.metadata``). With no process group, DCP runs in this process alone.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ndparallel.checkpoint.dcp_metadata import SafeFileSystemReader, shard_error
from ndparallel.distributed.agree import distributed

__all__ = ["read", "write", "write_async"]


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns on every single-process save/load ("assuming the intent is to ... in a single
    # process"); that is exactly our intent when there is no process group. The filter lives only
    # inside this block: catch_warnings restores the filter list on exit. It is the calling
    # thread's block, but Python's filter list is process-wide (until 3.14's context-aware
    # warnings), so while it runs a warning with this one message is hidden in every thread, and
    # a filter another thread adds meanwhile is undone at exit, as with any catch_warnings.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def write(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """Collective (every rank, or one process): write ``tensors`` (this rank's shards) into ``directory``."""
    with _quiet_single_process():
        dcp.save(tensors, checkpoint_id=str(directory), no_dist=not distributed())


_ASYNC_GROUPS: dict[int, Any] = {}


def _async_group() -> Any:
    # A separate gloo group for the background thread's collectives, so they never interleave
    # with the training step's collectives on the default group. Created once (a collective).
    if not distributed():
        return None
    key = id(dist.group.WORLD)
    if key not in _ASYNC_GROUPS:
        _ASYNC_GROUPS[key] = dist.new_group(backend="gloo")
    return _ASYNC_GROUPS[key]


def write_async(tensors: dict[str, torch.Tensor], directory: Path) -> Any:
    """Collective: copy ``tensors`` to CPU now and write them in a background thread; a future of the write."""
    group = _async_group()
    kwargs = {"process_group": group} if distributed() else {"no_dist": True}
    with _quiet_single_process():
        future = dcp.async_save(tensors, checkpoint_id=str(directory), **kwargs)
    # Newer torch may return an AsyncSaveResponse (staging + upload futures) instead of a Future.
    return getattr(future, "upload_completion", future)


def read(targets: dict[str, torch.Tensor], directory: Path, *, this_process_only: bool = False) -> None:
    """Read the checkpoint in ``directory`` into ``targets`` (in place; their shapes and shardings decide
    what each rank reads). Collective unless ``this_process_only`` (or there is no process group). A shard
    file torch cannot read is a one-line :class:`CheckpointError` naming it, on every rank."""
    alone = this_process_only or not distributed()
    with _quiet_single_process():
        try:
            dcp.load(targets, storage_reader=SafeFileSystemReader(directory), no_dist=alone)
        except dcp.CheckpointException as e:  # a BaseException, raised on every rank
            named = shard_error(e, name_rank=not alone)
            if named is None:
                raise
            raise named from None
