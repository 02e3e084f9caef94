"""The mesh the planner reasons about: a hashable, frozen view of a resolved ``ParallelismConfig`` (:class:`MeshShape`).

It holds the sizes and pipeline knobs the estimator varies, under the config's ``<dim>_size`` names too, and asks
every rule of ndparallel/config/: the FSDP, data-parallel and expert-FSDP degrees (``config.dims``), the stages each
pp rank holds (``config.pipeline``), which sizes are valid. A shape the config refuses can still be estimated:
``to_config`` then raises the config's own error, which the search reports as the shape's problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ndparallel.config.dims import data_parallel_size, ep_fsdp_size, fsdp_size, is_size
from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.config.pipeline import schedule_spec, stages_per_pp_rank
from ndparallel.errors import ConfigError

if TYPE_CHECKING:
    from ndparallel.estimate.training import TrainingSpec

__all__ = ["MeshShape"]


@dataclass(frozen=True, order=True)
class MeshShape:
    """Sizes of the mesh dims, outer -> inner: (pp,) dp_replicate, dp_shard, cp, tp; the pipeline's knobs; and
    ``ep``, expert parallelism, which borrows its ranks from dp_shard x cp (``ep_fsdp`` = what remains of them).

    ``pp`` is listed last as a field (so ``MeshShape(rep, shard, cp, tp)`` keeps working) but is the outermost
    mesh dim. The pp knobs mirror ``ParallelismConfig``'s (:meth:`from_config` / :meth:`to_config` convert;
    the sizes' names and rules are the config's): ``pp_schedule``;
    ``pp_microbatches`` (0: the training accumulation steps, the config's None); ``pp_stages_per_rank``
    (0: 1 for gpipe / 1f1b, 2 otherwise, the config's None)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 0
    pp_stages_per_rank: int = 0
    ep: int = 1
    """Expert-parallel size: the inner ``ep`` ranks of dp_shard x cp each own ``n_experts / ep`` routed experts
    (``ParallelismConfig.ep_size``; not a mesh dim of its own)."""

    def __post_init__(self) -> None:
        for key in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep"):
            value = getattr(self, key)
            if not is_size(value):
                raise ConfigError(f"mesh {key}={value!r} must be a positive integer")
        for key in ("pp_microbatches", "pp_stages_per_rank"):
            value = getattr(self, key)
            if not (is_size(value) or _is_unset(value)):
                raise ConfigError(f"{key}={value!r} must be a positive integer (0 or omitted: the default)")
        schedule_spec(self.pp_schedule)  # the config's refusal of an unknown schedule

    @classmethod
    def from_config(cls, cfg: ParallelismConfig) -> MeshShape:
        """The shape of a resolved :class:`ParallelismConfig` (``dp_shard_size`` -> ``dp_shard``, ...)."""
        return cls(
            cfg.dp_replicate_size, cfg.dp_shard_size, cfg.cp_size, cfg.tp_size, cfg.pp_size, cfg.pp_schedule,
            cfg.pp_microbatches or 0, cfg.pp_stages_per_rank or 0, cfg.ep_size,
        )  # fmt: skip

    def to_config(self, train: TrainingSpec | None = None) -> ParallelismConfig:
        """The :class:`ParallelismConfig` of this shape, with the training's precision and cp knobs: what
        ``ndparallel train`` would be given. Raises the config's own :class:`ConfigError` for a shape it refuses."""
        knobs = {}
        if train is not None:
            knobs = {
                "mixed_precision": train.mixed_precision,
                "activation_checkpointing": train.activation_checkpointing, "compile": train.compile,
                "cp_rotate_method": train.cp_rotate_method, "cp_load_balance": train.cp_load_balance,
            }  # fmt: skip
        sizes = {f"{dim}_size": value for dim, value in self.sizes.items()}
        return ParallelismConfig(
            **sizes, pp_schedule=self.pp_schedule, pp_microbatches=self.pp_microbatches or None,
            pp_stages_per_rank=self.pp_stages_per_rank or None, ep_size=self.ep, **knobs,
        )  # fmt: skip

    # -- the config's names: what the rules of ndparallel/config/ read -----------------------------
    @property
    def pp_size(self) -> int:
        return self.pp

    @property
    def dp_replicate_size(self) -> int:
        return self.dp_replicate

    @property
    def dp_shard_size(self) -> int:
        return self.dp_shard

    @property
    def cp_size(self) -> int:
        return self.cp

    @property
    def tp_size(self) -> int:
        return self.tp

    @property
    def ep_size(self) -> int:
        return self.ep

    sizes = ParallelismConfig.sizes  # the config's own: mesh dim -> size, outer to inner
    world_size = ParallelismConfig.world_size  # the config's own: the product of the sizes

    # -- degrees and stages, asked of the config ---------------------------------------------------
    @property
    def inner_size(self) -> int:
        """Ranks of one pipeline stage group (the mesh without pp)."""
        return self.world_size // self.pp

    @property
    def fsdp(self) -> int:
        """FSDP shard group size: dp_shard x cp (``ndparallel.config.dims.fsdp_size``)."""
        return fsdp_size(self)

    @property
    def ep_fsdp(self) -> int:
        """Ranks the routed experts' FSDP shards over: what ep leaves of dp_shard x cp (``config.dims``)."""
        return ep_fsdp_size(self)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are processed at once (``config.dims``)."""
        return data_parallel_size(self)

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each pp rank holds: 1 without pp (``ndparallel.config.pipeline.stages_per_pp_rank``)."""
        return stages_per_pp_rank(self.pp, self.pp_schedule, self.pp_stages_per_rank or None)

    @property
    def n_stages(self) -> int:
        """Stages of the whole pipeline: pp x stages per rank (1 without pp)."""
        return self.pp * self.stages_per_rank

    def describe(self) -> str:
        inner = f"{self.dp_replicate}x{self.dp_shard}x{self.cp}x{self.tp}" + (f" ep{self.ep}" if self.ep > 1 else "")
        return inner if self.pp == 1 else f"pp{self.pp} {self.pp_schedule} x {inner}"

    def as_dict(self) -> dict[str, int]:
        """The four inner dims (what link and group rules read); ``pp_dict`` has the pipeline's."""
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp, "tp": self.tp}

    def pp_dict(self) -> dict[str, object]:
        return {
            "pp": self.pp, "pp_schedule": self.pp_schedule, "pp_microbatches": self.pp_microbatches or None,
            "pp_stages_per_rank": self.pp_stages_per_rank or None,
        }  # fmt: skip


def _is_unset(value: object) -> bool:
    """A pp knob left to the config's default: 0 here, the config's None."""
    return isinstance(value, int) and not isinstance(value, bool) and value == 0
