"""The variables ``accelerate launch`` sets for its processes (``ACCELERATE_*``, ``FSDP_*``), read as ndparallel
settings, so a script it starts with ndparallel's Accelerator does what Accelerate's would.

``ACCELERATE_USE_FSDP=true`` shards over every rank (``dp_shard_size=-1``); without it the ranks are plain data
parallel (``dp_replicate_size=-1``). ``FSDP_*`` keys go through the same tables as the YAML's ``fsdp_config``
(ndparallel/config/accelerate.py): honoured, matched, or refused by name; ``FSDP_SYNC_MODULE_STATES`` and
``FSDP_CPU_RAM_EFFICIENT_LOADING`` (true by default in ``accelerate launch``) make every rank start from rank
0's weights, as Accelerate's FSDP2 preparation does. DeepSpeed, Megatron-LM and compile
settings are refused with the ndparallel setting to use instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ndparallel.config.accelerate import HONOURED, MATCHED, _translate
from ndparallel.errors import ConfigError

__all__ = ["LaunchSettings", "accelerate_launch_settings"]

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no", "")

# FSDP_<NAME> variable -> the fsdp_config key it carries (accelerate/utils/launch.py writes them).
_FSDP_KEYS = {
    "FSDP_VERSION": "fsdp_version",
    "FSDP_RESHARD_AFTER_FORWARD": "fsdp_reshard_after_forward",
    "FSDP_OFFLOAD_PARAMS": "fsdp_offload_params",
    "FSDP_ACTIVATION_CHECKPOINTING": "fsdp_activation_checkpointing",
    "FSDP_AUTO_WRAP_POLICY": "fsdp_auto_wrap_policy",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "fsdp_transformer_layer_cls_to_wrap",
    "FSDP_STATE_DICT_TYPE": "fsdp_state_dict_type",
    "FSDP_USE_ORIG_PARAMS": "fsdp_use_orig_params",
    "FSDP_FORWARD_PREFETCH": "fsdp_forward_prefetch",
}
# Not read: FSDP_MIN_NUM_PARAMS, FSDP_BACKWARD_PREFETCH and FSDP_SHARDING_STRATEGY, set by the launcher whatever
# the config says (size-based wrapping and FSDP1's strategies; FSDP2 prefetches on its own).
_FSDP_FALSE_ONLY = {
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "offloading checkpointed activations has no ndparallel equivalent",
}
# ACCELERATE_USE_<X>=true -> why it is refused.
_REFUSED_ENGINES = {
    "ACCELERATE_USE_DEEPSPEED": "DeepSpeed has no ndparallel equivalent: shard with distributed_type: FSDP",
    "ACCELERATE_USE_MEGATRON_LM": "use ParallelismConfig(tp_size=..., pp_size=...) instead of Megatron-LM",
    "ACCELERATE_USE_XPU": "ndparallel runs on CPU and CUDA",
    "ACCELERATE_DEBUG_MODE": "Accelerate's debug checks have no ndparallel equivalent: launch without --debug",
}


def _flag(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r} must be true or false")


def _typed(key: str, value: str) -> Any:
    """An environment string as the YAML would have held it (booleans, integers, else the string)."""
    lowered = value.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered.lstrip("-").isdigit():
        return int(lowered)
    return value


# Accelerate's FSDP2 takes rank 0's weights on every rank when either is true (its defaults): the Accelerator does.
SYNC_FROM_RANK0 = ("FSDP_SYNC_MODULE_STATES", "FSDP_CPU_RAM_EFFICIENT_LOADING")


class LaunchSettings:
    """What the launcher's variables ask for: ParallelismConfig ``settings``, ``cpu``, ``fsdp``, and whether every
    rank starts from rank 0's weights (``sync_module_states``)."""

    def __init__(self, settings: dict[str, Any], cpu: bool, fsdp: bool, sync_module_states: bool = False):
        self.settings, self.cpu, self.fsdp = settings, cpu, fsdp
        self.sync_module_states = sync_module_states


def accelerate_launch_settings(environ: Mapping[str, str] | None = None) -> LaunchSettings:
    """Read ``ACCELERATE_*`` / ``FSDP_*`` variables (default ``os.environ``); raises ConfigError on one that
    ndparallel cannot honour."""
    env = os.environ if environ is None else environ
    for name, why in _REFUSED_ENGINES.items():
        if name in env and _flag(name, env[name]):
            raise ConfigError(f"{name}=true is not supported by ndparallel: {why}")
    backend = env.get("ACCELERATE_DYNAMO_BACKEND", "no").strip().upper()
    if backend not in ("NO", ""):
        raise ConfigError(
            f"ACCELERATE_DYNAMO_BACKEND={backend} is not supported: compile with ParallelismConfig(compile='model') "
            "or compile='blocks' (launch with --dynamo_backend no)"
        )
    settings: dict[str, Any] = {}
    if env.get("ACCELERATE_MIXED_PRECISION"):
        _translate("mixed_precision", env["ACCELERATE_MIXED_PRECISION"], settings, "ACCELERATE_MIXED_PRECISION", False)
    fsdp = "ACCELERATE_USE_FSDP" in env and _flag("ACCELERATE_USE_FSDP", env["ACCELERATE_USE_FSDP"])
    sync = False
    if fsdp:
        _read_fsdp(env, settings)
        sync = any(name in env and _flag(name, env[name]) for name in SYNC_FROM_RANK0)
    cpu = "ACCELERATE_USE_CPU" in env and _flag("ACCELERATE_USE_CPU", env["ACCELERATE_USE_CPU"])
    return LaunchSettings(settings, cpu, fsdp, sync)


def _read_fsdp(env: Mapping[str, str], settings: dict[str, Any]) -> None:
    for name, key in _FSDP_KEYS.items():
        if name in env:
            assert key in HONOURED or key in MATCHED, key
            _translate(key, _typed(key, env[name]), settings, name, False)
    for name, why in _FSDP_FALSE_ONLY.items():
        if name in env and _flag(name, env[name]):
            raise ConfigError(f"{name}=true is not supported by ndparallel: {why}")
    if env.get("FSDP_IGNORED_MODULES"):
        raise ConfigError(
            "FSDP_IGNORED_MODULES is not supported by ndparallel: every parameter is sharded; freeze modules with "
            "requires_grad_(False) instead"
        )
