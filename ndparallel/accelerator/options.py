"""The Accelerator's constructor options that come from 🤗 Accelerate: ``FullyShardedDataParallelPlugin``, the
configuration dataclasses and kwargs handlers, keywords ndparallel accepts at their default value only, the
config of ``Accelerator()`` without one, and merging settings into the config."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from ndparallel.accelerator.kwargs import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    ProjectConfiguration,
    check_fields,
)
from ndparallel.accelerator.precision import merge_mixed_precision
from ndparallel.config.accelerate import fsdp_plugin_settings
from ndparallel.config.accelerate_env import LaunchSettings
from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.errors import ConfigError

__all__ = [
    "ACCELERATE_DEFAULTS",
    "DATA_SHORTHANDS",
    "FullyShardedDataParallelPlugin",
    "Handlers",
    "accumulation_plugin",
    "apply_settings",
    "check_accelerate_options",
    "data_configuration",
    "default_config",
    "project_configuration",
    "resolve_config",
]


# Keywords that make every rank start from rank 0's weights (Accelerate's FSDP2 does so when either is true).
_SYNC_FROM_RANK0 = ("sync_module_states", "cpu_ram_efficient_loading", "fsdp_sync_module_states",
                    "fsdp_cpu_ram_efficient_loading")  # fmt: skip


class FullyShardedDataParallelPlugin:
    """Accelerate's FSDP plugin, read as ``ParallelismConfig`` settings: ``reshard_after_forward``,
    ``cpu_offload`` and ``activation_checkpointing`` are honoured; ``fsdp_version=2``,
    ``auto_wrap_policy="transformer_based_wrap"``, ``state_dict_type="SHARDED_STATE_DICT"`` ... describe
    what ndparallel does; anything else raises a ConfigError naming what to write instead."""

    def __init__(self, **options: Any):
        self.options = dict(options)
        rank0 = {k: options[k] for k in _SYNC_FROM_RANK0 if k in options}
        self.sync_module_states = any(bool(v) for v in rank0.values())
        self.settings = fsdp_plugin_settings({k: v for k, v in options.items() if k not in rank0})

    def __repr__(self) -> str:
        return f"FullyShardedDataParallelPlugin({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"


# Accelerate keywords ndparallel takes at Accelerate's default only: keyword -> (default, what to do instead).
ACCELERATE_DEFAULTS: dict[str, tuple[Any, str]] = {
    "device_placement": (True, "prepare() always places models and prepared loaders' batches on accelerator.device"),
    "deepspeed_plugin": (None, "DeepSpeed has no ndparallel equivalent: shard with ParallelismConfig(dp_shard_size=)"),
    "deepspeed_plugins": (None, "DeepSpeed has no ndparallel equivalent: shard with ParallelismConfig(dp_shard_size=)"),
    "megatron_lm_plugin": (None, "use ParallelismConfig(tp_size=..., cp_size=...)"),
    "torch_tp_plugin": (None, "use ParallelismConfig(tp_size=...)"),
    "dynamo_backend": (None, "use ParallelismConfig(compile='model') or compile='blocks'"),
    "dynamo_plugin": (None, "use ParallelismConfig(compile='model') or compile='blocks'"),
}
# DataLoaderConfiguration fields Accelerate once took as Accelerator keywords; ndparallel still does.
DATA_SHORTHANDS = ("split_batches", "even_batches", "use_seedable_sampler", "dispatch_batches", "data_seed")


def check_accelerate_options(options: Mapping[str, Any]) -> None:
    """Refuse Accelerate keywords that are not at their default (named, with the fix); unknown ones: TypeError."""
    for key, value in options.items():
        if key not in ACCELERATE_DEFAULTS:
            raise TypeError(f"Accelerator() got an unexpected keyword argument {key!r}")
        default, fix = ACCELERATE_DEFAULTS[key]
        if not (value is default or (default is not None and value == default and type(value) is type(default))):
            raise ConfigError(f"Accelerator({key}={value!r}) is not supported by ndparallel: {fix}")


def data_configuration(
    config: DataLoaderConfiguration | None, shorthands: Mapping[str, Any]
) -> DataLoaderConfiguration:
    """The loaders' settings: ``dataloader_config`` with the keyword shorthands applied; refused fields raise."""
    resolved = dataclasses.replace(config) if config is not None else DataLoaderConfiguration()
    for name, value in shorthands.items():
        if config is not None and getattr(config, name) != value:
            raise ConfigError(f"Accelerator({name}={value!r}) and dataloader_config.{name} disagree; set one of them")
        setattr(resolved, name, value)
    check_fields(resolved, DataLoaderConfiguration.REFUSED)
    return resolved


