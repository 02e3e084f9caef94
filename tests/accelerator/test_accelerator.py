"""Accelerator: a hand-written loop with accumulation on dp_shard 2 x tp 2 and on pure data parallel
equals one process (losses, clipped grad norms, step-1 gradients), and save_state/load_state resumes.

The pure data-parallel run steps the optimizer on every micro-batch, as Accelerate scripts do (the prepared
optimizer skips the steps while gradients accumulate); both runs write their full weights with save_model
and get_state_dict, which must equal the one-process weights, and check main_process_first's order.

Mixture of experts: a hand-written Accelerate loop over tiny-moe (4 blocks, aux 0.1, z 0.01) equals one plain
PyTorch process, in float64, on real gloo ranks. Under pp the model call runs the pipeline step: every stage's
router aux loss reaches the backward and ``outputs.loss`` (``ndparallel/parallel/pipeline/aux_loss.py``), so the
loop is the dense one. Without pp the loop adds ``ndparallel.auxiliary_loss(model)`` to its cross entropy. Either
way it calls ``update_router_biases(model, rate)`` after ``optimizer.step()`` (under pp the prepared model walks
every stage's routers). The balancing loss uses each forward's token fractions, so the reference runs the
pipeline's micro-batches: micro-batch m of every dp rank (``[4m, 4m + 4)`` of the global batch, given the
loader's sample ``r + dp i`` order), the cross entropy a token sum over the global batch's valid tokens. One
4-rank group: pp 2 x dp_shard 2 (softmax router, ``-100`` labels spread unevenly), pp 2 x dp_shard 2 x ep 2
(sigmoid router, its bias moving; the run saves its state after step 2 and a fresh model, optimizer and
scheduler resume step 3 from it) and ep 2 x ep_fsdp 2 without pp (sigmoid router). Losses, clipped norms,
router loads (integers, equal) and the final parameters and biases (``get_state_dict``) to 1e-10; a loop that
forgets the bias update, or (without pp) the aux loss, differs, so the checks can fail. The loop under pp
alone (schedules, tied weights, Hugging Face models): tests/accelerator/test_pipeline.py."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ndparallel.testing import run_distributed

STEPS = 5


def _loop(sizes: dict, accumulation: int, batch_size: int, out: str, resume: bool, every_micro_batch=False) -> dict:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import ndparallel as ndp
    from ndparallel.accelerator import Accelerator
    from ndparallel.models import Transformer, TransformerConfig

    acc = Accelerator(
        ndp.ParallelismConfig(**sizes),
        gradient_accumulation_steps=accumulation,
        device_type="cpu",
        log_with="jsonl",
        project_dir=out,
    )
    acc.init_trackers("run", config={"accumulation": accumulation})
    data = torch.randint(0, 256, (64, 17), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(data), batch_size=batch_size, shuffle=False)

    def fresh():
        model = Transformer(TransformerConfig.from_preset("tiny"))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)  # built before prepare
        return acc.prepare(model, optimizer)

    model, optimizer = fresh()
    loader = acc.prepare(loader)
    losses, norms, seen = [], [], []
    batches = iter(loader)
    for step in range(STEPS):
        total = torch.zeros(())
        for _ in range(accumulation):
            (window,) = next(batches)
            seen.append(acc.gather_for_metrics(window[:, 0]))
            with acc.accumulate(model):
                loss = ndp.cross_entropy_loss(model(window[:, :-1]), window[:, 1:])
                acc.backward(loss)
                total += loss.detach() / accumulation
                if acc.sync_gradients:
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), 0.5)))
                    if step == 0:
                        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
                if every_micro_batch:  # Accelerate's pattern: the prepared optimizer skips non-sync steps
                    optimizer.step()
                    optimizer.zero_grad()
        assert acc.sync_gradients
        if not every_micro_batch:
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(acc.reduce(total, "mean")))
        acc.log({"loss": losses[-1]}, step=step)
        if resume and step == 2:
            acc.save_state(f"{out}/ckpt", note="after step 3")
    weights = _saved_weights(acc, model, f"{out}/weights")
    resumed = []
    if resume:
        acc._models.clear()
        acc._optimizers.clear()
        model, optimizer = fresh()
        state = acc.load_state(f"{out}/ckpt")
        assert state["note"] == "after step 3"
        batches = iter(loader)
        for _ in range(3 * accumulation):
            next(batches)
        for _ in range(3, STEPS):
            total = torch.zeros(())
            for _ in range(accumulation):
                (window,) = next(batches)
                with acc.accumulate(model):
                    loss = ndp.cross_entropy_loss(model(window[:, :-1]), window[:, 1:])
                    acc.backward(loss)
                    total += loss.detach() / accumulation
            acc.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
            resumed.append(float(acc.reduce(total, "mean")))
    acc.get_tracker("jsonl").log({"done": 1})  # every rank calls it; the others get a tracker that does nothing
    acc.end_training()
    seen = torch.cat(seen).tolist()
    return {"losses": losses, "norms": norms, "grads": grads, "seen": seen, "resumed": resumed, **weights}


def _saved_weights(acc, model, directory: str) -> dict:
    """save_model's file and get_state_dict (full weights on the main process, {} elsewhere), and whether the
    other ranks entered main_process_first after the main process had left it."""
    from pathlib import Path

    from safetensors.torch import load_file

    root = Path(directory)
    from torch.distributed.tensor import DTensor

    from ndparallel.hf import local_region

    state = {k: v.numpy().copy() for k, v in acc.get_state_dict(model).items()}
    local = {n: p.to_local().detach().numpy() for n, p in model.state_dict().items() if isinstance(p, DTensor)}
    regions = {n: local_region(p) for n, p in model.state_dict().items() if isinstance(p, DTensor)}
    acc.save_model(model, root)
    with acc.main_process_first():
        if acc.is_main_process:
            (root / "main-was-here").write_text("")
        main_first = (root / "main-was-here").exists()
    saved = {k: v.numpy() for k, v in load_file(root / "model.safetensors").items()}
    # Rank 0's own shards, found at their place in the gathered tensors: the gather is exact.
    shards_match = all(np.array_equal(state[n][regions[n]], local[n]) for n in local) if state else None
    return {"state_dict": state, "saved": saved, "main_first": main_first, "shards_match": shards_match}


def _full(tensor):
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().numpy().copy()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    # One process, no accumulation, the whole global batch (2 dp ranks x 2 micro x 2) at once.
    return run_distributed(_loop, 1, {}, 1, 8, str(tmp_path_factory.mktemp("reference")), False)[0]


@pytest.mark.parametrize(
    "world, sizes, every_micro_batch",
    [(4, {"dp_shard_size": 2, "tp_size": 2}, False), (2, {"dp_replicate_size": 2}, True)],
    ids=["2d", "replicate-accelerate-style"],
)
def test_accelerator_with_accumulation_matches_one_process(reference, tmp_path, world, sizes, every_micro_batch):
    results = run_distributed(_loop, world, sizes, 2, 2, str(tmp_path), True, every_micro_batch)
    for rank, got in enumerate(results):
        assert max(abs(a - b) for a, b in zip(got["losses"], reference["losses"], strict=True)) <= 1e-5, rank
        assert got["norms"] == pytest.approx(reference["norms"], rel=1e-5)
        for name, grad in reference["grads"].items():
            assert np.abs(got["grads"][name] - grad).max() <= 1e-5, (rank, name)
        # Resumed from the step-3 checkpoint, steps 4-5 repeat the uninterrupted run.
        assert got["resumed"] == pytest.approx(got["losses"][3:], abs=1e-6)
    assert reference["norms"][0] > 0.5, "clipping must be active for the test to mean anything"
    # Every sample is seen exactly once per epoch slice: gathered over dp, not the world.
    assert sorted(results[0]["seen"]) == sorted(reference["seen"])
    # Full weights after 5 steps: written by rank 0 only, equal to the one-process weights.
    main = results[0]
    assert main["state_dict"].keys() == reference["state_dict"].keys() == main["saved"].keys()
    assert main["shards_match"] is not False
    for name, weight in reference["state_dict"].items():
        # AdamW turns fp32 rounding of near-zero gradients (rare tokens' embedding rows) into lr-sized steps:
        # measured 6.5e-5 after 5 steps at lr 1e-2 on one CPU, 5.04e-4 on an AVX-512 Xeon; a misplaced shard
        # would be off by ~5e-2.
        assert np.abs(main["state_dict"][name] - weight).max() <= 2e-3, name
        assert np.array_equal(main["saved"][name], main["state_dict"][name]), name
    assert all(r["state_dict"] == {} for r in results[1:])
    assert all(r["main_first"] for r in results)
    # The JSONL tracker: written by the main process only, one line per log call.
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": i, "loss": loss} for i, loss in enumerate(main["losses"])] + [{"done": 1}]


# ----------------------------------------------------------------------------- mixture of experts: pp, pp x ep, ep

TOL = 1e-10  # float64
MOE_STEPS, BATCH, SEQ, MICRO, MAX_NORM, RATE = 3, 8, 8, 2, 0.5, 0.01
MOE = dict(preset="tiny-moe", n_layers=4, aux_loss_coef=0.1, z_loss_coef=0.01, dtype="float64", seed=0)
OPTIM = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
# label: (parallelism, router, ignored labels)
CASES = {
    "pp2": ({"pp_size": 2, "dp_shard_size": 2, "pp_microbatches": MICRO}, "softmax", True),
    "pp2 x ep2": ({"pp_size": 2, "dp_shard_size": 2, "ep_size": 2, "pp_microbatches": MICRO}, "sigmoid", True),
    "ep2 (no pp)": ({"dp_shard_size": 4, "ep_size": 2}, "sigmoid", False),
}


def _model(router: str, seed: int = 0):
    from ndparallel.models import Transformer, TransformerConfig

    return Transformer(TransformerConfig.from_dict({**MOE, "router": router, "seed": seed}))


def _data(ignored: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and next-token labels for every step (global batch k = rows 8k..8k+7); ``ignored``: ~30% of the
    labels -100, and one sequence entirely."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (MOE_STEPS * BATCH, SEQ), generator=g)
    labels = torch.randint(0, 256, (MOE_STEPS * BATCH, SEQ), generator=g)
    if ignored:
        labels[torch.rand(labels.shape, generator=g) < 0.3] = -100
        labels[3] = -100
    return tokens, labels


def _schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))


def moe_reference(router: str, micro: int, ignored: bool, *, aux: bool = True, rate: float = RATE) -> dict[str, Any]:
    """Plain PyTorch, one process: each global batch in ``micro`` contiguous micro-batches (cross entropy summed
    over the batch's valid tokens, aux loss averaged over the micro-batches), clip, AdamW, the bias update."""
    from ndparallel.models.transformer.moe import router_loads, update_router_biases
    from ndparallel.parallel.loss import auxiliary_loss

    model = _model(router)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False, **OPTIM)
    scheduler = _schedule(optimizer)
    tokens, labels = _data(ignored)
    out: dict[str, Any] = {"losses": [], "norms": [], "loads": []}
    for step in range(MOE_STEPS):
        x, y = (t[step * BATCH : (step + 1) * BATCH] for t in (tokens, labels))
        valid = int((y != -100).sum())
        total = 0.0
        for xm, ym in zip(x.chunk(micro), y.chunk(micro), strict=True):
            logits = model(xm)
            loss = F.cross_entropy(logits.flatten(0, 1), ym.flatten(), ignore_index=-100, reduction="sum") / valid
            extra = auxiliary_loss(model)
            loss = loss + extra / micro if aux else loss
            loss.backward()
            total += loss.item()
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        out["loads"].append([load.tolist() for load in router_loads(model)])
        update_router_biases(model, rate if router == "sigmoid" else 0.0)
        out["losses"].append(total)
    out["final"] = {n: t.detach().clone() for n, t in model.state_dict().items()}
    return out


