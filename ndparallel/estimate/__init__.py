"""Analytic memory / communication / step-time model of ndparallel training, and the mesh search behind
``ndparallel plan``.

Modules: the inputs ``units`` (sizes, bandwidths, counts), ``model``, ``cluster``, ``training`` and ``mesh`` (a
view of a resolved ``ParallelismConfig`` whose rules are the config's), ``hardware`` (the one table of per-GPU
constants, with sources), ``memory``, ``comm``, the time model from its parts: ``kernels`` (a matmul by shape,
attention, a memory-bound pass), ``memory_ops`` (bytes of the memory-bound ops, eager or compiled),
``checkpointing`` (what each policy recomputes), ``compute`` (one rank's compute by kind), ``timing`` (overlap,
exposed communication, the step); ``pipeline`` (pipeline parallelism: stage split, micro-batches in flight,
bubble, p2p), ``experts`` (mixture of experts: expert shards per rank, what an MoE block saves, its all-to-all and
router statistics), ``search`` (estimate one shape, rank them all; ``ep`` too for an MoE), ``explain``
(``plan --explain``), ``cli`` (the ``plan`` command).

    from ndparallel.estimate import ClusterSpec, MeshShape, TrainingSpec, estimate, model_spec, plan

    model = model_spec("8b")                        # preset (tiny-moe too), HF config.json path/dict, raw counts
    train = TrainingSpec(global_batch=512, seq_len=8192, activation_checkpointing="full")
    cluster = ClusterSpec.from_gpu("h100", num_gpus=64)
    e = estimate(model, train, MeshShape(dp_shard=16, tp=4), cluster)
    e.memory.peak, e.time.step_s, [c.name for c in e.comms]
    best = plan(model, train, cluster).best        # every mesh shape ranked by predicted step time

Formulas and validation: docs/planning.md.
"""

from ndparallel.estimate.cluster import GPU_PRESETS, ClusterSpec
from ndparallel.estimate.comm import Collective, collectives, group_link
from ndparallel.estimate.compute import ComputeTime, compute_time
from ndparallel.estimate.hardware import GPU_KINDS, LINKS, GpuKind
from ndparallel.estimate.memory import (
    MemoryEstimate,
    activation_bytes,
    estimate_memory,
    params_per_rank,
    saved_activation_bytes,
)
from ndparallel.estimate.mesh import MeshShape
from ndparallel.estimate.model import ModelSpec, model_spec
from ndparallel.estimate.pipeline import RankShare, bubble_fraction, in_flight, rank_shares, stage_ranges
from ndparallel.estimate.search import Estimate, Plan, estimate, mesh_shapes, plan, shape_problems
from ndparallel.estimate.timing import StepTime, estimate_step_time
from ndparallel.estimate.training import PRECISIONS, TrainingSpec
from ndparallel.estimate.units import parse_bandwidth, parse_bytes, parse_count

__all__ = [
    "GPU_KINDS",
    "GPU_PRESETS",
    "LINKS",
    "ComputeTime",
    "GpuKind",
    "PRECISIONS",
    "ClusterSpec",
    "Collective",
    "Estimate",
    "MemoryEstimate",
    "MeshShape",
    "ModelSpec",
    "Plan",
    "RankShare",
    "StepTime",
    "TrainingSpec",
    "activation_bytes",
    "bubble_fraction",
    "collectives",
    "compute_time",
    "estimate",
    "estimate_memory",
    "estimate_step_time",
    "group_link",
    "in_flight",
    "mesh_shapes",
    "model_spec",
    "params_per_rank",
    "parse_bandwidth",
    "parse_bytes",
    "parse_count",
    "plan",
    "rank_shares",
    "saved_activation_bytes",
    "shape_problems",
    "stage_ranges",
]
