"""``build_pipeline(model, cfg, mesh)``: the one entry point that turns a whole model into this rank's stages."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.config.pipeline import check_microbatches, stages_per_rank
from ndparallel.config.precision import forward_autocast_dtype, parallelize_config
from ndparallel.distributed.mesh import Mesh
from ndparallel.distributed.process import init_distributed
from ndparallel.errors import ConfigError
from ndparallel.parallel.loss import cross_entropy_loss
from ndparallel.parallel.pipeline.aux_loss import AuxLossRecord, attach_auxiliary_losses
from ndparallel.parallel.pipeline.placement import last_stage_rank, stage_ids
from ndparallel.parallel.pipeline.runtime import Pipeline
from ndparallel.parallel.pipeline.split import stage_ranges
from ndparallel.parallel.pipeline.stages import build_stage_modules
from ndparallel.parallel.pipeline.tied import tied_copies
from ndparallel.parallel.pipeline.torch_api import make_schedule, make_stage
from ndparallel.parallel.protocol import FamilyProtocol, family_for

__all__ = ["build_pipeline"]

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ParallelismConfig)}


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _ranges(model, family, n_stages: int, explicit, first_part: nn.Module, last_part: nn.Module) -> list[range]:
    blocks = family.blocks(model)
    return stage_ranges([_numel(b) for b in blocks], n_stages, explicit, _numel(first_part), _numel(last_part))


def _check_untested(family: FamilyProtocol, cfg: ParallelismConfig) -> None:
    """Refuse a ``family.pipeline_untested`` field set away from its default (a ``cp_*`` field counts only
    when cp_size > 1): its stages were never proved against one process with it."""
    for field in family.pipeline_untested:
        value, default = getattr(cfg, field), _DEFAULTS[field]
        if value != default and not (field.startswith("cp_") and cfg.cp_size == 1):
            raise ConfigError(
                f"{field}={value!r} is untested for pp_size > 1 with a {family.label}, so refused: "
                f"set {field}={default!r} or use pp_size=1"
            )


def _autocast_forward(module: nn.Module, dtype: torch.dtype, device_type: str) -> None:
    """Run ``module``'s forward under ``torch.autocast(dtype)``: torch's schedule calls the stage (and its shape
    inference) through ``module.__call__``, so this reaches every micro-batch's forward and only it: the loss
    (fp32, outside the stage) and the backward (replaying the recorded casts) run outside autocast, as in
    :class:`ndparallel.train.TrainStep`."""
    module.forward = torch.autocast(device_type, dtype=dtype)(module.forward)


def build_pipeline(
    model,
    cfg: ParallelismConfig | None = None,
    mesh: Mesh | None = None,
    *,
    microbatches: int | None = None,
    seed: int | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> Pipeline:
    """This rank's stages of ``model`` (best built on the meta device), parallelised, and torch's schedule.

    ``cfg``/``mesh`` as for :func:`ndparallel.parallelize` (``pp_size > 1``). Micro-batches: ``microbatches``,
    else ``cfg.pp_microbatches``, else the number of stages. ``seed``: the weight-init seed of a meta model
    (default its config's). ``loss_fn(output, target)``: each micro-batch's loss on the last stage (default
    :func:`ndparallel.cross_entropy_loss`, the micro-batch mean; torch divides gradients by the micro-batch
    count). Blocks: ``cfg.pp_split``, else balanced by parameter count (the first stage also
    holds the embedding, the last the final norm and output).

    ``cfg.mixed_precision`` follows the training step's rule
    (:func:`ndparallel.config.precision.forward_autocast_dtype`,
    docs/pipeline-parallel.md): with FSDP its policy casts each stage; without, every stage forward autocasts
    to bf16 (fp16 without FSDP raises :class:`ConfigError`).
    """
    mesh = mesh or init_distributed(cfg or ParallelismConfig())
    cfg = (cfg or mesh.config).resolve(mesh.size())
    if cfg.sizes != mesh.config.sizes:
        raise ConfigError(f"cfg sizes ({cfg.describe()}) differ from the mesh's ({mesh.config.describe()})")
    if cfg.pp_size == 1:
        raise ConfigError("build_pipeline needs pp_size > 1; with pp_size=1 use ndparallel.parallelize")
    per_rank = stages_per_rank(cfg.pp_schedule, cfg.pp_stages_per_rank)
    n_stages = cfg.pp_size * per_rank
    m = microbatches or cfg.pp_microbatches or n_stages
    check_microbatches(cfg.pp_schedule, m, cfg.pp_size, per_rank, "pp_microbatches")
    family = family_for(model)
    if cfg.cp_size > 1 and not family.pipeline_cp:
        raise ConfigError(f"pp_size > 1 with cp_size > 1 is not supported for model family {family.name!r} yet")
    _check_untested(family, cfg)
    autocast = forward_autocast_dtype(cfg)
    # what the first and the last stage hold besides their blocks (the embedding; the norm and head)
    first_part, last_part = family.pipeline_stage(model, [], True, False), family.pipeline_stage(model, [], False, True)
    ranges = _ranges(model, family, n_stages, cfg.pp_split, first_part, last_part)
    ids = stage_ids(mesh.local_rank("pp"), cfg.pp_size, per_rank, cfg.pp_schedule)
    modules = build_stage_modules(model, family, ranges, ids, parallelize_config(cfg), mesh, seed)
    if autocast is not None:
        for module in modules:
            _autocast_forward(module, autocast, mesh.device.type)
    aux_losses = AuxLossRecord() if family.moe_layers(model) else None  # the whole model's: alike on every rank
    if aux_losses is not None:
        for module in modules:
            attach_auxiliary_losses(module, aux_losses)
    group = mesh["pp"].get_group()
    stages = [make_stage(mod, sid, n_stages, mesh.device, group) for mod, sid in zip(modules, ids, strict=True)]
    schedule = make_schedule(cfg.pp_schedule, stages, m, loss_fn or cross_entropy_loss)
    positions_arg = getattr(modules[0], "positions_arg", "positions")
    last = last_stage_rank(cfg.pp_size, per_rank, cfg.pp_schedule)
    tied = tied_copies(first_part, last_part, modules, group, last)
    return Pipeline(modules, ids, schedule, mesh, m, last, positions_arg, tied, cfg.pp_schedule, aux_losses)
