"""Mixture of experts under pipeline parallel, float64, through ``TrainStep`` (what ``ndparallel train`` runs),
against one process running the same micro-batches (``TrainStep`` with accumulation).

Every stage's router aux loss (balancing + z-loss) must reach the backward and the reported loss, though torch's
schedule backpropagates only the last stage's loss: ``ndparallel/parallel/pipeline/aux_loss.py``. tiny-moe with 4
blocks, aux 0.1, z 0.01, 4 AdamW steps clipped at 0.5, 2 micro-batches: losses, grad norms and parameters to
1e-10, router loads (integers) and sigmoid biases equal. Without the aux injection the step-1 gradients differ
(``aux_dropped``), so the check can fail. 2 ranks: pp 2 under 1f1b, gpipe and interleaved_zb (two stages a rank);
zbv where torch has it; 4 ranks: pp 2 x dp_shard 2 with ep 2 (the sigmoid router, its bias moving), pp 2 x cp 2
and pp 2 x tp 2 (the sigmoid router).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from ndparallel.config.pipeline import torch_supports_v_schedules
from ndparallel.testing import run_distributed

pytestmark = pytest.mark.slow  # two spawned groups, ~15 s

MOE = dict(preset="tiny-moe", n_layers=4, aux_loss_coef=0.1, z_loss_coef=0.01, dtype="float64", seed=0)
STEPS, BATCH, SEQ, MICRO, MAX_NORM, TOL = 4, 8, 8, 2, 0.5, 1e-10
BIAS_RATE = 0.01
# micro-batch m of the one process = micro-batch m of every dp rank (dp 2, 2 micro-batches of 2 rows)
DP2_ORDER = [0, 1, 4, 5, 2, 3, 6, 7]
CASES = {
    2: {
        "pp2 1f1b": ({"pp_size": 2}, "softmax"),
        "pp2 gpipe": ({"pp_size": 2, "pp_schedule": "gpipe"}, "softmax"),
        "pp2 interleaved_zb": ({"pp_size": 2, "pp_schedule": "interleaved_zb"}, "softmax"),
    },
    4: {
        "pp2 x ep2": ({"pp_size": 2, "dp_shard_size": 2, "ep_size": 2}, "sigmoid"),
        "pp2 x cp2": ({"pp_size": 2, "cp_size": 2}, "softmax"),  # ring attention; the counts over the cp ranks
        "pp2 x tp2": ({"pp_size": 2, "tp_size": 2}, "sigmoid"),  # the MoE blocks split over tp in each stage
    },
}
if torch_supports_v_schedules():
    CASES[2]["pp2 zbv"] = ({"pp_size": 2, "pp_schedule": "zbv"}, "softmax")  # both ends of the V on rank 0


def _batches(vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [tuple(torch.randint(0, vocab, (BATCH, SEQ), generator=generator) for _ in range(2)) for _ in range(STEPS)]


def train(
    parallel: dict | None, router: str, order: list[int] | None = None, inject: bool = True, evaluate: bool = False
) -> dict:
    """``STEPS`` TrainSteps of tiny-moe; ``parallel=None``: one process (accumulation ``MICRO``), batches
    reordered by ``order``. ``inject=False``: the pipeline without its aux-loss hooks (the bug). ``evaluate``: a
    pipeline ``eval`` of each batch before its step (torch infers the shapes again at every switch)."""
    import ndparallel as ndp
    from ndparallel.models import Transformer, TransformerConfig
    from ndparallel.parallel.pipeline import build_pipeline
    from ndparallel.parallel.pipeline.runtime import Pipeline
    from ndparallel.train.step import TrainStep

    model = Transformer(TransformerConfig.from_dict({**MOE, "router": router}))  # materialised: ep slices it
    mesh = ndp.init_distributed(ndp.ParallelismConfig(**(parallel or {})))
    rate = BIAS_RATE if router == "sigmoid" else 0.0
    if parallel is None:
        modules, target = [model], model
        optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)]
    else:
        target = build_pipeline(model, mesh.config, mesh, microbatches=MICRO)
        if not inject:
            for handle in target.aux_losses.handles:
                handle.remove()
            target.aux_losses = None
        modules = target.stages
        optimizers = [torch.optim.AdamW(s.parameters(), lr=1e-2, foreach=False) for s in modules]
    step = TrainStep(target, optimizers if len(optimizers) > 1 else optimizers[0], mesh, max_grad_norm=MAX_NORM,
                     router_bias_rate=rate)  # fmt: skip
    dp, dp_rank = mesh.size("dp"), mesh.local_rank("dp")
    per = BATCH // dp
    out: dict = {"losses": [], "norms": [], "loads": [], "eval_losses": []}
    for index, (x, y) in enumerate(_batches(model.config.vocab_size)):
        if order is not None:
            x, y = x[order], y[order]
        rows = slice(dp_rank * per, (dp_rank + 1) * per)
        if evaluate:  # as a user evaluates: the stages in eval mode (routers count nothing there)
            for module in modules:
                module.eval()
            out["eval_losses"].append(float(target.eval(x[rows], y[rows])))
            for module in modules:
                module.train()
        done = step(x[rows], y[rows], MICRO, index + 1)
        out["losses"].append(float(done.loss))  # pp: the global mean; one process: its own
        out["norms"].append(done.grad_norm)
        out["loads"].append([load.tolist() for load in done.router_loads])
    full = {}
    for module in modules:
        for name, param in module.named_parameters():
            value = param.full_tensor() if hasattr(param, "full_tensor") else param
            full[name] = value.detach().numpy().copy()
        for name, buffer in module.named_buffers():
            if name.endswith("expert_bias"):
                full[name] = buffer.detach().numpy().copy()
    out["params"] = full
    out["is_pipeline"] = isinstance(target, Pipeline)
    out["experts"] = {  # under ep: (mesh dims, local rows) of each expert weight this rank holds
        name: (param.device_mesh.mesh_dim_names, param.to_local().shape[0])
        for module in modules
        for name, param in module.named_parameters()
        if name.endswith("experts.w1") and hasattr(param, "device_mesh")
    }
    return out


def gradients_across_an_eval(parallel: dict, preset: str) -> float:
    """A step's backward, then an eval before the optimizer step: the largest change of any gradient (torch's
    eval divides them by the micro-batch count, its shape inference sets FSDP's to None)."""
    import ndparallel as ndp
    from ndparallel.models import Transformer, TransformerConfig
    from ndparallel.parallel.pipeline import build_pipeline

    model = Transformer(TransformerConfig.from_dict({**MOE, "preset": preset}))
    mesh = ndp.init_distributed(ndp.ParallelismConfig(**parallel))
    pipe = build_pipeline(model, mesh.config, mesh, microbatches=MICRO)
    per = BATCH // mesh.size("dp")
    x, y = (t[:per] for t in _batches(model.config.vocab_size)[0])
    pipe.step(x, y)
    before = [p.grad.detach().clone() for p in pipe.parameters()]
    pipe.eval(x, y)
    after = [p.grad for p in pipe.parameters()]
    if any(g is None for g in after):
        return float("inf")
    return max(float((a - b).abs().max()) for a, b in zip(after, before, strict=True))


