"""Mixture of experts on 2 ranks, float64, against one process: FSDP 2, DDP 2, CP 2, expert parallel 2, TP 2
(the sigmoid router runs in tests/parallel/test_expert_parallel.py), and the training step's router work:
``TrainStep`` moving a sigmoid router's balancing bias on FSDP 2 and reporting the step's global tokens per
expert, and ``ndparallel train``'s progress line showing them, in the same spawned group.

The router's load-balancing loss uses the token fractions of the global batch (counts all-reduced over dp x cp),
so every layout equals one process on the same global batch: loss (cross entropy + auxiliary losses), grad norm
(clipped at 0.5), step-1 gradients and parameters after 5 AdamW steps, to 1e-10. A per-rank aux loss (the counts
left local) is the classic MoE bug: the last run shows it differs, so these checks can fail.
"""

from __future__ import annotations

import contextlib
import io
import json
import re

import numpy as np
import pytest

from tests.parity import (
    FLOAT64_TOL,
    assert_parity,
    build_model,
    context_parallel_loss_fn,
    default_loss_fn,
    make_batches,
    run_many,
    train_steps,
)

MODEL = {"preset": "tiny-moe", "aux_loss_coef": 0.1, "z_loss_coef": 0.01}
SIGMOID = {**MODEL, "router": "sigmoid"}
COMMON = dict(steps=5, global_batch=8, seq_len=8, dtype="float64", max_norm=0.5, final_params=True)


def moe_loss_fn(model, tokens, labels, mesh):
    from ndparallel.parallel.loss import auxiliary_loss

    return default_loss_fn(model, tokens, labels, mesh) + auxiliary_loss(model)


def moe_cp_loss_fn(model, tokens, labels, mesh):
    from ndparallel.parallel.loss import auxiliary_loss

    return context_parallel_loss_fn(model, tokens, labels, mesh) + auxiliary_loss(model)


def per_rank_aux_loss_fn(model, tokens, labels, mesh):
    """The bug on purpose: each rank's token fractions of its own batch only."""
    for module in model.modules():
        if hasattr(module, "reduce_counts"):
            module.reduce_counts = None
    return moe_loss_fn(model, tokens, labels, mesh)


LAYOUTS = {
    "fsdp2": ({"dp_shard_size": 2}, dict(model=MODEL, loss_fn=moe_loss_fn)),
    "ddp2": ({"dp_replicate_size": 2}, dict(model=MODEL, loss_fn=moe_loss_fn)),
    "cp2": ({"cp_size": 2}, dict(model=MODEL, loss_fn=moe_cp_loss_fn)),
    "ep2": ({"dp_shard_size": 2, "ep_size": 2}, dict(model=MODEL, loss_fn=moe_loss_fn)),
    # the MoE block split over tp: tokens gathered, experts' hidden width split, router whole on both ranks
    "tp2": ({"tp_size": 2}, dict(model=MODEL, loss_fn=moe_loss_fn)),
    "fsdp2 accum2": ({"dp_shard_size": 2}, dict(model=MODEL, loss_fn=moe_loss_fn, grad_accum=2)),
    "fsdp2 per-rank aux": ({"dp_shard_size": 2}, dict(model=MODEL, loss_fn=per_rank_aux_loss_fn)),
}
RUNS = [(parallel, {**COMMON, **kwargs}) for parallel, kwargs in LAYOUTS.values()]


# Under accumulation the token fractions are those of one micro-batch across the dp ranks (micro-batch m of
# every rank): the one-process run whose micro-batch m holds the same sequences, dp 2 x 2 micro-batches.
ACCUM_ORDER = [0, 1, 4, 5, 2, 3, 6, 7]


_REFERENCES: dict[str, dict] = {}

# TrainStep (what `ndparallel train` runs) with the balancing bias moving, against train_steps' plain loop calling
# update_router_biases after each optimizer step. 0.01 changes the routing within the 5 steps.
BIAS_RATE = 0.01
BIAS_RUN = {**COMMON, "model": SIGMOID, "router_bias_rate": BIAS_RATE}
BIAS_LAYOUTS = {"fsdp2": {"dp_shard_size": 2}, "ep2": {"dp_shard_size": 2, "ep_size": 2}}


