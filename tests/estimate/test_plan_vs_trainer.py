"""``ndparallel plan`` and ``ndparallel train`` apply one rule set (pure Python, no ranks).

Every mesh shape the planner ranks passes the trainer's pre-flight check (``TrainConfig.check_mesh``, what
``ndparallel train --cpu-ranks`` runs before any rank starts), and every shape the planner calls invalid is
refused by it: for a few models and clusters, all shapes of the world size are compared both ways. The batch
split is compared the same way over many batch sizes: the planner must never recommend a split the trainer
refuses, and both must count the same micro-batches per step.
"""

from __future__ import annotations

import pytest

from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.errors import ConfigError
from ndparallel.estimate import ClusterSpec, MeshShape, TrainingSpec, estimate, mesh_shapes, model_spec, plan
from ndparallel.models import TransformerConfig
from ndparallel.train.job_config import DataConfig, LoopConfig, TrainConfig

# (model preset, cluster, training): real sizes, and awkward ones (batch 6, sequence 100 or 96, 12 GPUs).
CASES = {
    "8b_64gpus": ("8b", ClusterSpec(num_gpus=64), TrainingSpec(global_batch=512, seq_len=8192)),
    "8b_16gpus_ulysses": (
        "8b",
        ClusterSpec.from_gpu("h200", num_gpus=16),
        TrainingSpec(global_batch=64, seq_len=4096, micro_batch=2, cp_rotate_method="alltoall"),
    ),
    "1b_8gpus_unbalanced": (
        "1b",
        ClusterSpec(num_gpus=8),
        TrainingSpec(global_batch=12, seq_len=1020, cp_load_balance=False, activation_checkpointing="full"),
    ),
    "tiny_8gpus_awkward": ("tiny", ClusterSpec(num_gpus=8), TrainingSpec(global_batch=6, seq_len=100)),
    "small_12gpus": (
        "small",
        ClusterSpec(num_gpus=12, gpus_per_node=4),
        TrainingSpec(global_batch=24, seq_len=96, micro_batch=2, cp_rotate_method="allgather"),
    ),
    # a mixture of experts: ep searched over the divisors of dp_shard x cp (4 experts: ep 8 refused)
    "tiny_moe_8gpus": (
        "tiny-moe",
        ClusterSpec(num_gpus=8),
        TrainingSpec(global_batch=16, seq_len=64, precision="fp32"),
    ),
}


def _trainer_config(preset: str, train: TrainingSpec, mesh: MeshShape) -> TrainConfig:
    """The ``ndparallel train`` config of the same model, batch, sequence and mesh."""
    parallelism = ParallelismConfig(
        pp_size=mesh.pp,
        pp_schedule=mesh.pp_schedule,
        pp_microbatches=mesh.pp_microbatches or None,
        pp_stages_per_rank=mesh.pp_stages_per_rank or None,
        mixed_precision="no" if train.precision == "fp32" else train.precision,
        dp_replicate_size=mesh.dp_replicate,
        dp_shard_size=mesh.dp_shard,
        cp_size=mesh.cp,
        tp_size=mesh.tp,
        ep_size=mesh.ep,
        cp_rotate_method=train.cp_rotate_method,
        cp_load_balance=train.cp_load_balance,
        activation_checkpointing=train.activation_checkpointing,
        compile=train.compile,
    )
    return TrainConfig(
        parallelism=parallelism,
        model=TransformerConfig.from_preset(preset),
        data=DataConfig(seq_len=train.seq_len),
        train=LoopConfig(global_batch=train.global_batch, micro_batch=train.micro_batch),
    )


# Pipeline shapes: (model preset, cluster, training, schedules searched).
PP_CASES = {
    "small_8gpus_pp_fp32": (
        "small",
        ClusterSpec(num_gpus=8),
        TrainingSpec(global_batch=32, seq_len=256, micro_batch=1, precision="fp32"),
        ("gpipe", "1f1b", "interleaved_1f1b"),
    ),
    "tiny_4gpus_pp_bf16": ("tiny", ClusterSpec(num_gpus=4), TrainingSpec(global_batch=8, seq_len=64), ("1f1b",)),
    "tiny_moe_8gpus_pp_fp32": (
        "tiny-moe",
        ClusterSpec(num_gpus=8),
        TrainingSpec(global_batch=16, seq_len=64, precision="fp32"),
        ("gpipe", "1f1b"),
    ),
    "tiny_8gpus_pp_alltoall_fp32": (
        "tiny",
        ClusterSpec(num_gpus=8),
        TrainingSpec(global_batch=16, seq_len=64, precision="fp32", cp_rotate_method="alltoall"),
        ("1f1b", "interleaved_1f1b"),
    ),
}


