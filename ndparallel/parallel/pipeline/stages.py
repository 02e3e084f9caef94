"""This rank's stage modules: cut from the whole model by its family, materialised, initialised, parallelised.

A stage shares its submodules with ``model`` (nothing is copied). With ``model`` on the meta device a rank
allocates only its own stages (``to_empty`` on the stage, then the stage's ``init_weights``, which gives
the values the whole model would get); a materialised ``model`` lends its weights. Each stage is then
handed to :func:`ndparallel.parallelize` with the config and mesh of one pp slice, the family's TP table and
FSDP units filtered to what the stage holds, and ``reshard_after_forward=False`` (under torch's
zero-bubble schedules FSDP's re-gather after forward loses or corrupts gradients: docs/pipeline-parallel.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.distributed.mesh import Mesh
from ndparallel.errors import ConfigError
from ndparallel.parallel.fqn import matching_modules
from ndparallel.parallel.parallelize import parallelize
from ndparallel.parallel.protocol import FamilyProtocol

__all__ = ["build_stage_modules", "stage_config", "stage_fsdp_groups", "stage_tp_plan"]


def stage_config(cfg: ParallelismConfig) -> ParallelismConfig:
    """The config each stage is parallelised with: one pp slice, FSDP keeping parameters gathered after forward."""
    return dataclasses.replace(cfg, pp_size=1, reshard_after_forward=False)


def stage_tp_plan(tp_plan: Mapping | None, stage: nn.Module) -> dict | None:
    """The rows of a TP table that match some module of ``stage`` (``apply_tensor_parallel`` refuses the rest)."""
    if tp_plan is None:
        return None
    return {pattern: style for pattern, style in tp_plan.items() if next(matching_modules(stage, pattern), None)}


def stage_fsdp_groups(groups: Sequence[Sequence[str]], stage: nn.Module) -> list[list[str]]:
    """The family's FSDP units, each reduced to the modules ``stage`` has (empty units dropped)."""
    names = {name for name, _ in stage.named_modules()}
    kept = [[fqn for fqn in group if fqn in names] for group in groups]
    return [group for group in kept if group]


def _materialise(stage: nn.Module, on_meta: bool, device: torch.device, seed: int | None) -> None:
    if not on_meta:
        # Only when something is elsewhere: a stage already on its device (a dry run's fake tensors, which
        # nn.Module.to would try to swap) is left as it is.
        if any(t.device != device for t in (*stage.parameters(), *stage.buffers())):
            stage.to(device)
        return
    init = getattr(stage, "init_weights", None)
    if init is None:
        raise ConfigError(
            f"{type(stage).__name__} has no init_weights, so a model built on the meta device cannot be initialised "
            "stage by stage: build the model with its weights (every rank) before build_pipeline"
        )
    stage.to_empty(device=device)
    init(seed)


def build_stage_modules(
    model: nn.Module,
    family: FamilyProtocol,
    ranges: Sequence[range],
    ids: Sequence[int],
    cfg: ParallelismConfig,
    mesh: Mesh,
    seed: int | None = None,
) -> list[nn.Module]:
    """The modules of stages ``ids`` (block ``ranges`` of every stage), ready for ``PipelineStage``."""
    inner_cfg, inner_mesh = stage_config(cfg), mesh.without_pp()
    on_meta = any(p.is_meta for p in model.parameters())
    tp_plan = family.tp_plan(model) if inner_mesh.size("tp") > 1 else None
    if inner_mesh.size("tp") > 1 and tp_plan is None:
        raise ConfigError(f"tp_size > 1 but model family {family.name!r} has no tensor-parallel table for pp stages")
    groups = family.fsdp_groups(model)
    modules = []
    for sid in ids:
        stage = family.pipeline_stage(model, ranges[sid], sid == 0, sid == len(ranges) - 1)
        _materialise(stage, on_meta, mesh.device, seed)
        blocks = family.stage_blocks(stage)
        parallelize(
            stage,
            inner_cfg,
            mesh=inner_mesh,
            tp_plan=stage_tp_plan(tp_plan, stage),
            blocks=blocks,
            fsdp_groups=stage_fsdp_groups(groups, stage),
        )
        modules.append(stage)
    return modules