def train_step_run(parallel: dict, *, model, steps, global_batch, seq_len, dtype, max_norm, router_bias_rate,
                   final_params=True) -> dict:  # fmt: skip
    """On every rank: ``steps`` steps of :class:`~ndparallel.train.step.TrainStep` on this rank's dp slice of
    train_steps' batches (same model, seed, AdamW): losses, norms, each step's router loads, params, biases."""
    import torch
    from torch.distributed.tensor import DTensor

    import ndparallel as ndp
    from ndparallel.distributed.reduce import average_over
    from ndparallel.parallel.parallelize import parallelize
    from ndparallel.train.step import TrainStep

    torch.manual_seed(0)
    net = build_model(model, 0, dtype)
    mesh = ndp.init_distributed(ndp.ParallelismConfig.from_dict(parallel))
    net = parallelize(net, mesh.config, mesh)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.1)
    step = TrainStep(net, optimizer, mesh, max_grad_norm=max_norm, router_bias_rate=router_bias_rate)
    per_rank, dp_rank = global_batch // mesh.size("dp"), mesh.local_rank("dp")
    out: dict = {"losses": [], "grad_norms": [], "router_loads": []}
    for index, (tokens, labels) in enumerate(make_batches(steps, global_batch, seq_len, net.config.vocab_size)):
        mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        done = step(tokens[mine], labels[mine], 1, index + 1)
        out["losses"].append(average_over(mesh["dp_cp"], done.loss))
        out["grad_norms"].append(done.grad_norm)
        out["router_loads"].append([load.numpy() for load in done.router_loads])
    full = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in net.named_parameters()}
    out["params"] = {n: p.detach().numpy().copy() for n, p in full.items()}
    out["biases"] = {n: b.numpy().copy() for n, b in net.named_buffers() if n.endswith("expert_bias")}
    return out


def _loop_config(rate: float, metrics: str) -> dict:
    return {
        "parallelism": {"dp_shard_size": 2},
        "model": {**SIGMOID, "max_seq_len": 16, "dtype": "float64"},
        "data": {"seq_len": 16, "max_bytes": 20_000},
        "train": {"steps": 2, "global_batch": 4, "warmup_steps": 0, "log_every": 1, "router_bias_rate": rate,
                  "peak_tflops": 1.0,  # not the CPU matmul measurement (seconds)
                  "metrics_file": metrics},
    }  # fmt: skip


def loop_run(rate: float, metrics: str) -> dict:
    """``ndparallel train``'s loop on tiny-moe (sigmoid router): rank 0's stdout and the losses."""
    from ndparallel.train import train
    from ndparallel.train.job_config import TrainConfig

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        result = train(TrainConfig.from_dict(_loop_config(rate, metrics)))
    return {"stdout": stdout.getvalue(), "losses": result.losses}


def nan_router_run(parallel: dict) -> str:
    """One TrainStep of tiny-moe whose second block's router weight is NaN: the error every rank raises."""
    import torch

    import ndparallel as ndp
    from ndparallel.errors import DivergenceError
    from ndparallel.parallel.parallelize import parallelize
    from ndparallel.train.step import TrainStep

    net = build_model(MODEL, 0, "float64")
    with torch.no_grad():
        net.layers[1].feed_forward.router.gate.weight.fill_(float("nan"))
    mesh = ndp.init_distributed(ndp.ParallelismConfig.from_dict(parallel))
    net = parallelize(net, mesh.config, mesh)
    step = TrainStep(net, torch.optim.AdamW(net.parameters(), lr=1e-3), mesh)
    tokens, labels = make_batches(1, 4, 8, net.config.vocab_size)[0]
    try:
        step(tokens[:2], labels[:2], 1, 1)
    except DivergenceError as err:
        return str(err)
    return "no error"