def _loads(model: Any) -> list[list[float]]:
    """Every router's tokens per expert this step, in block order, on every rank (under pp gathered over pp)."""
    import torch.distributed as dist

    from ndparallel.accelerator.pipeline import PipelineModel
    from ndparallel.models.transformer.moe import Router

    mine = [(name, m.tokens_per_expert.tolist()) for name, m in _named_modules(model) if isinstance(m, Router)]
    if not isinstance(model, PipelineModel):
        return [load for _, load in mine]
    every: list = [None] * dist.get_world_size(model.pipeline.pp_group)
    dist.all_gather_object(every, mine, group=model.pipeline.pp_group)
    layer = lambda item: int(item[0].split(".")[1])  # layers.<i>.feed_forward.router
    return [load for _, load in sorted({n: (n, v) for rank in every for n, v in rank}.values(), key=layer)]


def _named_modules(model: Any) -> list[tuple[str, torch.nn.Module]]:
    stages = getattr(model, "stages", [model])
    return [item for stage in stages for item in stage.named_modules()]


def _train_moe(acc: Any, case: str, ckpt: str, resume: bool = False) -> dict[str, Any]:
    """The Accelerate loop on this rank over the global batches (``resume``: load ``ckpt``, then step 3)."""
    from torch.utils.data import DataLoader, TensorDataset

    from ndparallel.accelerator.pipeline import PipelineModel
    from ndparallel.models.transformer.moe import update_router_biases
    from ndparallel.parallel.loss import auxiliary_loss

    parallel, router, ignored = CASES[case]
    pp = parallel.get("pp_size", 1) > 1
    seed = 3 if resume else 0  # resumed: the weights come from the checkpoint
    if pp:
        with torch.device("meta"):  # no rank allocates a block it does not hold
            model = _model(router, seed)
    else:
        model = _model(router, seed)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False, **{**OPTIM, "lr": 0.5 if resume else 1e-2})
    scheduler = _schedule(optimizer)
    loader = DataLoader(TensorDataset(*_data(ignored)), batch_size=BATCH, shuffle=False)
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
    assert isinstance(model, PipelineModel) == pp
    fresh = all(not b.any() for n, m in _named_modules(model) for b in m.buffers(recurse=False) if "router" in n)
    start = 0
    if resume:
        acc.load_state(ckpt)
        start = 2
    out: dict[str, Any] = {"losses": [], "norms": [], "loads": [], "fresh": fresh}
    for step, (x, y) in enumerate(loader):
        if step < start:
            continue
        model.train()
        with acc.accumulate(model):
            if pp:  # forward and backward of every micro-batch; every stage's aux loss is in outputs.loss
                loss = model(x, shift_labels=y).loss
            else:
                logits = model(x)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) + auxiliary_loss(model)
            acc.backward(loss)
        norm = acc.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        out["loads"].append(_loads(model))
        update_router_biases(model, RATE if router == "sigmoid" else 0.0)
        out["losses"].append((loss if pp else acc.reduce(loss.detach(), "mean")).item())
        out["norms"].append(norm.item())
        if step == 1 and case == "pp2 x ep2" and not resume:
            acc.save_state(ckpt)
    out["final"] = acc.get_state_dict(model)  # full tensors on rank 0, {} elsewhere
    acc._models.clear()
    acc._optimizers.clear()
    acc._schedulers.clear()
    return out


