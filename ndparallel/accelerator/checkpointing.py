"""Weights and training state of the Accelerator: ``save`` (one object, main process), ``get_state_dict`` /
``save_model`` (full weights), ``save_state`` / ``load_state`` of the prepared models, optimizers, schedulers,
the objects given to ``register_for_checkpointing`` and the RNG states, the pre-hooks of both, and Accelerate's
automatic checkpoint naming. Unsharded jobs (one process, plain data parallel) write and read Accelerate's own
folder (accelerate_folder.py); sharded ones ndparallel's DCP checkpoint, loadable on any mesh."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ndparallel import checkpoint
from ndparallel.accelerator import accelerate_folder, saving, stepping
from ndparallel.accelerator.pipeline import PipelineModel
from ndparallel.accelerator.stage_optim import StageViews, merge_views, stage_views
from ndparallel.errors import ConfigError

__all__ = ["CheckpointNames", "RemovableHook"]

_CUSTOM = "custom_checkpoint_{}"


class RemovableHook:
    """What ``register_*_pre_hook`` returns: ``remove()`` unregisters the hook."""

    def __init__(self, hooks: dict[int, Callable], key: int):
        self._hooks, self._key = hooks, key

    def remove(self) -> None:
        self._hooks.pop(self._key, None)


def _register(hooks: dict[int, Callable], hook: Callable) -> RemovableHook:
    key = max(hooks, default=-1) + 1
    hooks[key] = hook
    return RemovableHook(hooks, key)


class CheckpointNames:
    """Needs ``self._models``, ``self._optimizers``, ``self._schedulers``, ``self.project_configuration``."""

    def _init_checkpointing(self) -> None:
        self._custom_objects: list[Any] = []
        self._save_hooks: dict[int, Callable] = {}
        self._load_hooks: dict[int, Callable] = {}

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """``torch.save(obj, f)`` (or safetensors' ``save_file``) on the main process only; no barrier, as
        Accelerate's. With ``save_on_each_node`` each node's local main process writes."""
        writer = self.is_local_main_process if self.project_configuration.save_on_each_node else self.is_main_process
        if not writer:
            return
        if safe_serialization:
            from safetensors.torch import save_file

            save_file(obj, str(f), metadata={"format": "pt"})
        else:
            torch.save(obj, f)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """Full (gathered) CPU tensors on the main process, ``{}`` elsewhere; every rank must call it."""
        return saving.full_state_dict(getattr(model, "_orig_mod", model))

    def save_model(
        self, model: nn.Module, save_directory: str | os.PathLike, max_shard_size="10GB", safe_serialization=True
    ) -> None:
        """Full weights as ``model.safetensors`` (sharded above ``max_shard_size``); every rank calls it."""
        saving.save_model(getattr(model, "_orig_mod", model), save_directory, max_shard_size, safe_serialization)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore ``objects`` (anything with ``state_dict`` / ``load_state_dict``) with the state."""
        bad = [type(o).__name__ for o in objects if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))]
        if bad:
            raise ConfigError(
                f"register_for_checkpointing: {', '.join(bad)} has no state_dict/load_state_dict; give objects that do"
            )
        self._custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: Callable) -> RemovableHook:
        """``hook(models, weights, output_dir)`` runs before ``save_state`` writes."""
        return _register(self._save_hooks, hook)

    def register_load_state_pre_hook(self, hook: Callable) -> RemovableHook:
        """``hook(models, input_dir)`` runs before ``load_state`` reads."""
        return _register(self._load_hooks, hook)

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration

    @property
    def should_save_model(self) -> bool:
        return True

    def _automatic_dir(self) -> str:
        config = self.project_configuration
        if config.project_dir is None:
            raise ConfigError("automatic_checkpoint_naming needs ProjectConfiguration(project_dir=...)")
        return os.path.join(config.project_dir, "checkpoints", f"checkpoint_{config.iteration}")

    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True, **state):
        """Checkpoint the prepared model, optimizer, schedulers and registered objects (DCP, loadable on any
        mesh; ``state``: extra tensors and JSON values). Under pp: this rank's stage modules, one optimizer view
        per stage. Without ``output_dir`` (``automatic_checkpoint_naming``): ``project_dir/checkpoints/
        checkpoint_<iteration>``, keeping the last ``total_limit``. Returns the folder."""
        config = self.project_configuration
        if config.automatic_checkpoint_naming:
            if output_dir is not None:
                raise ConfigError("save_state(output_dir) with automatic_checkpoint_naming: call save_state()")
            output_dir = self._automatic_dir()
        elif output_dir is None:
            raise ConfigError("save_state() needs an output_dir (or ProjectConfiguration(automatic_checkpoint_naming))")
        models = list(self._models)
        for hook in self._save_hooks.values():
            hook(models, [m.state_dict() for m in models], str(output_dir))
        if len(models) != len(self._models):
            raise ConfigError("a save_state pre-hook removed a model: save_state always writes the prepared model")
        if self._writes_accelerate_folders:
            if config.automatic_checkpoint_naming and config.total_limit is not None:
                self._prune_automatic(config.total_limit)
            path = accelerate_folder.save_folder(output_dir, models, self._optimizers, self._schedulers,
                                                 self._custom_objects, self.step, safe_serialization,
                                                 config.save_on_each_node, state)  # fmt: skip
            if config.automatic_checkpoint_naming:
                config.iteration += 1
            return path
        model, optimizer, views = self._checkpoint_parts()
        if self._schedulers:
            state["schedulers"] = [stepping.scheduler_state(s) for s in self._schedulers]
        for index, obj in enumerate(self._custom_objects):
            state[_CUSTOM.format(index)] = obj.state_dict()
        keep = config.total_limit if config.automatic_checkpoint_naming else None
        path = checkpoint.save(output_dir, model, optimizer, keep_last=keep, accelerator_step=self.step, **state)
        if views is not None:
            merge_views(self._optimizers[0], views)  # a save before the first step initialises the state
        if config.automatic_checkpoint_naming:
            config.iteration += 1
        return path

    def load_state(self, input_dir: str | os.PathLike | None = None, **load_model_func_kwargs: Any) -> dict[str, Any]:
        """Restore what ``save_state`` wrote (without ``input_dir``: the newest automatically named checkpoint);
        returns the extra state."""
        if load_model_func_kwargs:
            raise ConfigError(f"load_state({', '.join(load_model_func_kwargs)}=...): ndparallel takes input_dir only")
        if input_dir is None:
            input_dir = self._latest_automatic()
        if accelerate_folder.is_accelerate_folder(input_dir):
            return self._load_accelerate_folder(input_dir)
        model, optimizer, views = self._checkpoint_parts()
        for hook in self._load_hooks.values():
            hook(list(self._models), str(input_dir))
        state = checkpoint.load(input_dir, model, optimizer)
        if views is not None:
            merge_views(self._optimizers[0], views)
        for scheduler, saved in zip(self._schedulers, state.pop("schedulers", []), strict=False):
            scheduler.load_state_dict(saved)
        for index, obj in enumerate(self._custom_objects):
            obj.load_state_dict(state.pop(_CUSTOM.format(index)))
        self.step = int(state.pop("accelerator_step", 0))
        self._after_automatic_load(input_dir)
        return state

    @property
    def _writes_accelerate_folders(self) -> bool:
        """Unsharded models (one process, or plain data parallel): Accelerate's own folder layout."""
        return self.mesh.size("dp_replicate") == self.num_processes and not any(
            isinstance(m, PipelineModel) for m in self._models
        )

    def _load_accelerate_folder(self, input_dir: str | os.PathLike) -> dict[str, Any]:
        if not self._writes_accelerate_folders:
            raise ConfigError(
                f"{str(input_dir)!r} is an Accelerate save_state folder of unsharded weights; this job shards them "
                f"(mesh {self.parallelism_config.sizes}): resume it on plain data parallel, then save_state again"
            )
        for hook in self._load_hooks.values():
            hook(list(self._models), str(input_dir))
        self.step, extra = accelerate_folder.load_folder(
            input_dir, self._models, self._optimizers, self._schedulers, self._custom_objects
        )
        self._after_automatic_load(input_dir)
        return extra

    def _after_automatic_load(self, input_dir: str | os.PathLike) -> None:
        if self.project_configuration.automatic_checkpoint_naming:
            match = re.search(r"checkpoint_(\d+)$", str(input_dir).rstrip("/"))
            if match:
                self.project_configuration.iteration = int(match.group(1)) + 1

    def _prune_automatic(self, total_limit: int) -> None:
        """Delete the oldest automatically named checkpoints, leaving room for one more (main process)."""
        folder = Path(self._automatic_dir()).parent
        if self.is_main_process and folder.is_dir():
            found = sorted((int(p.name[11:]), p) for p in folder.glob("checkpoint_*") if p.name[11:].isdigit())
            for _, old in found[: max(0, len(found) + 1 - total_limit)]:
                shutil.rmtree(old)
        self.wait_for_everyone()

    def _latest_automatic(self) -> str:
        if not self.project_configuration.automatic_checkpoint_naming:
            raise ConfigError("load_state() needs an input_dir (or ProjectConfiguration(automatic_checkpoint_naming))")
        folder = Path(self._automatic_dir()).parent
        found = sorted((int(p.name[11:]), p) for p in folder.glob("checkpoint_*") if p.name[11:].isdigit())
        if not found:
            raise ConfigError(f"load_state(): no checkpoint_<n> folder in {str(folder)!r}")
        return str(found[-1][1])

    def _checkpoint_parts(self) -> tuple[Any, Any, StageViews | None]:
        """What ``checkpoint.save``/``load`` take: the model and optimizer, or (pp) the stage modules and one
        optimizer view per stage (then also the views, to merge back)."""
        if len(self._models) != 1 or len(self._optimizers) > 1:
            raise ConfigError(
                f"save_state/load_state handle one prepared model and at most one optimizer, got "
                f"{len(self._models)} and {len(self._optimizers)}; call ndparallel.checkpoint.save per model"
            )
        model, optimizer = self._models[0], (self._optimizers[0] if self._optimizers else None)
        if not isinstance(model, PipelineModel):
            return model, optimizer, None
        if optimizer is None:
            return model.stages, None, None
        views = stage_views(optimizer, model.stages)
        return model.stages, [view for view, _ in views], views
