"""The variables ``accelerate launch`` sets for its processes (``ACCELERATE_*``, ``FSDP_*``), read as Accelerate
reads them: the device, mixed precision, accumulation, FSDP over every rank and its ``FSDP_*`` keys; what
ndparallel cannot honour is refused by name. The variable names and values are those accelerate 1.16's
``accelerate/utils/launch.py`` writes."""

from __future__ import annotations

import pytest

import ndparallel as ndp
from ndparallel.accelerator.options import default_config
from ndparallel.config.accelerate_env import accelerate_launch_settings
from ndparallel.errors import ConfigError

# What `accelerate launch --use_fsdp --fsdp_version 2 --mixed_precision bf16 ...` exports (multi-GPU launcher).
FSDP_LAUNCH = {
    "ACCELERATE_MIXED_PRECISION": "bf16",
    "ACCELERATE_DYNAMO_BACKEND": "NO",
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
    "FSDP_RESHARD_AFTER_FORWARD": "false",
    "FSDP_OFFLOAD_PARAMS": "false",
    "FSDP_MIN_NUM_PARAMS": "100000000",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_BACKWARD_PREFETCH": "BACKWARD_PRE",
    "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
    "FSDP_FORWARD_PREFETCH": "false",
    "FSDP_USE_ORIG_PARAMS": "true",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
    "FSDP_SYNC_MODULE_STATES": "false",
    "FSDP_ACTIVATION_CHECKPOINTING": "true",
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "false",
}


def test_an_fsdp_launch_shards_over_every_rank_with_its_settings():
    launch = accelerate_launch_settings(FSDP_LAUNCH)
    assert launch.fsdp and not launch.cpu and not launch.sync_module_states
    assert accelerate_launch_settings({**FSDP_LAUNCH, "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}).sync_module_states
    assert launch.settings == {"mixed_precision": "bf16", "reshard_after_forward": False, "cpu_offload": False,
                               "activation_checkpointing": "full"}  # fmt: skip
    cfg = default_config(launch, fsdp=False).resolve(4)
    assert cfg.sizes == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 1}


def test_a_cpu_launch_is_data_parallel_over_every_rank():
    launch = accelerate_launch_settings({"ACCELERATE_USE_CPU": "True", "ACCELERATE_MIXED_PRECISION": "no"})
    assert launch.cpu and not launch.fsdp and launch.settings == {"mixed_precision": "no"}
    assert default_config(launch, fsdp=False).resolve(3).dp_replicate_size == 3
    assert default_config(launch, fsdp=True).resolve(3).dp_shard_size == 3  # Accelerator(fsdp_plugin=...)
    assert default_config(accelerate_launch_settings({}), fsdp=False).resolve(1).world_size == 1


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"FSDP_VERSION": "1"}, "FSDP_VERSION=1 is not supported: ndparallel shards with FSDP2 only"),
        ({"FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"}, "FSDP_STATE_DICT_TYPE='FULL_STATE_DICT' is not supported"),
        ({"FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "true"}, "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD=true"),
        ({"FSDP_IGNORED_MODULES": "lm_head"}, "FSDP_IGNORED_MODULES is not supported"),
        ({"FSDP_OFFLOAD_PARAMS": "maybe"}, "FSDP_OFFLOAD_PARAMS='maybe' must be true or false"),
        ({"ACCELERATE_MIXED_PRECISION": "fp8"}, "fp8 is not supported"),
        ({"ACCELERATE_USE_DEEPSPEED": "true"}, "ACCELERATE_USE_DEEPSPEED=true is not supported by ndparallel"),
        ({"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}, "ACCELERATE_DYNAMO_BACKEND=INDUCTOR is not supported"),
        ({"ACCELERATE_DEBUG_MODE": "true"}, "debug"),
    ],
)
def test_launch_variables_ndparallel_cannot_honour_are_refused_by_name(changes, message):
    with pytest.raises(ConfigError, match=message):
        accelerate_launch_settings({**FSDP_LAUNCH, **changes})


def test_the_accelerator_reads_the_launch_variables(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    try:
        acc = ndp.Accelerator()
        assert (acc.mixed_precision, acc.gradient_accumulation_steps, acc.device.type) == ("bf16", 4, "cpu")
        assert str(acc.distributed_type) == "DistributedType.NO"
    finally:
        ndp.destroy_distributed()