def _trainer_refusal(preset: str, train: TrainingSpec, mesh: MeshShape) -> str | None:
    """What ``ndparallel train`` says of this shape before any rank starts (None: it accepts it); under pp the
    config itself refuses what no parity test covers yet (e.g. bf16)."""
    try:
        cfg = _trainer_config(preset, train, mesh)
        cfg.check_mesh(cfg.parallelism.resolve(cfg.parallelism.world_size))
    except ConfigError as err:
        return str(err)
    return None


@pytest.mark.parametrize("case", list(CASES))
def test_the_trainer_accepts_every_shape_the_planner_ranks_and_refuses_every_invalid_one(case):
    preset, cluster, train = CASES[case]
    result = plan(model_spec(preset), train, cluster)
    assert result.ranked, "each case must have shapes to recommend"
    for e in result.ranked + result.rejected:
        refusal = _trainer_refusal(preset, train, e.mesh)
        if e.valid:  # ranked, or valid but out of memory
            assert refusal is None, f"plan accepts {e.mesh.describe()} but train refuses it: {refusal}"
        else:
            assert refusal is not None, f"plan refuses {e.mesh.describe()} ({e.reason()}) but train accepts it"
    assert any(not e.valid for e in result.rejected), "each case must exercise a refusal too"


def test_the_batch_split_is_the_same_in_the_planner_and_the_trainer():
    model = model_spec("tiny")
    for shape in mesh_shapes(8):
        for global_batch in range(1, 25):
            for micro_batch in (1, 2, 3, 4):
                train = TrainingSpec(global_batch=global_batch, seq_len=64, micro_batch=micro_batch)
                planned = train.accumulation_steps(shape)  # 0: the batch does not split
                e = estimate(model, train, shape)
                assert (planned == 0) == any("global_batch" in p for p in e.problems)
                cfg = _trainer_config("tiny", train, shape)
                try:
                    trained = cfg.accumulation_steps(shape.dp)
                except ConfigError:
                    trained = 0
                assert planned == trained, (shape.describe(), global_batch, micro_batch)


@pytest.mark.parametrize("case", list(PP_CASES))
def test_pipeline_shapes_the_planner_ranks_are_the_ones_the_trainer_accepts(case):
    preset, cluster, train, schedules = PP_CASES[case]
    result = plan(model_spec(preset), train, cluster, search_pp=True, pp_schedules=schedules)
    pp_shapes = [e for e in result.ranked + result.rejected if e.mesh.pp > 1]
    assert pp_shapes, "the search must include pp shapes"
    for e in pp_shapes:
        refusal = _trainer_refusal(preset, train, e.mesh)
        if e.valid:
            assert refusal is None, f"plan accepts {e.mesh.describe()} but train refuses it: {refusal}"
        else:
            assert refusal is not None, f"plan refuses {e.mesh.describe()} ({e.reason()}) but train accepts it"
    if case == "small_8gpus_pp_fp32":  # every inner dim under pp is planned: dp_shard, cp, tp, pure dp_replicate
        valid = [e.mesh for e in pp_shapes if e.valid]
        for dim in ("dp_shard", "cp", "tp", "dp_replicate"):
            assert any(getattr(m, dim) > 1 for m in valid), f"no valid pp x {dim} shape"
        assert any(m.cp > 1 and m.dp_shard > 1 for m in valid) and any(m.dp_replicate > 1 and m.tp > 1 for m in valid)


def test_a_mixture_of_experts_with_checkpointing_is_refused_by_both():
    """ep's pre-flight refuses activation checkpointing on an MoE (not proved against one process yet): every
    shape, with and without ep, in the planner and the trainer alike."""
    train = TrainingSpec(global_batch=16, seq_len=64, precision="fp32", activation_checkpointing="full")
    result = plan(model_spec("tiny-moe"), train, ClusterSpec(num_gpus=4))
    assert not result.ranked and any(e.mesh.ep > 1 for e in result.rejected)
    for e in result.rejected:
        assert "activation_checkpointing='full' on a mixture-of-experts model" in e.reason()
        assert _trainer_refusal("tiny-moe", train, e.mesh) is not None, e.mesh.describe()
