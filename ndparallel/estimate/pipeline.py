"""The pipeline-parallel (pp) part of the cost model: stage split, what each pp rank holds, micro-batches in
flight per schedule, the bubble and point-to-point traffic. Formulas and their measured validation:
docs/planning.md ("Pipeline parallelism").

Rules of the schedules (torch.distributed.pipelining, measured on CPU/gloo, torch 2.13):

* ``gpipe``: all forwards, then all backwards: every stage holds all ``m`` micro-batches.
* ``1f1b``: stage ``s`` runs ``min(m, p - s)`` warm-up forwards, then one backward per forward: it holds
  ``min(m, p - s)`` micro-batches.
* ``interleaved_1f1b`` (``v`` stages per rank): pp rank ``r`` runs ``w = (v-1) * k + 2 (p-1-r)`` warm-up
  forwards, ``k = m / max(1, m // p)`` micro-batches per round, then one more forward before its first
  backward: ``min(m v, w + 1)`` stage-forwards in flight, the ``i``-th on its local stage ``(i // k) % v``
  (torch's op order). Fitted to, and exact on, the measured table (docs/planning.md).
* ``looped_bfs``, ``interleaved_zb``, ``zbv``, ``dualpipev``: not modelled from measurements yet: every local
  stage is assumed to hold all ``m`` micro-batches (GPipe's bound; the spike measured ZBV at 0.9x of it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ndparallel.config.pipeline import stages_fit_blocks
from ndparallel.estimate.mesh import MeshShape
from ndparallel.estimate.model import ModelSpec
from ndparallel.estimate.training import TrainingSpec
from ndparallel.parallel.pipeline.placement import stage_ids
from ndparallel.parallel.pipeline.split import balanced_split

__all__ = [
    "RankShare",
    "bubble_fraction",
    "in_flight",
    "microbatches",
    "rank_shares",
    "stage_ranges",
]

MEASURED_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(frozen=True)
class RankShare:
    """What one pp rank holds: its stage ids, their block counts, and whether it has the embedding / the head
    (final norm + output + loss). Without pp: the whole model."""

    stage_ids: tuple[int, ...]
    stage_blocks: tuple[int, ...]
    embedding: bool
    head: bool
    last_stage_local: int = -1
    """Index (in ``stage_ids``) of the local stage that holds the head, -1 if none."""
    stage_moe_blocks: tuple[int, ...] = ()
    """How many of each local stage's blocks are mixture-of-experts blocks (empty: none)."""

    @property
    def blocks(self) -> int:
        return sum(self.stage_blocks)

    @property
    def moe_blocks(self) -> int:
        return sum(self.stage_moe_blocks)

    def moe_blocks_of(self, local_stage: int) -> int:
        """The MoE blocks of local stage ``local_stage``."""
        return self.stage_moe_blocks[local_stage] if self.stage_moe_blocks else 0

    @classmethod
    def whole(cls, model: ModelSpec) -> RankShare:
        return cls((0,), (model.n_layers,), True, True, 0, (model.n_moe_layers,) if model.is_moe else ())


def stage_ranges(model: ModelSpec, n_stages: int, split: list[list[int]] | None = None) -> list[range]:
    """Contiguous block ranges per stage: ``split`` (explicit ``[first, last)`` pairs) or balanced by parameter
    count (the first stage also holds the embedding, the last the final norm and output): the split that
    minimises the largest stage, each stage at least one block: the runtime's own ``balanced_split``."""
    if split is not None:
        return [range(a, b) for a, b in split]
    return list(_balanced_ranges(model, n_stages))


@functools.lru_cache(maxsize=256)
def _balanced_ranges(model: ModelSpec, n_stages: int) -> tuple[range, ...]:
    first, last = model.embedding_params, model.output_params + model.dim
    if not stages_fit_blocks(n_stages, model.n_layers):
        return tuple(range(i, i + 1) for i in range(n_stages))  # invalid shape (refused by the planner)
    return tuple(balanced_split([model.block_params(i) for i in range(model.n_layers)], n_stages, first, last))


def stage_ids_of_rank(pp_rank: int, mesh: MeshShape) -> list[int]:
    """The stages ``pp_rank`` holds, by the runtime's placement rule (loop: ``r, r + p, ...``; V: ``r, 2p-1-r``)."""
    return stage_ids(pp_rank, mesh.pp, mesh.stages_per_rank, mesh.pp_schedule)


def rank_shares(model: ModelSpec, mesh: MeshShape, split: list[list[int]] | None = None) -> list[RankShare]:
    """One :class:`RankShare` per pp rank (a single whole-model share without pp)."""
    if split is None:
        return list(_rank_shares(model, mesh))
    return _shares(model, mesh, split)


@functools.lru_cache(maxsize=4096)
def _rank_shares(model: ModelSpec, mesh: MeshShape) -> tuple[RankShare, ...]:
    return tuple(_shares(model, mesh, None))


def _shares(model: ModelSpec, mesh: MeshShape, split: list[list[int]] | None) -> list[RankShare]:
    if mesh.pp == 1:
        return [RankShare.whole(model)]
    n_stages = mesh.n_stages
    ranges = stage_ranges(model, n_stages, split)
    shares = []
    moe = set(model.moe_layers)
    for r in range(mesh.pp):
        ids = stage_ids_of_rank(r, mesh)
        last = ids.index(n_stages - 1) if n_stages - 1 in ids else -1
        moe_blocks = tuple(len(moe.intersection(ranges[i])) for i in ids) if moe else ()
        shares.append(RankShare(tuple(ids), tuple(len(ranges[i]) for i in ids), 0 in ids, last >= 0, last, moe_blocks))
    return shares


def microbatches(train: TrainingSpec, mesh: MeshShape) -> int:
    """The pipeline's ``m``: ``pp_microbatches``, else the training accumulation steps (0 if the batch does not
    divide)."""
    return mesh.pp_microbatches or train.accumulation_steps(mesh)


def in_flight(mesh: MeshShape, m: int, pp_rank: int) -> list[int]:
    """Micro-batches each local stage of ``pp_rank`` holds activations for at the schedule's peak (module doc)."""
    p, v, schedule = mesh.pp, mesh.stages_per_rank, mesh.pp_schedule
    if p == 1:
        return [1]
    if schedule == "1f1b":
        return [min(m, p - pp_rank)]
    if schedule == "interleaved_1f1b":
        per_round = m // max(1, m // p)
        forwards = min(m * v, (v - 1) * per_round + 2 * (p - 1 - pp_rank) + 1)
        counts = [0] * v
        for i in range(forwards):
            counts[(i // per_round) % v] += 1
        return counts
    return [m] * v  # gpipe (exact); looped_bfs and the zero-bubble schedules (an upper bound)


def bubble_fraction(mesh: MeshShape, m: int) -> float:
    """Idle share of a step: ``(p-1) / (m+p-1)`` for GPipe / 1F1B; interleaved schedules divide the fill and
    drain by the stages per rank ``v``: ``(p-1) / (v m + p-1)``."""
    if mesh.pp == 1 or m < 1:
        return 0.0
    p, v = mesh.pp, mesh.stages_per_rank
    return (p - 1) / (v * m + p - 1)


def p2p_sends(mesh: MeshShape, m: int, share: RankShare) -> tuple[int, int]:
    """(activation sends, gradient sends) of one pp rank per step: each stage sends its output forward to
    the next stage and the gradient of its input back to the previous one, once per micro-batch."""
    n_stages = mesh.n_stages
    forward = sum(m for sid in share.stage_ids if sid < n_stages - 1)
    backward = sum(m for sid in share.stage_ids if sid > 0)
    return forward, backward
