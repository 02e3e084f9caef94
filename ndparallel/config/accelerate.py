"""🤗 Accelerate's names on ndparallel's config: ``accelerate config`` YAML files and the read-only
properties of ``accelerate.ParallelismConfig``.

An Accelerate YAML (``distributed_type: FSDP``, ``fsdp_config:``, ``parallelism_config:`` ...) is read key
by key. Every key is in exactly one table below, and anything outside the tables is refused by name:

- ``HONOURED``: becomes an ndparallel field (``mixed_precision``, FSDP activation checkpointing,
  reshard-after-forward, parameter offload, the ``parallelism_config`` sizes).
- ``MATCHED``: describes what ndparallel does anyway (``fsdp_version: 2``, transformer-block wrapping,
  sharded state dicts, ...); any other value is refused with what to write instead.
- ``LAUNCHER``: read by ``accelerate launch``, not by the training process; ``num_processes`` is
  checked against the sizes, the rest map to ``ndparallel launch`` flags (docs/configuration.md).

This module sits in ``config/`` next to ``parallelism.py`` and imports nothing from ndparallel but
``config.dims`` and errors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from ndparallel.config.dims import DATA_PARALLEL_DIMS, SIZE_FIELDS
from ndparallel.errors import ConfigError, brief_repr

__all__ = ["AccelerateNames", "accelerate_settings", "fsdp_plugin_settings", "is_accelerate_file"]

_SECTION = "parallelism_config"


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"accelerate config {key}={brief_repr(value)} must be true or false")
    return value


def _mixed_precision(key: str, value: Any) -> str:
    value = "no" if value is False else value  # YAML 1.1 reads a bare `no` as false
    if value == "fp8":
        raise ConfigError(f"{key}=fp8 is not supported by ndparallel: use bf16 (or fp16 with FSDP)")
    return value  # ParallelismConfig validates the choice and suggests the closest name


def _checkpointing(key: str, value: Any) -> str:
    return "full" if _bool(key, value) else "none"  # Accelerate checkpoints every transformer layer


# Accelerate key (``fsdp_`` keys as inside ``fsdp_config``) -> (ndparallel field, converter).
HONOURED: dict[str, tuple[str, Callable[[str, Any], Any]]] = {
    "mixed_precision": ("mixed_precision", _mixed_precision),
    "fsdp_activation_checkpointing": ("activation_checkpointing", _checkpointing),
    "fsdp_reshard_after_forward": ("reshard_after_forward", _bool),
    "fsdp_offload_params": ("cpu_offload", _bool),
}


def _one_of(*accepted: Any) -> Callable[[Any], bool]:
    # Compared by value and type, so YAML's `1` is not taken for `true` (1 == True in Python).
    return lambda value: any(value == a and type(value) is type(a) for a in accepted)


def _upper_one_of(*accepted: str) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, str) and value.upper() in accepted


def _any(value: Any) -> bool:
    return True


def _empty(value: Any) -> bool:
    return value in (None, [], "", {})


# Accelerate key -> (accepted value test, why / what to write instead when it fails).
MATCHED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "distributed_type": (
        _upper_one_of("FSDP", "MULTI_GPU", "MULTI_CPU", "NO"),
        "ndparallel builds FSDP2/TP/CP/replicate from the parallelism sizes; DeepSpeed, Megatron-LM and XLA "
        "have no ndparallel equivalent: use distributed_type: FSDP",
    ),
    "compute_environment": (_upper_one_of("LOCAL_MACHINE"), "only LOCAL_MACHINE: launch with ndparallel launch"),
    "use_cpu": (_one_of(False), "choose the device with `ndparallel launch --cpu-ranks N` or NDP_DEVICE=cpu"),
    "debug": (_one_of(False), "Accelerate's debug mode has no ndparallel equivalent: set debug: false"),
    "downcast_bf16": (_one_of("no", False), "TPU-only setting: set downcast_bf16: 'no'"),
    "enable_cpu_affinity": (_one_of(False), "set CPU affinity with numactl or your scheduler"),
    "tpu_env": (_empty, "TPU setting: remove it"),
    "tpu_use_cluster": (_one_of(False), "TPU setting: remove it"),
    "tpu_use_sudo": (_one_of(False), "TPU setting: remove it"),
    "fsdp_version": (_one_of(2), "ndparallel shards with FSDP2 only: set fsdp_version: 2"),
    "fsdp_auto_wrap_policy": (
        _upper_one_of("TRANSFORMER_BASED_WRAP"),
        "ndparallel makes every transformer block an FSDP unit (TRANSFORMER_BASED_WRAP); size-based or "
        "no wrapping has no equivalent",
    ),
    "fsdp_transformer_layer_cls_to_wrap": (_any, ""),  # the blocks are found in the model's layer list
    "fsdp_state_dict_type": (
        _upper_one_of("SHARDED_STATE_DICT"),
        "save_state always writes a sharded DCP checkpoint (loadable on any mesh); for full weights call "
        "accelerator.save_model(model, dir) or ndparallel.hf.save_pretrained",
    ),
    "fsdp_cpu_ram_efficient_loading": (
        _one_of(False),
        "load weights with ndparallel.hf.load_pretrained (meta-device init, each rank reads only its shards)",
    ),
    "fsdp_sync_module_states": (
        _one_of(False),
        "ndparallel does not broadcast rank 0's weights: build the model from one seed on every rank "
        "(set_seed) or load it with ndparallel.hf.load_pretrained",
    ),
    "fsdp_use_orig_params": (_one_of(True), "FSDP2 always keeps the original parameters: set it to true"),
    "fsdp_forward_prefetch": (_one_of(False), "FSDP2 prefetches on its own: set it to false"),
    "fsdp_mixed_precision_policy": (_empty, "set it with mixed_precision (Accelerator(mixed_precision='bf16'))"),
}

# Read by `accelerate launch`; the training process gets them from its launcher (docs/configuration.md).
LAUNCHER = (
    "num_processes",
    "num_machines",
    "machine_rank",
    "gpu_ids",
    "main_process_ip",
    "main_process_port",
    "rdzv_backend",
    "same_network",
    "main_training_function",
)

# Top-level keys that mark a mapping as an Accelerate config file.
_MARKERS = ("compute_environment", "distributed_type", "fsdp_config", "num_processes", "machine_rank")


def is_accelerate_file(data: Mapping[str, Any]) -> bool:
    """True for a mapping written by ``accelerate config`` (it has Accelerate's top-level keys)."""
    return any(key in data for key in _MARKERS)


def _translate(key: str, value: Any, settings: dict[str, Any], shown: str, top_level: bool) -> None:
    """Apply one Accelerate key to ``settings``; ``shown`` is how the error names it."""
    if key in HONOURED:
        field, convert = HONOURED[key]
        settings[field] = convert(shown, value)
    elif key in MATCHED:
        accepted, fix = MATCHED[key]
        if not accepted(value):
            raise ConfigError(f"{shown}={brief_repr(value)} is not supported: {fix}")
    elif not (top_level and key in LAUNCHER):
        raise ConfigError(
            f"{shown} has no ndparallel meaning; remove it (docs/configuration.md lists every accepted Accelerate key)"
        )


def accelerate_settings(data: Mapping[str, Any]) -> dict[str, Any]:
    """The ``ParallelismConfig`` settings of an Accelerate config mapping (``parallelism_config_*`` names kept
    for ``ParallelismConfig.from_dict`` to map); raises ConfigError on a key it cannot honour."""
    settings: dict[str, Any] = {}
    for key, value in data.items():
        if key == _SECTION:
            if value is not None and not isinstance(value, Mapping):
                raise ConfigError(f"accelerate config parallelism_config must be a mapping, got {brief_repr(value)}")
            settings.update(value or {})
        elif key == "fsdp_config":
            if value is not None and not isinstance(value, Mapping):
                raise ConfigError(f"accelerate config fsdp_config must be a mapping, got {brief_repr(value)}")
            for inner, inner_value in (value or {}).items():
                _translate(str(inner), inner_value, settings, f"accelerate config fsdp_config.{inner}", False)
        else:
            _translate(str(key), value, settings, f"accelerate config {key}", True)
    settings.update(_default_sizes(data.get("distributed_type"), settings))
    _check_num_processes(data.get("num_processes"), settings)
    return settings


def _default_sizes(distributed_type: Any, settings: Mapping[str, Any]) -> dict[str, int]:
    """Accelerate's mesh when the file sets no size: data parallel over every process (MULTI_CPU / MULTI_GPU),
    or FSDP over every process (FSDP), as its ``Accelerator()`` then does."""
    if any(key.endswith("_size") for key in settings) or not isinstance(distributed_type, str):
        return {}
    kind = distributed_type.upper()
    if kind == "FSDP":
        return {"dp_shard_size": -1}
    return {"dp_replicate_size": -1} if kind.startswith("MULTI_") else {}


def _check_num_processes(num_processes: Any, settings: Mapping[str, Any]) -> None:
    """``num_processes`` (Accelerate's total over machines; -1 = unset) must fit the parallelism sizes."""
    if num_processes is None or num_processes == -1:
        return
    if not isinstance(num_processes, int) or isinstance(num_processes, bool) or num_processes < 1:
        raise ConfigError(f"accelerate config num_processes={brief_repr(num_processes)} must be a positive integer")
    sizes = []
    for name in SIZE_FIELDS:
        value = settings.get(f"parallelism_config_{name}", settings.get(name, 1))
        sizes.append(value if isinstance(value, int) else 1)  # ParallelismConfig reports wrong types itself
    fixed = math.prod(s for s in sizes if s != -1)
    fits = num_processes % fixed == 0 if -1 in sizes else fixed == num_processes
    if not fits:
        raise ConfigError(
            f"accelerate config num_processes={num_processes} does not match the parallelism_config sizes "
            f"(they multiply to {fixed}{' with one -1' if -1 in sizes else ''}); make them agree"
        )


def fsdp_plugin_settings(options: Mapping[str, Any]) -> dict[str, Any]:
    """ParallelismConfig settings of ``FullyShardedDataParallelPlugin(**options)`` (Accelerate's keyword names:
    the YAML's ``fsdp_config`` keys without the ``fsdp_`` prefix; ``cpu_offload`` is ``offload_params``)."""
    renamed = {"cpu_offload": "offload_params", "transformer_cls_names_to_wrap": "transformer_layer_cls_to_wrap"}
    settings: dict[str, Any] = {}
    for key, value in options.items():
        name = key if key.startswith("fsdp_") else f"fsdp_{renamed.get(key, key)}"
        _translate(name, value, settings, f"FullyShardedDataParallelPlugin: {key}", False)
    return settings


class AccelerateNames:
    """Read-only properties of ``accelerate.ParallelismConfig``, mixed into ndparallel's ``ParallelismConfig``.

    Dims are listed when enabled (size > 1), in Accelerate's order. A size of -1 is unknown until
    ``resolve(world_size)``: the properties raise then (``Accelerator.parallelism_config`` is resolved).
    """

    def _size(self, dim: str) -> int:
        size = getattr(self, f"{dim}_size")
        if size == -1:
            raise ConfigError(f"{dim}_size=-1 is not resolved yet: use cfg.resolve(world_size) first")
        return size

    def _enabled(self, *dims: str) -> list[str]:
        return [d for d in dims if self._size(d) > 1]

    @property
    def dp_replicate_enabled(self) -> bool:
        return self._size("dp_replicate") > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self._size("dp_shard") > 1

    @property
    def tp_enabled(self) -> bool:
        return self._size("tp") > 1

    @property
    def cp_enabled(self) -> bool:
        return self._size("cp") > 1

    @property
    def dp_dim_names(self) -> list[str]:
        """Enabled dims that get different batches."""
        return self._enabled("dp_replicate", "dp_shard")

    @property
    def non_dp_dim_names(self) -> list[str]:
        """Enabled dims whose ranks get the same batch."""
        return self._enabled("tp", "cp")

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """Enabled dims FSDP shards over."""
        return self._enabled("dp_shard", "cp")

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """Enabled dims the loss is averaged over (``mesh["dp_cp"]``)."""
        return self._enabled("dp_replicate", "dp_shard", "cp")

    @property
    def fsdp_dim_names(self) -> list[str]:
        return [*self._enabled("dp_replicate"), "dp_shard_cp"]

    @property
    def total_size(self) -> int:
        return math.prod(self._size(d) for d in ("pp", "dp_replicate", "dp_shard", "cp", "tp"))

    @property
    def data_parallel_size(self) -> int:
        """dp_replicate x dp_shard (``config.dims.DATA_PARALLEL_DIMS``): how many batches at once."""
        return math.prod(self._size(d) for d in DATA_PARALLEL_DIMS)

    @property
    def non_data_parallel_size(self) -> int:
        """tp x cp: how many ranks share one batch."""
        return self._size("tp") * self._size("cp")