def _group(runs: list, tmp: str) -> dict:
    """The one spawned group: the layouts, the TrainStep bias run, two loop runs (rate 0.05 and 0: off), a NaN
    router under ep 2."""
    return {
        "runs": run_many(runs),
        "bias": {label: train_step_run(parallel, **BIAS_RUN) for label, parallel in BIAS_LAYOUTS.items()},
        "loop": loop_run(0.05, f"{tmp}/on.jsonl"),
        "loop_off": loop_run(0.0, f"{tmp}/off.jsonl"),
        "nan_router": nan_router_run({"dp_shard_size": 2, "ep_size": 2}),
    }


def _reference(kwargs: dict) -> dict:
    """The one-process run for ``kwargs`` (with the aux loss), once per pytest process."""
    order = ACCUM_ORDER if kwargs.get("grad_accum", 1) > 1 else None
    kwargs = {**kwargs, "loss_fn": moe_loss_fn, "batch_order": order}
    key = repr(sorted((k, v) for k, v in kwargs.items() if k != "loss_fn"))
    if key not in _REFERENCES:
        _REFERENCES[key] = train_steps(None, **kwargs)
    return _REFERENCES[key]


def param_error(got: dict, ref: dict) -> float:
    return max(float(np.abs(got["params"][k] - v).max()) for k, v in ref["params"].items())


def print_worst(label: str, per_rank: list[dict], ref: dict) -> None:
    """The row docs/expert-parallel.md records (pytest -s): worst rank's loss, relative grad-norm, step-1 gradient
    and final parameter differences."""
    worst = [
        max(max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True)) for got in per_rank),
        max(max(abs(a - b) / b for a, b in zip(got["grad_norms"], ref["grad_norms"], strict=True)) for got in per_rank),
        max(max(float(np.abs(got["grads"][k] - v).max()) for k, v in ref["grads"].items()) for got in per_rank),
        max(param_error(got, ref) for got in per_rank),
    ]
    print(f"{label:40s} loss {worst[0]:.1e}  norm {worst[1]:.1e}  step-1 grads {worst[2]:.1e}  params {worst[3]:.1e}")


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    from ndparallel.testing import run_distributed

    tmp = tmp_path_factory.mktemp("moe")
    return run_distributed(_group, 2, RUNS, str(tmp), timeout=600), tmp


def test_moe_layouts_equal_one_process(group):
    results = [per_rank["runs"] for per_rank in group[0]]
    for index, (label, (_, kwargs)) in enumerate(LAYOUTS.items()):
        ref = _reference({**COMMON, **kwargs})
        for rank, per_rank in enumerate(results):
            got = per_rank[index]
            assert got["params"].keys() == ref["params"].keys()
            if label.endswith("per-rank aux"):  # the classic bug is visible: the checks above can fail
                assert abs(got["losses"][0] - ref["losses"][0]) > 1e-6, label
                continue
            assert_parity(got, ref, label=f"{label} rank {rank}", max_norm=COMMON["max_norm"])
            assert param_error(got, ref) <= FLOAT64_TOL["grad_tol"], f"{label}: params after 5 steps differ"
        print_worst(label, [per_rank[index] for per_rank in results], ref)


def test_accumulation_is_per_micro_batch():
    """Documented, not hidden: with accumulation the fractions are per (global) micro-batch, so the run differs
    from one process on the whole batch in one pass (docs/expert-parallel.md)."""
    one_pass = _reference({**COMMON, "model": MODEL})
    two_micro = _reference({**COMMON, "model": MODEL, "grad_accum": 2})
    assert abs(one_pass["losses"][0] - two_micro["losses"][0]) > 1e-6


def test_aux_loss_is_counted():
    """The auxiliary loss moves the training: without it the one-process trajectory is another one."""
    with_aux = _reference({**COMMON, "model": MODEL})
    without = train_steps(None, **{**COMMON, "steps": 1, "model": MODEL, "loss_fn": default_loss_fn})
    assert abs(with_aux["losses"][0] - without["losses"][0]) > 1e-3


