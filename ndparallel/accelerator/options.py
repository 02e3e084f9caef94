"""The Accelerator's constructor options that come from 🤗 Accelerate: ``FullyShardedDataParallelPlugin``,
Accelerate keywords ndparallel accepts at their default value only, and merging them into the config."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ndparallel.config.accelerate import fsdp_plugin_settings
from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.errors import ConfigError

__all__ = [
    "ACCELERATE_DEFAULTS",
    "ACCELERATE_HONOURED",
    "ACCELERATE_REFUSED",
    "FullyShardedDataParallelPlugin",
    "apply_settings",
    "check_accelerate_options",
]


class FullyShardedDataParallelPlugin:
    """Accelerate's FSDP plugin, read as ``ParallelismConfig`` settings: ``reshard_after_forward``,
    ``cpu_offload`` and ``activation_checkpointing`` are honoured; ``fsdp_version=2``,
    ``auto_wrap_policy="transformer_based_wrap"``, ``state_dict_type="SHARDED_STATE_DICT"`` ... describe
    what ndparallel does; anything else raises a ConfigError naming what to write instead."""

    def __init__(self, **options: Any):
        self.options = dict(options)
        self.settings = fsdp_plugin_settings(options)

    def __repr__(self) -> str:
        return f"FullyShardedDataParallelPlugin({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"


# Accelerate keywords ndparallel takes at Accelerate's default only: keyword -> (default, what to do instead).
ACCELERATE_DEFAULTS: dict[str, tuple[Any, str]] = {
    "device_placement": (True, "prepare() always places models and prepared loaders' batches on accelerator.device"),
    "split_batches": (
        False,
        "each dp rank gets batch_size samples; to split one batch, use batch_size // accelerator.mesh.size('dp')",
    ),
    "deepspeed_plugin": (None, "DeepSpeed has no ndparallel equivalent: shard with ParallelismConfig(dp_shard_size=)"),
    "deepspeed_plugins": (None, "DeepSpeed has no ndparallel equivalent: shard with ParallelismConfig(dp_shard_size=)"),
    "megatron_lm_plugin": (None, "use ParallelismConfig(tp_size=..., cp_size=...)"),
    "torch_tp_plugin": (None, "use ParallelismConfig(tp_size=...)"),
    "dynamo_backend": (None, "use ParallelismConfig(compile='model') or compile='blocks'"),
    "dynamo_plugin": (None, "use ParallelismConfig(compile='model') or compile='blocks'"),
    "project_config": (None, "pass project_dir= (logging_dir is project_dir)"),
    "gradient_accumulation_plugin": (None, "pass gradient_accumulation_steps="),
    "dispatch_batches": (None, "prepare() gives each dp rank its own batches from its own loader (no dispatch)"),
    "dataloader_config": (None, "prepare() shards loaders over the dp view; see docs/accelerate-migration.md"),
    "kwargs_handlers": (None, "handlers are Accelerate classes; see docs/accelerate-migration.md for each setting"),
    "rng_types": (None, "seed every rank alike with ndparallel.set_seed"),
    "step_scheduler_with_optimizer": (True, "a prepared scheduler steps with the optimizer; step yours by hand"),
}


# Accelerate keywords every value of which prepare() already honours.
ACCELERATE_HONOURED: dict[str, str] = {
    "use_seedable_sampler": "prepared loaders always shuffle reproducibly (seeded DistributedSampler, set_epoch)",
}
# Accelerate keywords refused at any value: none of their values is what prepare() does.
ACCELERATE_REFUSED: dict[str, str] = {
    "even_batches": (
        "prepare() gives every dp rank the same number of batches by dropping len(dataset) % dp samples of each "
        "pass (Accelerate's True repeats samples instead; False would leave ranks uneven and hang a collective); "
        "remove even_batches="
    ),
}


def check_accelerate_options(options: Mapping[str, Any]) -> None:
    """Refuse Accelerate keywords that are not at their default (named, with the fix); unknown ones: TypeError."""
    for key, value in options.items():
        if key in ACCELERATE_HONOURED:
            continue
        if key in ACCELERATE_REFUSED:
            raise ConfigError(f"Accelerator({key}={value!r}) is not supported by ndparallel: {ACCELERATE_REFUSED[key]}")
        if key not in ACCELERATE_DEFAULTS:
            raise TypeError(f"Accelerator() got an unexpected keyword argument {key!r}")
        default, fix = ACCELERATE_DEFAULTS[key]
        if not (value is default or (default is not None and value == default and type(value) is type(default))):
            raise ConfigError(f"Accelerator({key}={value!r}) is not supported by ndparallel: {fix}")


def apply_settings(cfg: ParallelismConfig, settings: Mapping[str, Any], source: str) -> ParallelismConfig:
    """``cfg`` with ``settings`` (from ``source``) applied; a field the config already sets differently raises."""
    defaults = ParallelismConfig()
    for name, value in settings.items():
        current = getattr(cfg, name)
        if current != value and current != getattr(defaults, name):
            raise ConfigError(
                f"{source} sets {name}={value!r} but parallelism_config has {name}={current!r}; set one of them"
            )
    return dataclasses.replace(cfg, **settings)
