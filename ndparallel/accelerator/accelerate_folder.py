"""Accelerate's ``save_state`` folder for jobs whose models are not sharded (one process, or plain data parallel),
written and read the way Accelerate does, so such folders move between Accelerate and ndparallel both ways.

The files (``ndparallel.accelerator.constants``): ``model.safetensors`` (``model_<i>`` for the i-th model, or
``pytorch_model.bin`` without ``safe_serialization``; the model's own keys, also under DDP; a ``module.`` prefix
is dropped on loading), ``optimizer.bin``, ``scheduler.bin`` (``_<i>`` after the
first), ``random_states_<rank>.pkl`` (the accumulation step and Python's, NumPy's, torch's and CUDA's generator
states) and ``custom_checkpoint_<i>.pkl``. Pickles are read with torch's ``weights_only`` loader (NumPy's arrays
and dtypes allowed, as Accelerate allows them): a folder cannot run code. A sharded job writes ndparallel's
checkpoint instead (DCP; docs/accelerate-migration.md, "Checkpoints").
"""

from __future__ import annotations

import codecs
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ndparallel.accelerator import stepping
from ndparallel.accelerator.constants import (
    MODEL_NAME,
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_MODEL_NAME,
    SCHEDULER_NAME,
)
from ndparallel.accelerator.helpers import save
from ndparallel.errors import ConfigError

__all__ = ["is_accelerate_folder", "load_folder", "save_folder"]

_PREFIX = "module."  # the keys of a DDP-wrapped model's own state_dict


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _suffix(index: int) -> str:
    return "" if index == 0 else f"_{index}"


def is_accelerate_folder(path: str | Path) -> bool:
    """True for a folder Accelerate's (or ndparallel's unsharded) ``save_state`` wrote."""
    folder = Path(path)
    has_model = (folder / f"{SAFE_MODEL_NAME}.safetensors").exists() or (folder / f"{MODEL_NAME}.bin").exists()
    return has_model and (folder / f"{RNG_STATE_NAME}_0.pkl").exists()


def _model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of ``model``'s state, deduplicated (tied tensors once) and contiguous, as Accelerate saves it."""
    seen: dict[tuple, str] = {}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if key in seen and tensor.numel():
            continue
        seen[key] = name
        state[name] = tensor.detach().to("cpu").contiguous()
    return state


EXTRA = "ndparallel_extra_state.json"  # save_state(**state): an ndparallel addition Accelerate ignores


def save_folder(folder: str | Path, models: list[nn.Module], optimizers: list, schedulers: list, custom: list,
                step: int, safe_serialization: bool, save_on_each_node: bool, extra: dict) -> str:  # fmt: skip
    """Write Accelerate's ``save_state`` files for these objects into ``folder`` (every rank calls it); ``extra``
    (JSON values) goes to one more file when given."""
    folder = Path(folder)
    try:
        text = json.dumps(extra) if extra else None
    except TypeError as error:
        raise ConfigError(f"save_state(**state): {error}; pass JSON values (numbers, strings, lists, dicts)") from None
    if _rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        if text is not None:
            (folder / EXTRA).write_text(text)
    if dist.is_initialized():
        dist.barrier()
    for index, model in enumerate(models):
        name = (
            f"{SAFE_MODEL_NAME}{_suffix(index)}.safetensors"
            if safe_serialization
            else f"{MODEL_NAME}{_suffix(index)}.bin"
        )
        save(_model_state(model), folder / name, save_on_each_node, safe_serialization)
    for index, optimizer in enumerate(optimizers):
        save(optimizer.state_dict(), folder / f"{OPTIMIZER_NAME}{_suffix(index)}.bin", save_on_each_node)
    for index, scheduler in enumerate(schedulers):
        save(stepping.scheduler_state(scheduler), folder / f"{SCHEDULER_NAME}{_suffix(index)}.bin", save_on_each_node)
    states: dict[str, Any] = {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    torch.save(states, folder / f"{RNG_STATE_NAME}_{_rank()}.pkl")
    for index, obj in enumerate(custom):
        save(obj.state_dict(), folder / f"custom_checkpoint_{index}.pkl", save_on_each_node)
    if dist.is_initialized():
        dist.barrier()
    return str(folder)


def _load(path: Path) -> Any:
    """``torch.load`` that builds tensors, containers, NumPy arrays and dtypes only (never runs code)."""
    core = np._core if hasattr(np, "_core") else np.core  # NumPy 2 renamed it
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, codecs.encode, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location="cpu", weights_only=True)


def _model_file(folder: Path, index: int) -> dict[str, torch.Tensor]:
    safe = folder / f"{SAFE_MODEL_NAME}{_suffix(index)}.safetensors"
    if safe.exists():
        from safetensors.torch import load_file

        state = load_file(str(safe))
    else:
        state = _load(folder / f"{MODEL_NAME}{_suffix(index)}.bin")
    if state and all(k.startswith(_PREFIX) for k in state):
        state = {k[len(_PREFIX) :]: v for k, v in state.items()}
    return state


def load_folder(folder: str | Path, models: list[nn.Module], optimizers: list, schedulers: list,
                custom: list) -> tuple[int, dict]:  # fmt: skip
    """Restore an Accelerate ``save_state`` folder into unsharded objects; returns the saved accumulation step and
    the extra state."""
    folder = Path(folder)
    for index, model in enumerate(models):
        state = _model_file(folder, index)
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {n for n in missing if _is_tied(model, n)}
        if set(missing) - tied or unexpected:
            raise ConfigError(
                f"{folder}: the saved model does not fit the prepared one (missing {sorted(set(missing) - tied)[:3]}, "
                f"unexpected {sorted(unexpected)[:3]}); load it into the model it was saved from"
            )
    for index, optimizer in enumerate(optimizers):
        optimizer.load_state_dict(_load(folder / f"{OPTIMIZER_NAME}{_suffix(index)}.bin"))
    for index, scheduler in enumerate(schedulers):
        scheduler.load_state_dict(_load(folder / f"{SCHEDULER_NAME}{_suffix(index)}.bin"))
    for index, obj in enumerate(custom):
        obj.load_state_dict(_load(folder / f"custom_checkpoint_{index}.pkl"))
    states = _load(folder / f"{RNG_STATE_NAME}_{_rank()}.pkl")
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
    extra = json.loads((folder / EXTRA).read_text()) if (folder / EXTRA).exists() else {}
    return int(states.get("step", 0)), extra


def _is_tied(model: nn.Module, name: str) -> bool:
    """True when state key ``name`` shares its storage with another key (saved once)."""
    state = model.state_dict()
    target = state[name].untyped_storage().data_ptr()
    return any(k != name and v.untyped_storage().data_ptr() == target for k, v in state.items())