def test_train_step_moves_router_bias_as_one_process(group):
    """FSDP 2 and ep 2 through TrainStep equal one process calling update_router_biases: losses, norms, the global
    tokens per expert of every step (exact integers), params after 5 steps and the biases (exact sums of +-rate)."""
    ref = train_steps(None, **BIAS_RUN, loss_fn=moe_loss_fn)
    still = _reference({**COMMON, "model": SIGMOID})  # the same run with the bias left at 0
    assert param_error(ref, still) > 1e-6, "the bias must change the routing, or this test cannot fail"
    assert any(np.abs(b).max() > 0 for b in ref["biases"].values())
    for rank, layout in ((r, layout) for r in range(2) for layout in BIAS_LAYOUTS):
        got = group[0][rank]["bias"][layout]
        label = f"TrainStep {layout} bias rank {rank}"
        dloss = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True))
        dnorm = max(abs(a - b) / b for a, b in zip(got["grad_norms"], ref["grad_norms"], strict=True))
        assert dloss <= FLOAT64_TOL["loss_tol"] and dnorm <= FLOAT64_TOL["norm_rtol"], (label, dloss, dnorm)
        for step, (a, b) in enumerate(zip(got["router_loads"], ref["router_loads"], strict=True)):
            assert len(a) == len(b) == 2 and all((x == y).all() for x, y in zip(a, b, strict=True)), (label, step)
        assert got["biases"].keys() == ref["biases"].keys()
        for name, bias in ref["biases"].items():
            assert (got["biases"][name] == bias).all(), f"{label}: {name} {got['biases'][name]} vs {bias}"
        assert param_error(got, ref) <= FLOAT64_TOL["grad_tol"], f"{label}: params after 5 steps differ"


def test_router_health_formatting():
    import torch

    from ndparallel.train.progress import format_router_health, router_health

    loads = [torch.tensor([2.0, 2.0, 2.0, 2.0]), torch.tensor([1.0, 5.0, 1.0, 1.0])]
    assert router_health(loads) == {"imbalance": 2.5, "per_router": [1.0, 2.5], "dropped": 0}  # the worst: 5 / 2
    assert router_health([]) is None
    assert format_router_health({"imbalance": 2.5, "dropped": 0}) == "2.50 max/mean, 0 dropped"


def test_train_progress_shows_router_health_and_rate_moves_training(group):
    """The progress line's ``experts`` field (and the metrics file's) is the step's global imbalance; a rate of 0
    is off: the first step is the same, the second (routed with the moved bias) differs."""
    results, tmp = group
    rank0 = results[0]["loop"]
    lines = [line for line in rank0["stdout"].splitlines() if line.startswith("step ")]
    shown = [re.search(r"experts (\d+\.\d\d) max/mean, 0 dropped", line) for line in lines]
    assert len(lines) == 2 and all(shown), rank0["stdout"]
    metrics = [json.loads(line) for line in (tmp / "on.jsonl").read_text().splitlines()]
    for match, record in zip(shown, metrics, strict=True):
        assert record["dropped_tokens"] == 0 and record["expert_imbalance"] >= 1.0
        per_router = record["expert_imbalance_per_router"]  # tiny-moe: both blocks are MoE
        assert len(per_router) == 2 and max(per_router) == record["expert_imbalance"], record
        assert float(match.group(1)) == pytest.approx(record["expert_imbalance"], abs=0.005)
    assert results[1]["loop"]["stdout"] == "", "rank 0 only"
    on, off = rank0["losses"], results[0]["loop_off"]["losses"]
    assert on[0] == off[0] and abs(on[1] - off[1]) > 1e-8, (on, off)


def test_a_nan_router_stops_every_rank_naming_the_router(group):
    """A router whose logits turn NaN (here its weight) makes the loss NaN: every rank stops at that step with one
    line that names the router, under ep 2 (no rank hangs in the all-to-all)."""
    for rank, per_rank in enumerate(group[0]):
        message = per_rank["nan_router"]
        assert message.startswith("training stopped at step 1"), (rank, message)
        assert "NaN/inf router logits in layers.1.feed_forward.router" in message, (rank, message)
        assert "layers.0" not in message and "\n" not in message, (rank, message)
