"""Full (unsharded) model weights to and from one safetensors file.

:func:`export_safetensors` writes from a live, possibly sharded model (rank 0 gathers and writes)
or from a checkpoint directory (read by DCP in one process, no model needed).
:func:`import_safetensors` checks the file's names and shapes against the model on every rank,
then rank 0 reads it and torch sends each rank its shards. Files are written to ``<file>.part``
and renamed into place. The ``safetensors`` package is optional (``pip install 'ndparallel[hf]'``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from ndparallel.checkpoint import dcp_io
from ndparallel.checkpoint.checksums import verify_share
from ndparallel.checkpoint.format import placeholder_key, placeholders
from ndparallel.checkpoint.loading import read_checkpoint
from ndparallel.config.precision import stored_dtype_fits
from ndparallel.distributed.agree import agree, rank, world_size
from ndparallel.distributed.distinct import distinct_texts
from ndparallel.errors import CheckpointError

__all__ = ["export_safetensors", "import_safetensors"]


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as e:
        raise ImportError(
            "safetensors export/import needs the safetensors package: pip install safetensors "
            "(or pip install 'ndparallel[hf]')"
        ) from e
    return safetensors.torch


def _write_safetensors(tensors: dict[str, torch.Tensor], file: Path) -> None:
    st = _safetensors()
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(file.name + ".part")
    st.save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, file)


def export_safetensors(source: nn.Module | str | os.PathLike, file: str | os.PathLike, *, verify: bool = True) -> str:
    """Write the full (unsharded) model weights to one safetensors ``file``.

    ``source`` is a live (possibly sharded) model, and then every rank calls it (rank 0 gathers and
    writes), or a checkpoint directory, and then it runs in one process without a process group
    (with one, rank 0 does the work and the others wait; ``verify`` checks every file's SHA-256
    first, as :func:`~ndparallel.checkpoint.load` does). Keys are the model's parameter names.
    Ranks whose live models hold different parameters (pipeline stages) are refused on every rank:
    export their checkpoint directory instead.
    """
    error: BaseException | None = None
    try:
        _safetensors()
    except ImportError as e:  # fail early, on every rank, before any collective
        error = e
    agree(error, "safetensors export needs the safetensors package")
    file = Path(file).absolute()
    if isinstance(source, nn.Module):
        if len(distinct_texts(_key_digest(source))) > 1:  # before the gathers, which would not match up
            raise CheckpointError(
                f"could not write {str(file)!r}: the ranks hold different parameters (pipeline stages?); save a "
                "checkpoint and export that directory: export_safetensors(checkpoint_dir, file)"
            )
        full = get_model_state_dict(source, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank() == 0:
            try:
                _write_safetensors(full, file)
            except Exception as e:  # raised on every rank by agree
                error = e
        agree(error, f"could not write {str(file)!r}")
        return str(file)
    path = Path(source).absolute()
    if rank() == 0:
        try:
            _export_checkpoint(path, file, verify)
        except Exception as e:  # raised on every rank by agree
            error = e
    agree(error, f"could not export {str(path)!r}")
    return str(file)


def _key_digest(model: nn.Module) -> str:
    """The SHA-256 of the model's sorted state-dict keys (no collective: this rank's shards)."""
    return hashlib.sha256("\n".join(sorted(get_model_state_dict(model))).encode()).hexdigest()


def _export_checkpoint(path: Path, file: Path, verify: bool) -> None:
    """Full model tensors of a checkpoint directory, read in this process alone, to ``file``."""
    marker, skeleton, stored = read_checkpoint(path)
    if verify:
        verify_share(path, marker, 0, 1)
    tensors = {}
    for p in placeholders(skeleton["model"]):
        meta = stored[placeholder_key(p)]
        tensors[placeholder_key(p)] = torch.empty(list(meta.size), dtype=meta.properties.dtype)
    dcp_io.read(tensors, path, this_process_only=True)
    _write_safetensors({k.removeprefix("model."): v for k, v in tensors.items()}, file)


def import_safetensors(file: str | os.PathLike, model: nn.Module) -> None:
    """Load full weights from one safetensors ``file`` into ``model``, sharded or not; every rank calls it.

    Every rank checks the file's names and shapes against the model first (a mismatch raises
    :class:`CheckpointError`, model untouched); rank 0 reads the tensors and broadcasts them.
    """
    broadcast = world_size() > 1
    full: dict[str, torch.Tensor] = {}
    error: BaseException | None = None
    try:  # rank-local checks, agreed below before the broadcast
        st = _safetensors()
        _check_safetensors_fit(Path(file), model)
        if rank() == 0 or not broadcast:
            full = st.load_file(str(file))
    except Exception as e:  # raised on every rank by agree
        error = e
    agree(error, f"{str(file)!r} not imported (model untouched)")
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=True)
    )


def _check_safetensors_fit(file: Path, model: nn.Module) -> None:
    from safetensors import safe_open

    if not file.is_file():
        raise CheckpointError(f"no safetensors file at {str(file)!r}")
    try:
        with safe_open(str(file), framework="pt") as f:
            slices = {k: f.get_slice(k) for k in f.keys()}
            shapes = {k: list(s.get_shape()) for k, s in slices.items()}
            dtypes = {k: s.get_dtype() for k, s in slices.items()}
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise CheckpointError(f"{str(file)!r} is not a readable safetensors file: {e}") from e
    live = get_model_state_dict(model)
    missing = sorted(set(live) - set(shapes))
    unexpected = sorted(set(shapes) - set(live))
    if missing or unexpected:
        raise CheckpointError(
            f"{str(file)!r} does not fit the model: missing {missing[:5]} ({len(missing)}), "
            f"unexpected {unexpected[:5]} ({len(unexpected)})"
        )
    bad = [f"{k}: file {shapes[k]} vs model {list(t.shape)}" for k, t in live.items() if shapes[k] != list(t.shape)]
    if bad:
        raise CheckpointError(f"{str(file)!r} does not fit the model: shapes differ: {bad[:5]}")
    bad = [
        f"{k}: file {dtypes[k]} vs model {t.dtype}"
        for k, t in live.items()
        if not stored_dtype_fits(dtypes[k], t.dtype)
    ]
    if bad:  # a float weight's bytes declared I32 would be read as integers: other numbers, no error
        raise CheckpointError(
            f"{str(file)!r} does not fit the model: stored dtypes of another kind (a corrupt header?): {bad[:5]}"
        )
