"""Accelerate's remaining ``Accelerator`` names: settings it reports (``device_placement``, ``split_batches``,
``scaler``, ``fp8_backend``...) with the values they have on an ndparallel Accelerator, the rank properties of
its mesh, and the names ndparallel refuses: each raises a one-line ConfigError saying what to do instead
(never an AttributeError). tests/accelerator/test_accelerate_names.py walks Accelerate's own ``dir()`` against
these, so a name Accelerate adds is noticed."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from ndparallel.accelerator.kwargs import ProfileKwargs
from ndparallel.errors import ConfigError

__all__ = ["REFUSED_METHODS", "REFUSED_PROPERTIES", "ReportedNames"]

_DEEPSPEED = "DeepSpeed has no ndparallel equivalent: shard with ParallelismConfig(dp_shard_size=...)"

# Accelerate method -> what to do instead (the call raises).
REFUSED_METHODS: dict[str, str] = {
    "deepspeed_ulysses_dl_adapter": "DeepSpeed's Ulysses loader adapter: use ParallelismConfig(cp_size=..., "
    "cp_rotate_method='alltoall') and accelerator.maybe_context_parallel",
    "lomo_backward": "the LOMO optimizer is not supported: use a torch optimizer and accelerator.backward(loss)",
    "join_uneven_inputs": "ranks never get uneven batches here: keep DataLoaderConfiguration(even_batches=True)",
    "trigger_sync_in_backward": "gradients sync on the backward outside accelerator.no_sync / accumulate's "
    "non-final micro-batches; leave that scope for the backward that must sync",
}
# Accelerate attribute -> what to do instead (reading it raises).
REFUSED_PROPERTIES: dict[str, str] = {
    "deepspeed_engine_wrapped": _DEEPSPEED,
    "deepspeed_plugins": _DEEPSPEED,
}


def _refused_method(name: str, fix: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ConfigError(f"accelerator.{name}() is not supported by ndparallel: {fix}")

    refuse.__name__ = name
    return refuse


class ReportedNames:
    """Needs ``self.mesh``, ``self._config``, ``self._data_config``, ``self._fsdp_plugin``."""

    device_placement = True
    native_amp = False  # no torch.amp GradScaler/autocast pair: bf16 autocast or FSDP's policy
    scaler = None
    fp8_enabled = False
    has_fp8_handler = False
    has_lomo_optimizer = False
    delayed_fp8_autocast = False
    ao_recipe_handler = None
    te_recipe_handler = None
    deepspeed_plugin = None
    fp8_backend = "NO"  # Accelerate's FP8BackendType.NO (a str enum)
    optimizer_step_was_skipped = False  # bf16 / fp32: no scaler ever skips a step

    def __getattr__(self, name: str) -> Any:
        if name in REFUSED_METHODS:
            return _refused_method(name, REFUSED_METHODS[name])
        if name in REFUSED_PROPERTIES:
            raise ConfigError(f"accelerator.{name} is not supported by ndparallel: {REFUSED_PROPERTIES[name]}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ---------------------------------------------------------------- data settings
    @property
    def split_batches(self) -> bool:
        return self._data_config.split_batches

    @property
    def even_batches(self) -> bool:
        return self._data_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self._data_config.even_batches = bool(value)

    @property
    def dispatch_batches(self) -> bool | None:
        return self._data_config.dispatch_batches

    @property
    def use_seedable_sampler(self) -> bool:
        return self._data_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        return self._data_config.non_blocking

    @property
    def use_stateful_dataloader(self) -> bool:
        return self._data_config.use_stateful_dataloader

    @property
    def dataloader_config(self) -> Any:
        return self._data_config

    # ---------------------------------------------------------------- what runs
    @property
    def is_fsdp2(self) -> bool:
        return self.mesh.size("dp_shard_cp") > 1

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        return True

    @property
    def multi_device(self) -> bool:
        """More than one GPU process (Accelerate's meaning: CPU processes are not "devices")."""
        return self.num_processes > 1 and self.device.type == "cuda"

    # ---------------------------------------------------------------- ranks on the mesh
    def _rank_in(self, dim: str) -> int:
        return self.mesh.local_rank(dim)

    @property
    def data_parallel_rank(self) -> int:
        return self._rank_in("dp_replicate")

    @property
    def data_parallel_shard_rank(self) -> int:
        return self._rank_in("dp_shard")

    @property
    def context_parallel_rank(self) -> int:
        return self._rank_in("cp")

    @property
    def tensor_parallel_rank(self) -> int:
        return self._rank_in("tp")

    @property
    def pipeline_parallel_rank(self) -> int:
        return self._rank_in("pp")

    # ---------------------------------------------------------------- small behaviours
    def verify_device_map(self, model: Any) -> bool:
        """True when ``model`` was loaded with a multi-device ``device_map`` (which prepare() refuses)."""
        for module in model.modules():
            device_map = getattr(module, "hf_device_map", None)
            if isinstance(device_map, dict) and len(set(device_map.values())) > 1:
                return True
        return False

    @contextlib.contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None) -> Iterator[Any]:
        """A torch profiler around the block; with ``output_trace_dir``, each process writes
        ``profile_<rank>.json`` (a Chrome trace) there."""
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is not None:
            os.makedirs(handler.output_trace_dir, exist_ok=True)
            profiler.export_chrome_trace(os.path.join(handler.output_trace_dir, f"profile_{self.process_index}.json"))
        self.wait_for_everyone()
