"""The dry run of a job: the ranks that differ, each measured by the engine, one after another in this process.

Which ranks differ: every pipeline coordinate (each holds other stages: the first the embedding, the last the
head), all with every other coordinate 0; and, where FSDP's shards are uneven (a dimension that the shard
group does not divide: torch gives the last ranks smaller or empty shards), also the last shard rank of each
pipeline coordinate. Ranks of one pp coordinate otherwise hold alike-sized shards, run alike-sized
micro-batches and send alike; expert-parallel ranks too, as routing is taken to be balanced (a named limit).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from torch import nn

from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.dryrun.engine import check_job, measure_rank
from ndparallel.dryrun.fake_world import MAX_WORLD, as_rank
from ndparallel.dryrun.models import dry_run_model
from ndparallel.dryrun.report import DryRunReport
from ndparallel.dryrun.stage_metadata import StageMailbox
from ndparallel.errors import ConfigError
from ndparallel.train.job_config import TrainConfig

__all__ = ["dry_run", "first_ranks", "last_shard_rank"]


def first_ranks(cfg: ParallelismConfig) -> list[int]:
    """The rank with every coordinate 0 but pp, for each pp coordinate (``cfg`` resolved)."""
    inner = cfg.world_size // cfg.pp_size
    return [p * inner for p in range(cfg.pp_size)]


def last_shard_rank(cfg: ParallelismConfig, pp: int) -> int:
    """The rank of pp coordinate ``pp`` whose dp_shard and cp are the last (the smallest FSDP shards)."""
    inner = cfg.world_size // cfg.pp_size
    offset = ((cfg.dp_shard_size - 1) * cfg.cp_size + cfg.cp_size - 1) * cfg.tp_size
    return pp * inner + offset


def dry_run(
    cfg: TrainConfig,
    world: int,
    *,
    model: str | None = None,
    gpu_memory: float | None = None,
    steps: int = 1,
    progress: Callable[[str], None] | None = None,
) -> DryRunReport:
    """Dry-run ``cfg`` on ``world`` ranks: the same pre-flight as the real job, then each rank that differs.
    ``model``: a preset, a Hugging Face config.json or folder, or ``module:factory`` (default: the job's)."""
    if not 1 <= world <= MAX_WORLD:
        raise ConfigError(f"--world {world}: a dry run takes 1 to {MAX_WORLD:,} ranks")
    if steps < 1:
        raise ConfigError(f"--steps {steps} must be >= 1 (the last one is measured)")
    cfg, built = dry_run_model(cfg, model)
    resolved = cfg.parallelism.resolve(world)  # a world the mesh does not divide: the config's own error
    check_job(cfg, resolved, built)  # and every rule the real job checks before it starts
    built = dataclasses.replace(built, build=_guarded(built.build, built.name))
    start = time.perf_counter()
    report = DryRunReport(world, resolved.describe(), built.name, gpu_memory=gpu_memory)
    mailbox = StageMailbox()
    for pp in range(resolved.pp_size):
        ranks = [first_ranks(resolved)[pp]]
        while ranks:
            rank = ranks.pop(0)
            if progress:
                progress(f"dry run: rank {rank} of {world} ...")
            with as_rank(rank, world):
                measured = measure_rank(cfg, built, steps=steps, mailbox=mailbox)
            report.ranks.append(measured)
            last = last_shard_rank(resolved, pp)
            if measured.uneven_shards and rank != last and last not in [r.rank for r in report.ranks]:
                ranks.append(last)
    report.seconds = time.perf_counter() - start
    if any(r.stand_in_values for r in report.ranks):
        report.notes.append(
            "values the step reads off tensors (the gradient norm, agreement flags) were answered as in a healthy "
            "step: the printed loss and norm mean nothing"
        )
    return report


def _guarded(build: Callable[[], nn.Module], name: str) -> Callable[[], nn.Module]:
    """``build`` with its failures on fake tensors as one line naming the cause."""

    def guarded() -> nn.Module:
        try:
            return build()
        except ConfigError:
            raise
        except (RuntimeError, ValueError, OverflowError) as err:
            text = str(err).splitlines()[0] if str(err) else type(err).__name__
            if "overflow" in text.lower() or "too large" in text.lower() or isinstance(err, OverflowError):
                raise ConfigError(
                    f"{name} is too large even for fake tensors' metadata ({text}): a tensor's element count must "
                    "fit in 64 bits; check the model's sizes"
                ) from None
            raise ConfigError(
                f"{name} cannot be built on fake tensors ({type(err).__name__}: {text}): its construction reads "
                "tensor values (data, a checkpoint, .item()); build it from sizes alone, and load weights after"
            ) from None

    return guarded