def _moe_group(root: str) -> dict[str, Any]:
    from ndparallel import Accelerator, ParallelismConfig

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for case, (parallel, _, _) in CASES.items():
        started = time.perf_counter()
        acc = Accelerator(
            ParallelismConfig(**parallel), split_batches=True, use_seedable_sampler=True
        )  # rank r: rows r, r + dp ...
        out[case] = _train_moe(acc, case, f"{root}/state")
        if case == "pp2 x ep2":
            out["pp2 x ep2, resumed"] = _train_moe(acc, case, f"{root}/state", resume=True)
        out[case]["seconds"] = time.perf_counter() - started
    return out


def _differences(got: dict, ref: dict, first: int = 0) -> dict[str, float]:
    final = got["final"]
    assert final.keys() == ref["final"].keys(), sorted(set(final) ^ set(ref["final"]))
    return {
        "loss": max(abs(a - b) for a, b in zip(got["losses"], ref["losses"][first:], strict=True)),
        "norm": max(abs(a - b) / b for a, b in zip(got["norms"], ref["norms"][first:], strict=True)),
        "final": max((final[n] - ref["final"][n]).abs().max().item() for n in final),
    }


@pytest.mark.slow  # one 4-rank group
def test_moe_accelerate_loop_matches_one_process(tmp_path):
    torch.set_num_threads(1)
    results = run_distributed(_moe_group, 4, str(tmp_path), timeout=600, threads_per_rank=1)
    measured: dict[str, dict[str, float]] = {}
    for label in [*CASES, "pp2 x ep2, resumed"]:
        parallel, router, ignored = CASES[label.split(",")[0]]
        micro = MICRO if parallel.get("pp_size", 1) > 1 else 1
        ref = moe_reference(router, micro, ignored)
        first = 2 if label.endswith("resumed") else 0
        for rank, got in enumerate(r[label] for r in results):
            assert got["fresh"], (label, rank)  # router counts and biases start at zero (stages built on meta)
            assert got["loads"] == ref["loads"][first:], (label, rank)
            if rank == 0:
                measured[label] = diff = _differences(got, ref, first)
                assert all(v <= TOL for v in diff.values()), (label, diff)
                if router == "sigmoid":
                    assert any(t.abs().max() > 0 for n, t in got["final"].items() if n.endswith("expert_bias"))
            else:
                assert got["final"] == {} and got["losses"] == results[0][label]["losses"], (label, rank)
        print(f"{label:20s}", {k: f"{v:.1e}" for k, v in measured[label].items()}, f"{got.get('seconds', 0):.1f} s")
    # The checks can fail: the reference without the bias update, or without the aux loss, is another run.
    no_bias = _differences(results[0]["pp2 x ep2"], moe_reference("sigmoid", MICRO, True, rate=0.0))
    no_aux = _differences(results[0]["ep2 (no pp)"], moe_reference("sigmoid", 1, False, aux=False))
    assert no_bias["final"] > 1e-6 and no_aux["loss"] > 1e-4, (no_bias, no_aux)
