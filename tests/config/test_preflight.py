"""One job pre-flight (ndparallel/config/preflight.py): the same refused shape gets the same message from
``ndparallel train`` (TrainConfig.check_mesh), ``ndparallel bench`` (BenchCase) and ``ndparallel plan``
(shape_problems), and each rule refuses what it should and nothing else."""

from __future__ import annotations

import pytest

from ndparallel.bench import BenchCase
from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.config.preflight import JobShape, ModelShape, check_job, job_problems
from ndparallel.errors import ConfigError
from ndparallel.estimate import MeshShape, TrainingSpec, model_spec, shape_problems
from ndparallel.train import TrainConfig

TINY = {"preset": "tiny"}  # 2 layers, 8 heads, 4 kv heads, ffn 192, vocab 256, max_seq_len 256

# (parallelism, global batch, seq len, the refusal every tool must give)
REFUSED = [
    ({"tp_size": 3}, 6, 48, "tp_size=3 does not divide model.n_heads=8; choose a tp_size that divides it"),
    ({"dp_shard_size": 4}, 6, 64, "train.global_batch=6 is not divisible by the data-parallel size 4"),
    ({"cp_size": 2}, 4, 30, "data.seq_len 30 is not divisible by 2 x cp_size = 4 (cp_load_balance=true"),
    ({"tp_size": 2}, 4, 63, "data.seq_len 63 is not divisible by tp_size=2"),
    (
        {"cp_size": 4, "tp_size": 4, "cp_rotate_method": "alltoall"},
        4,
        64,
        "model.n_heads=8 / tp_size=4 = 2 query heads per tp rank do not divide by cp_size=4",
    ),
    ({"tp_size": 2, "mixed_precision": "fp16"}, 4, 64, "mixed_precision=fp16 without FSDP"),
    (
        {"pp_size": 2, "pp_schedule": "interleaved_1f1b", "pp_microbatches": 4},
        8,
        64,
        "pp_size=2 x pp_stages_per_rank=2 = 4 pipeline stages but model.n_layers=2",
    ),
    ({"pp_size": 2, "pp_microbatches": 3}, 8, 64, "pp_microbatches=3 does not divide the per-rank batch 8"),
]


def _train_refusal(parallel: dict, global_batch: int, seq_len: int) -> str:
    cfg = TrainConfig.from_dict(
        {"parallelism": parallel, "model": TINY, "train": {"global_batch": global_batch}, "data": {"seq_len": seq_len}}
    )
    with pytest.raises(ConfigError) as err:
        cfg.check_mesh(cfg.parallelism.resolve(cfg.parallelism.world_size))
    return str(err.value)


def _bench_refusal(parallel: dict, global_batch: int, seq_len: int) -> str:
    case = BenchCase("s", "case", dict(TINY), parallel, seq_len=seq_len, global_batch=global_batch)
    with pytest.raises(ConfigError) as err:
        case.validate()
    prefix = "bench case s/case: "
    assert str(err.value).startswith(prefix)
    return str(err.value).removeprefix(prefix)


def _plan_refusals(parallel: dict, global_batch: int, seq_len: int) -> list[str]:
    cfg = ParallelismConfig.from_dict(parallel)
    precision = "fp32" if cfg.mixed_precision == "no" else cfg.mixed_precision
    train = TrainingSpec(
        global_batch=global_batch, seq_len=seq_len, precision=precision, cp_rotate_method=cfg.cp_rotate_method
    )
    return shape_problems(model_spec("tiny"), train, MeshShape.from_config(cfg.resolve(cfg.world_size)))


@pytest.mark.parametrize(("parallel", "global_batch", "seq_len", "message"), REFUSED)
def test_train_bench_and_plan_refuse_a_shape_with_one_message(parallel, global_batch, seq_len, message):
    trained = _train_refusal(parallel, global_batch, seq_len)
    assert message in trained
    assert _bench_refusal(parallel, global_batch, seq_len) == trained
    assert trained in _plan_refusals(parallel, global_batch, seq_len)


def test_the_accepted_shape_runs_everywhere_with_the_same_micro_batches():
    for parallel, batch, expected in [({"dp_shard_size": 2}, 8, 1), ({"pp_size": 2, "pp_microbatches": 4}, 8, 4)]:
        cfg = TrainConfig.from_dict({"parallelism": parallel, "model": TINY, "train": {"global_batch": batch}})
        sizes = cfg.parallelism.resolve(cfg.parallelism.world_size)
        assert cfg.check_mesh(sizes) == expected
        case = BenchCase("s", "ok", dict(TINY), parallel, seq_len=cfg.data.seq_len, global_batch=batch)
        assert case.accumulation_steps() == expected
        train = TrainingSpec(global_batch=batch, seq_len=cfg.data.seq_len, precision="fp32")
        assert shape_problems(model_spec("tiny"), train, MeshShape.from_config(sizes)) == []


def test_job_problems_lists_every_broken_rule_and_check_job_raises_the_first():
    sizes = ParallelismConfig(tp_size=3, dp_shard_size=2).resolve(6)
    model = ModelShape(2, {"model.n_heads": 8}, ("model.n_heads", 8), max_seq_len=32)
    job = JobShape(global_batch=3, seq_len=64)
    problems = job_problems(sizes, job, model)
    assert [p.split(" ")[0] for p in problems] == [
        "data.seq_len=64",
        "data.seq_len",
        "tp_size=3",
        "train.global_batch=3",
    ]
    with pytest.raises(ConfigError, match="exceeds model.max_seq_len=32"):
        check_job(sizes, job, model)
    assert job_problems(ParallelismConfig().resolve(1), JobShape(4, 16), model) == []


def test_mesh_shape_round_trips_through_the_config():
    cfg = ParallelismConfig(
        pp_size=2, dp_replicate_size=2, dp_shard_size=2, cp_size=2, tp_size=1, pp_schedule="gpipe", pp_microbatches=4
    )
    shape = MeshShape.from_config(cfg)
    assert shape == MeshShape(2, 2, 2, 1, 2, "gpipe", 4, 0)
    assert shape.to_config().sizes == cfg.sizes and shape.to_config().pp_microbatches == 4
