"""Distributed checkpoints over torch.distributed.checkpoint (DCP): atomic, reshardable, no pickles of our own.

::

    ndp.checkpoint.save("ckpt/step-100", model, opt, step=100, scheduler=sched.state_dict(), keep_last=3)
    extra = ndp.checkpoint.load(ndp.checkpoint.resolve_latest("ckpt"), model, opt)   # any mesh, or one process
    sched.load_state_dict(extra["scheduler"])

A checkpoint is a directory. Model and optimizer tensors (DTensor shards included) go through DCP,
so a checkpoint saved on one mesh loads on any other. Everything that is not a tensor (optimizer
hyper-parameters, scheduler state, the data position, ``step``) is written by rank 0 as JSON, and
per-rank RNG states are saved as tensors: loading never unpickles an object of ours. The directory
is written as ``<path>.tmp-<id>``, completed by a JSON marker written last, then renamed into place,
so a save that dies half-way leaves the previous checkpoint intact. ``load`` checks the marker and
every file on every rank, and the ranks agree, before DCP touches the model: a failure seen by one
rank raises the same error on all of them instead of hanging. "Latest" means most recently
committed (not highest step), so a rollback's new branch wins. Layout and guarantees: docs/checkpointing.md.

One module per concept, each readable alone (docs/checkpointing.md, "Package layout"):

- ``format``: file names, the commit marker (built, and checked field by field), the state JSON
- ``checksums``: file sizes and SHA-256, hashed and verified in shares over the ranks
- ``storage``: atomic commit (fsync, marker last, rename), validate, latest, resolve_latest, prune
- ``leftovers``: the temporary directories a save leaves; only ours (stamped) are ever removed
- ``lock``: one job per checkpoint folder
- ``dcp_io``: every call into DCP (write, background write, read)
- ``dcp_metadata``: DCP's pickled ``.metadata`` read with an allow-list: no code runs
- ``rng``: per-rank RNG states as tensors
- ``saving`` / ``loading``: :func:`save`, :func:`save_async` and :func:`load`, agreed across ranks
  with :func:`ndparallel.distributed.agree.agree` (one error on every rank)
- ``safetensors_io``: full weights to and from one safetensors file
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ndparallel.lazy import lazy_names

# Public name -> its module, imported on first use (PEP 562): ``ndparallel train``'s front process checks the
# checkpoint folder (``lock``) without DCP, which imports DTensor.
_EXPORTS: dict[str, str] = {
    "MARKER": "ndparallel.checkpoint.format",
    "STATE_FILE": "ndparallel.checkpoint.format",
    "load": "ndparallel.checkpoint.loading",
    "export_safetensors": "ndparallel.checkpoint.safetensors_io",
    "import_safetensors": "ndparallel.checkpoint.safetensors_io",
    "AsyncSave": "ndparallel.checkpoint.saving",
    "save": "ndparallel.checkpoint.saving",
    "save_async": "ndparallel.checkpoint.saving",
    "latest": "ndparallel.checkpoint.storage",
    "prune": "ndparallel.checkpoint.storage",
    "resolve_latest": "ndparallel.checkpoint.storage",
    "validate": "ndparallel.checkpoint.storage",
    "CheckpointError": "ndparallel.errors",
}

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ imports each on first use
    from ndparallel.checkpoint.format import MARKER, STATE_FILE
    from ndparallel.checkpoint.loading import load
    from ndparallel.checkpoint.safetensors_io import export_safetensors, import_safetensors
    from ndparallel.checkpoint.saving import AsyncSave, save, save_async
    from ndparallel.checkpoint.storage import latest, prune, resolve_latest, validate
    from ndparallel.errors import CheckpointError


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)


__all__ = [
    "MARKER",
    "STATE_FILE",
    "AsyncSave",
    "CheckpointError",
    "export_safetensors",
    "import_safetensors",
    "latest",
    "load",
    "prune",
    "resolve_latest",
    "save",
    "save_async",
    "validate",
]