def project_configuration(config: ProjectConfiguration | None, project_dir: Any) -> ProjectConfiguration:
    config = config if config is not None else ProjectConfiguration()
    if project_dir is not None:
        config.set_directories(str(project_dir))
    return config


def accumulation_plugin(plugin: GradientAccumulationPlugin | None, steps: Any) -> GradientAccumulationPlugin:
    """One accumulation plugin from ``gradient_accumulation_plugin`` or ``gradient_accumulation_steps`` (or the
    launcher's ACCELERATE_GRADIENT_ACCUMULATION_STEPS), as Accelerate resolves them."""
    if plugin is not None:
        if steps != 1:
            raise ConfigError(
                "pass gradient_accumulation_steps inside GradientAccumulationPlugin(num_steps=...), not both"
            )
        steps = plugin.num_steps
    elif steps == 1 and os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"):
        steps = int(os.environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"])
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ConfigError(f"gradient_accumulation_steps={steps!r} must be an integer >= 1")
    resolved = dataclasses.replace(plugin) if plugin is not None else GradientAccumulationPlugin()
    resolved.num_steps = steps
    return resolved


class Handlers:
    """The ``kwargs_handlers`` an Accelerator was given, one per kind (None where not given)."""

    KINDS = {
        DistributedDataParallelKwargs: "ddp_handler",
        InitProcessGroupKwargs: "init_handler",
        AutocastKwargs: "autocast_handler",
        GradScalerKwargs: "scaler_handler",
        ProfileKwargs: "profile_handler",
    }

    def __init__(self, handlers: Any):
        for attribute in self.KINDS.values():
            setattr(self, attribute, None)
        for handler in handlers or ():
            attribute = self.KINDS.get(type(handler))
            if attribute is None:
                raise ConfigError(
                    f"kwargs_handlers: {type(handler).__name__} is not supported by ndparallel (it takes "
                    f"{', '.join(k.__name__ for k in self.KINDS)})"
                )
            if getattr(self, attribute) is not None:
                raise ConfigError(f"kwargs_handlers: pass one {type(handler).__name__}, not several")
            check_fields(handler, getattr(handler, "REFUSED", {}))
            setattr(self, attribute, handler)


def default_config(launch: LaunchSettings, fsdp: bool) -> ParallelismConfig:
    """The config of ``Accelerator()`` without one: the ``NDP_*`` / ``PARALLELISM_CONFIG_*`` variables, and when
    they set no size, Accelerate's default: data parallel over every rank (FSDP over every rank when launched
    with FSDP or given an ``fsdp_plugin``)."""
    cfg = ParallelismConfig.from_env()
    if all(size == 1 for size in cfg.sizes.values()):
        fill = "dp_shard_size" if (fsdp or launch.fsdp) else "dp_replicate_size"
        cfg = dataclasses.replace(cfg, **{fill: -1})
    return cfg


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


def resolve_config(
    cfg: ParallelismConfig | None,
    launch: LaunchSettings,
    fsdp_plugin: FullyShardedDataParallelPlugin | None,
    ddp_handler: DistributedDataParallelKwargs | None,
    mixed_precision: str | None,
) -> ParallelismConfig:
    """The Accelerator's config: ``cfg`` (else :func:`default_config`) with the launcher's settings, the FSDP
    plugin's, the DDP handler's bucket size and ``mixed_precision`` (else the launcher's) applied; a conflict
    between two of them raises."""
    cfg = cfg or default_config(launch, fsdp_plugin is not None)
    cfg = apply_settings(cfg, {k: v for k, v in launch.settings.items() if k != "mixed_precision"}, "accelerate launch")
    if fsdp_plugin is not None:
        cfg = apply_settings(cfg, fsdp_plugin.settings, "fsdp_plugin")
    if ddp_handler is not None:
        cfg = apply_settings(cfg, {"dp_bucket_mb": float(ddp_handler.bucket_cap_mb)}, "DistributedDataParallelKwargs")
    return merge_mixed_precision(cfg, mixed_precision or launch.settings.get("mixed_precision"))
