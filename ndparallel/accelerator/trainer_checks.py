"""What the Trainer on ndparallel refuses, by name, before the first step (at ``Trainer(...)``): arguments this
engine does not run, and losses or metrics that under tp or cp would see one rank's shard of the batch.

Under tp a rank holds a vocabulary shard of the logits, under cp a sequence shard of every row. The losses that
know this are the model's own (``labels=``, ndparallel/models/hf/loss.py), transformers' ``Trainer.compute_loss``
around it, and TRL's ``SFTTrainer.compute_loss`` (its fused LM head, adapted in
:mod:`ndparallel.accelerator.trl_adapter`). Anything else that computes a loss or metric from the outputs (a
``compute_loss_func``, label smoothing, a ``compute_loss`` override, ``compute_metrics`` under cp) would train or
report something else than one process: refused. docs/accelerate-migration.md#the-transformers-trainer.
"""

from __future__ import annotations

from typing import Any

from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.errors import ConfigError

__all__ = ["loss_owners", "refuse_shard_blind_losses", "refuse_unsupported_arguments"]

# (module prefix, class name) of the compute_loss implementations that are exact under tp/cp with ndparallel
_SHARD_AWARE_LOSSES = {("transformers.trainer", "Trainer"), ("trl.trainer.sft_trainer", "SFTTrainer")}
_MIXIN = ("ndparallel.accelerator.trainer", "NDParallelTrainerMixin")


def refuse_unsupported_arguments(args: Any, config: ParallelismConfig, world_size: int) -> None:
    """One-line refusals of Trainer arguments this engine does not run or that would train something else."""
    if getattr(args, "deepspeed", None):
        raise ConfigError("deepspeed= is not ndparallel's engine: drop it; shard with parallelism_config instead")
    if getattr(args, "fsdp", None) or getattr(args, "fsdp_config", None) not in (None, {}):
        raise ConfigError(
            "fsdp= / fsdp_config= configure Accelerate's FSDP, which ndparallel replaces: drop them and set "
            "parallelism_config=ParallelismConfig(dp_shard_size=...) (FSDP2 per block)"
        )
    if getattr(args, "parallelism_config", None) is not None:
        raise ConfigError(
            "TrainingArguments(parallelism_config=...) is Accelerate's: pass ndparallel's ParallelismConfig to the "
            "Trainer itself (Trainer(..., parallelism_config=cfg))"
        )
    if getattr(args, "torch_compile", False):
        raise ConfigError(
            "torch_compile=True is not routed through ndparallel: set parallelism_config compile='blocks'"
        )
    if world_size > 1 and not getattr(args, "average_tokens_across_devices", True):
        raise ConfigError(
            "average_tokens_across_devices=False divides each rank's loss by its own tokens, so the gradient "
            "differs from one process's: keep the default (True)"
        )


def loss_owners(trainer_type: type) -> list[type]:
    """The classes of ``trainer_type``'s MRO whose own ``compute_loss`` runs (ndparallel's mixin aside) and that
    ndparallel does not know to be exact under tp/cp."""
    owners = []
    for cls in trainer_type.__mro__:
        if "compute_loss" not in vars(cls) or (cls.__module__, cls.__qualname__) == _MIXIN:
            continue
        if (cls.__module__, cls.__qualname__) not in _SHARD_AWARE_LOSSES:
            owners.append(cls)
    return owners


def _mesh(config: ParallelismConfig) -> str:
    sizes = {"tp_size": config.tp_size, "cp_size": config.cp_size, "pp_size": config.pp_size}
    return ", ".join(f"{name}={size}" for name, size in sizes.items() if size > 1)


def refuse_shard_blind_losses(trainer: Any, config: ParallelismConfig) -> None:
    """Under tp, cp or pp: a loss or metric computed from one rank's shard of the logits (or, under pp, from
    logits that never leave the last stage), refused at ``Trainer(...)``."""
    if config.tp_size == 1 and config.cp_size == 1 and config.pp_size == 1:
        return
    mesh = _mesh(config)
    sees = "this rank's shard of the logits (the vocabulary under tp, the sequence under cp; under pp no logits)"
    if getattr(trainer, "compute_loss_func", None) is not None:
        raise ConfigError(
            f"compute_loss_func under {mesh} would see {sees}, not the batch's: use the model's own loss (labels=), "
            "or tp_size=cp_size=pp_size=1"
        )
    if getattr(trainer.args, "label_smoothing_factor", 0):
        raise ConfigError(
            f"label_smoothing_factor={trainer.args.label_smoothing_factor} under {mesh}: the Trainer's label smoother "
            f"would see {sees}; set it to 0, or use tp_size=cp_size=pp_size=1"
        )
    owners = loss_owners(type(trainer))
    if owners:
        name = f"{owners[0].__module__}.{owners[0].__qualname__}"
        raise ConfigError(
            f"{name}.compute_loss under {mesh} computes the loss outside ndparallel's sharded loss and would see "
            f"{sees}, so its loss and token counts are not the batch's; put the loss in the model (labels=, "
            "loss_function) or train this trainer with tp_size=cp_size=pp_size=1 (dp_shard / HSDP)"
        )
    if config.cp_size > 1 and getattr(trainer, "compute_metrics", None) is not None:
        raise ConfigError(
            "compute_metrics under cp_size > 1 would see one cp rank's shard of each sequence's predictions: "
            "evaluate the loss only (compute_metrics=None), or evaluate with cp_size=1"
        )