def run_group(world: int) -> dict:
    runs = {label: train(parallel, router) for label, (parallel, router) in CASES[world].items()}
    parallel = {"pp_size": 2, "dp_shard_size": world // 2}  # world 2: pp 2 alone; 4: with FSDP
    runs["grads across an eval"] = [gradients_across_an_eval(parallel, preset) for preset in ("tiny", "tiny-moe")]
    if world == 2:
        runs["aux dropped"] = train({"pp_size": 2}, "softmax", inject=False)
    else:  # eval between the steps, on the sigmoid router whose bias moves with the counts
        runs["pp2 x ep2, eval between steps"] = train(CASES[4]["pp2 x ep2"][0], "sigmoid", evaluate=True)
    return runs


@pytest.fixture(scope="module")
def groups():
    return {world: run_distributed(functools.partial(run_group, world), world, timeout=600) for world in CASES}


@functools.cache
def reference(router: str, dp: int) -> dict:
    return train(None, router, DP2_ORDER if dp == 2 else None)


def _differences(got: dict, ref: dict, names: list[str]) -> dict[str, float]:
    return {
        "loss": max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True)),
        "norm": max(abs(a - b) / b for a, b in zip(got["norms"], ref["norms"], strict=True)),
        "params": max(float(np.abs(got["params"][n] - ref["params"][n]).max()) for n in names),
    }


@pytest.mark.parametrize("world", sorted(CASES))
def test_moe_under_pp_equals_one_process(groups, world):
    for label, (parallel, router) in CASES[world].items():
        ref = reference(router, parallel.get("dp_shard_size", 1))
        merged: dict = {}
        for per_rank in groups[world]:
            merged.update(per_rank[label]["params"])  # each pp rank holds its stages' names
        assert sorted(merged) == sorted(ref["params"]), label
        for rank, per_rank in enumerate(groups[world]):
            got = {**per_rank[label], "params": merged}
            diff = _differences(got, ref, sorted(ref["params"]))
            if rank == 0:
                print(label, {k: f"{v:.1e}" for k, v in diff.items()})
            assert all(v <= TOL for v in diff.values()), (label, rank, diff)
            assert got["loads"] == ref["loads"], (label, rank)  # every stage's routers, on every rank
            if parallel.get("ep_size", 1) > 1:  # 4 experts over ep 2 (ep_fsdp 1): 2 a rank, no replica
                assert got["experts"] and all(d[-1] == "ep" and r == 2 for d, r in got["experts"].values()), got


def test_evaluating_between_steps_changes_nothing_and_equals_the_loss_before_the_step(groups):
    """Each eval (the loss before the step, on the same weights) equals one process's loss of that step; the
    training beside it is untouched (losses, parameters, router loads and biases)."""
    ref = reference("sigmoid", 2)
    merged = {k: v for per_rank in groups[4] for k, v in per_rank["pp2 x ep2, eval between steps"]["params"].items()}
    for rank, per_rank in enumerate(groups[4]):
        got = {**per_rank["pp2 x ep2, eval between steps"], "params": merged}
        diff = _differences(got, ref, sorted(ref["params"]))
        assert all(v <= TOL for v in diff.values()), (rank, diff)
        assert got["loads"] == ref["loads"], rank
        assert max(abs(a - b) for a, b in zip(got["eval_losses"], ref["losses"], strict=True)) <= TOL, rank


def test_an_eval_between_backward_and_the_optimizer_step_leaves_the_gradients(groups):
    """pp 2 (and pp 2 x dp_shard 2 on 4 ranks), dense and MoE: the gradients after an eval are the step's."""
    for world in CASES:
        for rank, per_rank in enumerate(groups[world]):
            assert per_rank["grads across an eval"] == [0.0] * 2, (world, rank, per_rank["grads across an eval"])


def test_a_pipeline_without_the_aux_injection_differs(groups):
    ref = reference("softmax", 1)
    merged = {k: v for per_rank in groups[2] for k, v in per_rank["aux dropped"]["params"].items()}
    diff = _differences({**groups[2][0]["aux dropped"], "params": merged}, ref, sorted(ref["params"]))
    assert diff["loss"] > 1e-3 and diff["params"] > 1e-6, diff
