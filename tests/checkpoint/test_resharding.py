"""Mixture-of-experts checkpoints reshard across layouts: a tiny-moe model (its sigmoid router's balancing bias
moving) + AdamW trained, saved with :func:`ndparallel.checkpoint.save`, loaded on another layout and trained on
continues exactly like one uninterrupted process (float64, losses, grad norms, parameters and router biases to
1e-10; measured in docs/checkpointing.md and docs/expert-parallel.md). One 4-rank spawned group per layout:

* ep: tiny-moe trained 3 steps, saved on ep 2 x ep_fsdp 2 (experts S(0) over ``ep``, their FSDP over
  ``ep_fsdp``), on plain FSDP dp_shard 4 and on ep 2 x tp 2 (experts also split over tp); loaded on ep 4,
  FSDP 4, ep 2 and ep 2 x tp 2, 2 more steps. The world-1 loads run in the pytest process.
* pp x ep: tiny-moe (4 blocks, aux 0.1, z 0.01) trained through ``TrainStep`` (what ``ndparallel train`` runs:
  pp stages built on the meta device) for 2 steps, saved on pp 2 x dp_shard 2 (softmax router) and on pp 2 x
  dp_shard 2 x ep 2 (sigmoid router); the latter loaded on the same layout, on pp 2 x dp_shard 2 (no ep) and on
  ep 2 x ep_fsdp 2 (no pp), and a one-process checkpoint loaded on pp 2 x ep 2; 2 more steps, the routers'
  tokens per expert (integers) equal too. Every layout runs the same 2 micro-batches a step (pp's
  micro-batches, or accumulation 2): the balancing loss uses each micro-batch's token fractions, so micro-batch
  m must hold the same sequences everywhere (``_order``). Every run also checks that the routers' buffers start
  at zero: stages built on the meta device used to start them from uninitialised memory (a token count of
  47.0002 where one process has 47).

A load that skips the optimizer state (AdamW's moments and step restart), and one whose router biases are reset
after loading (a bias left out of the checkpoint), must differ, so the checks can fail. Dense resharding:
test_checkpoint.py; several pipeline stages per rank, across pp sizes: test_rank_state.py.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.parallel.pipeline.test_aux_loss import BATCH, MICRO, MOE, TOL, _batches
from tests.parallel.pipeline.test_aux_loss import BIAS_RATE as PP_BIAS_RATE
from tests.parallel.pipeline.test_aux_loss import MAX_NORM as PP_MAX_NORM
from tests.parallel.test_moe_parity import BIAS_RATE, SIGMOID, moe_loss_fn
from tests.parity import FLOAT64_TOL, build_model, make_batches

# ----------------------------------------------------------------------------- ep: experts over ep, tp and FSDP

SAVED_AT, STEPS = 3, 5
GLOBAL_BATCH, SEQ, MAX_NORM = 8, 8, 0.5
EP2 = {"dp_shard_size": 4, "ep_size": 2}
EP4 = {"dp_shard_size": 4, "ep_size": 4}
FSDP4 = {"dp_shard_size": 4}
EP2_TP2 = {"dp_shard_size": 2, "tp_size": 2, "ep_size": 2}  # experts over (ep, tp): the hidden width split too
# (saved on, loaded on, load the optimizer state)
RESUMES = {
    "ep2 -> ep4": ("ep2", EP4, True),
    "ep2xtp2 -> ep4": ("ep2xtp2", EP4, True),
    "ep2 -> ep2xtp2": ("ep2", EP2_TP2, True),
    "ep2 -> fsdp4": ("ep2", FSDP4, True),
    "fsdp4 -> ep2": ("fsdp4", EP2, True),
    "fsdp4 -> ep4": ("fsdp4", EP4, True),
    "ep2 -> ep4, optimizer not loaded": ("ep2", EP4, False),
}
SAVES = {"ep2": EP2, "fsdp4": FSDP4, "ep2xtp2": EP2_TP2}


def _full(t: torch.Tensor) -> np.ndarray:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().numpy().copy()


def run(
    parallel: dict | None,
    *,
    seed: int = 0,
    start: int = 0,
    stop: int = STEPS,
    load: str | None = None,
    load_optimizer: bool = True,
    save: str | None = None,
    reset_bias: bool = False,
) -> dict[str, Any]:
    """Build tiny-moe from ``seed`` on ``parallel`` (None: one process, no process group), optionally load ``load``,
    train steps ``[start, stop)`` of the fixed global batches (AdamW, clip 0.5, router bias rate), optionally save
    after step ``SAVED_AT``; losses, pre-clip grad norms, final full parameters, router biases and expert layouts.
    ``reset_bias``: zero the router biases after loading (the bug of a bias buffer left out of the checkpoint)."""
    import ndparallel as ndp
    from ndparallel import checkpoint as ckpt
    from ndparallel.distributed.reduce import average_over
    from ndparallel.models.transformer.moe import update_router_biases
    from ndparallel.parallel.clip import clip_grad_norm_

    torch.manual_seed(seed)
    net = build_model(SIGMOID, seed, "float64")
    mesh, dp_size, dp_rank = None, 1, 0
    if parallel is not None:
        from ndparallel.parallel.parallelize import parallelize

        mesh = ndp.init_distributed(ndp.ParallelismConfig.from_dict(parallel))
        net = parallelize(net, mesh.config, mesh)
        dp_size, dp_rank = mesh.size("dp"), mesh.local_rank("dp")
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.1)
    if load is not None:
        ckpt.load(load, net, optimizer if load_optimizer else None, restore_rng=False)
    if reset_bias:
        for name, buffer in net.named_buffers():
            if name.endswith("expert_bias"):
                buffer.zero_()
    per = GLOBAL_BATCH // dp_size
    mine = slice(dp_rank * per, (dp_rank + 1) * per)
    out: dict[str, Any] = {"losses": [], "grad_norms": []}
    batches = make_batches(STEPS, GLOBAL_BATCH, SEQ, net.config.vocab_size)
    for step in range(start, stop):
        tokens, labels = batches[step]
        loss = moe_loss_fn(net, tokens[mine], labels[mine], mesh)
        loss.backward()
        out["losses"].append(average_over(mesh["dp_cp"] if mesh else None, loss.detach()))
        out["grad_norms"].append(clip_grad_norm_(net.parameters(), MAX_NORM).item())
        optimizer.step()
        update_router_biases(net, BIAS_RATE)
        optimizer.zero_grad()
        if save is not None and step + 1 == SAVED_AT:
            out["path"] = ckpt.save(save, net, optimizer, step=SAVED_AT)
    out["params"] = {n: _full(p) for n, p in net.named_parameters()}
    out["biases"] = {n: _full(b) for n, b in net.named_buffers() if n.endswith("expert_bias")}
    w1 = net.get_submodule("layers.0.feed_forward.experts").w1
    out["experts"] = (
        (w1.device_mesh.mesh_dim_names, tuple(map(str, w1.placements))) if isinstance(w1, DTensor) else None
    )
    return out


def _group(root: str) -> dict[str, Any]:
    """On every rank: the two saving runs (3 steps kept going to 5), then every resume from the saved step."""
    saved = {label: run(parallel, save=f"{root}/{label}") for label, parallel in SAVES.items()}
    resumed = {
        label: run(parallel, seed=7, start=SAVED_AT, load=f"{root}/{source}", load_optimizer=load_optimizer)
        for label, (source, parallel, load_optimizer) in RESUMES.items()
    }
    return {"saved": saved, "resumed": resumed}


def errors(got: dict, ref: dict, first: int = 0) -> dict[str, float]:
    """Max |dloss|, max relative grad-norm difference (steps ``first``.. of ``ref``), max |dparam|, max |dbias|."""
    return {
        "loss": max(abs(a - b) for a, b in zip(got["losses"], ref["losses"][first:], strict=True)),
        "norm": max(abs(a - b) / b for a, b in zip(got["grad_norms"], ref["grad_norms"][first:], strict=True)),
        "param": max(float(np.abs(got["params"][k] - v).max()) for k, v in ref["params"].items()),
        "bias": max(float(np.abs(got["biases"][k] - v).max()) for k, v in ref["biases"].items()),
    }


MEASURED: dict[str, dict[str, float]] = {}  # the worst error per label over the ranks (printed: pytest -s)


def _exact(got: dict, ref: dict, label: str, first: int) -> None:
    assert got["params"].keys() == ref["params"].keys() and got["biases"].keys() == ref["biases"].keys(), label
    err = errors(got, ref, first)
    key = label.split(", rank")[0]
    MEASURED[key] = {k: max(v, MEASURED.get(key, {}).get(k, 0.0)) for k, v in err.items()}
    tol = FLOAT64_TOL["loss_tol"]
    assert all(v <= tol for v in err.values()), f"{label}: {err}"


@pytest.mark.slow
def test_checkpoint_reshards_across_expert_parallel(tmp_path):
    from ndparallel.testing import run_distributed

    ref = run(None)  # one process, 5 steps uninterrupted
    assert any(np.abs(b).max() > 0 for b in ref["biases"].values()), "the router bias must move"
    results = run_distributed(_group, 4, str(tmp_path), timeout=900)
    for rank, per_rank in enumerate(results):
        for label, got in per_rank["saved"].items():
            _exact(got, ref, f"saved on {label}, rank {rank}", 0)
        dims, placements = per_rank["saved"]["ep2"]["experts"]  # ep_fsdp: a strided shard of what ep leaves
        assert dims == ("ep_fsdp", "ep") and placements[-1] == "S(0)" and "Replicate()" not in placements
        assert per_rank["saved"]["fsdp4"]["experts"] == (("dp_shard_cp",), ("S(0)",))
        assert per_rank["saved"]["ep2xtp2"]["experts"][0] == ("ep_fsdp", "ep", "tp")
        for label, (_, parallel, load_optimizer) in RESUMES.items():
            got = per_rank["resumed"][label]
            dims = ("ep_fsdp", "ep") if "ep_size" in parallel else ("dp_shard_cp",)
            dims += ("tp",) * ("tp_size" in parallel)
            assert got["experts"][0] == dims, (label, got["experts"])  # loaded on the layout it names
            if load_optimizer:
                _exact(got, ref, f"{label}, rank {rank}", SAVED_AT)
            else:  # a fresh AdamW (step 1, zero moments) is another trajectory: the checks above can fail
                MEASURED[label] = errors(got, ref, SAVED_AT)
                assert MEASURED[label]["param"] > 1e-6, label
    # World 1: one process, no process group, from each 4-rank checkpoint.
    for label in SAVES:
        single = run(None, seed=7, start=SAVED_AT, load=str(tmp_path / label))
        _exact(single, ref, f"{label} -> one process", SAVED_AT)
    unbiased = run(None, seed=7, start=SAVED_AT, load=str(tmp_path / "ep2"), reset_bias=True)
    MEASURED["ep2 -> one process, bias reset"] = errors(unbiased, ref, SAVED_AT)
    assert MEASURED["ep2 -> one process, bias reset"]["param"] > 1e-6, "the saved router bias must matter"
    for label, err in MEASURED.items():
        print(f"{label:34s} " + "  ".join(f"{k} {v:.1e}" for k, v in err.items()))


# ----------------------------------------------------------------------------- pp x ep: a MoE pipeline

PP_SAVED_AT, PP_STEPS = 2, 4
PP2 = {"pp_size": 2, "dp_shard_size": 2}
PP2_EP2 = {"pp_size": 2, "dp_shard_size": 2, "ep_size": 2}
PP_SAVES = {"pp2 softmax": (PP2, "softmax"), "pp2xep2 sigmoid": (PP2_EP2, "sigmoid")}
# label: (saved as, loaded on)
PP_RESUMES = {
    "pp2xep2 sigmoid -> pp2xep2": ("pp2xep2 sigmoid", PP2_EP2),
    "pp2xep2 sigmoid -> pp2": ("pp2xep2 sigmoid", PP2),
    "pp2xep2 sigmoid -> ep2 (no pp)": ("pp2xep2 sigmoid", EP2),
    "one process sigmoid -> pp2xep2": ("one process sigmoid", PP2_EP2),
}


def _order(dp: int) -> list[int]:
    """Rows of the global batch such that dp rank r's contiguous slice, cut in ``MICRO`` micro-batches, gives
    micro-batch m the rows of the one process's micro-batch m (rows ``[m B/M, (m+1) B/M)``)."""
    micro, per = BATCH // MICRO, BATCH // MICRO // dp
    return [m * micro + r * per + i for r in range(dp) for m in range(MICRO) for i in range(per)]


def run_pipeline(
    parallel: dict | None,
    router: str,
    *,
    seed: int = 0,
    start: int = 0,
    stop: int = PP_STEPS,
    load: str | None = None,
    load_optimizer: bool = True,
    save: str | None = None,
    reset_bias: bool = False,
) -> dict[str, Any]:
    """Build tiny-moe from ``seed`` on ``parallel`` (None: one process; pp: stages from the meta device), optionally
    load ``load``, run TrainSteps ``[start, stop)`` in ``MICRO`` micro-batches (AdamW, clip 0.5, the sigmoid
    router's bias rate), optionally save after step ``PP_SAVED_AT``. Returns losses (global), grad norms, router
    loads, this rank's full parameters and router biases, and where the experts live."""
    import ndparallel as ndp
    from ndparallel import checkpoint as ckpt
    from ndparallel.distributed.reduce import average_over
    from ndparallel.models import Transformer, TransformerConfig
    from ndparallel.parallel.parallelize import parallelize
    from ndparallel.parallel.pipeline import build_pipeline
    from ndparallel.train.step import TrainStep

    config = TransformerConfig.from_dict({**MOE, "router": router, "seed": seed})
    mesh = ndp.init_distributed(ndp.ParallelismConfig(**(parallel or {})))
    pipeline = mesh.size("pp") > 1
    if pipeline:
        with torch.device("meta"):  # as ndparallel train: each rank materialises its own stages only
            whole = Transformer(config)
        target = build_pipeline(whole, mesh.config, mesh, microbatches=MICRO)
        modules = target.stages
    else:
        target = parallelize(Transformer(config), mesh.config, mesh) if parallel else Transformer(config)
        modules = [target]
    routers = [b for m in modules for n, b in m.named_buffers() if "router." in n]  # counts, flags, biases
    fresh = all(not b.any() for b in routers)  # to_empty leaves garbage: init_parameters resets them
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, foreach=False) for m in modules]
    saved_model, saved_optimizer = (modules, optimizers) if pipeline else (modules[0], optimizers[0])
    if load is not None:
        ckpt.load(load, saved_model, saved_optimizer if load_optimizer else None, restore_rng=False)
    if reset_bias:
        for module in modules:
            for name, buffer in module.named_buffers():
                if name.endswith("expert_bias"):
                    buffer.zero_()
    rate = PP_BIAS_RATE if router == "sigmoid" else 0.0
    step = TrainStep(target, optimizers if pipeline else optimizers[0], mesh, max_grad_norm=PP_MAX_NORM,
                     router_bias_rate=rate)  # fmt: skip
    dp, dp_rank = mesh.size("dp"), mesh.local_rank("dp")
    order, per = _order(dp), BATCH // dp
    rows = slice(dp_rank * per, (dp_rank + 1) * per)
    out: dict[str, Any] = {"losses": [], "grad_norms": [], "loads": [], "fresh": fresh and bool(routers)}
    for index, (x, y) in enumerate(_batches(config.vocab_size)):
        if not start <= index < stop:
            continue
        done = step(x[order][rows], y[order][rows], MICRO, index + 1)
        loss = done.loss if pipeline else average_over(mesh["dp_cp"] if dp > 1 else None, done.loss)
        out["losses"].append(float(loss))  # the global mean loss
        out["grad_norms"].append(done.grad_norm)
        out["loads"].append([load.tolist() for load in done.router_loads])
        if save is not None and index + 1 == PP_SAVED_AT:
            ckpt.save(save, saved_model, saved_optimizer, step=PP_SAVED_AT)
    out["params"] = {n: _full(p) for m in modules for n, p in m.named_parameters()}
    out["biases"] = {n: _full(b) for m in modules for n, b in m.named_buffers() if n.endswith("expert_bias")}
    out["experts"] = sorted(
        {
            p.device_mesh.mesh_dim_names
            for m in modules
            for n, p in m.named_parameters()
            if n.endswith("experts.w1") and isinstance(p, DTensor)
        }
    )
    return out


def _pipeline_group(root: str) -> dict[str, Any]:
    """On every rank of 4: the saving runs (steps 1-2), then every resume (steps 3-4)."""
    torch.set_num_threads(1)
    started = time.perf_counter()
    saved = {
        label: run_pipeline(parallel, router, stop=PP_SAVED_AT, save=f"{root}/{label}")
        for label, (parallel, router) in PP_SAVES.items()
    }
    resumed = {
        label: run_pipeline(parallel, _router(source), seed=7, start=PP_SAVED_AT, load=f"{root}/{source}")
        for label, (source, parallel) in PP_RESUMES.items()
    }
    return {"saved": saved, "resumed": resumed, "seconds": time.perf_counter() - started}


def _expert_dims(parallel: dict) -> list[tuple[str, ...]]:
    """The mesh dims of the expert weights on ``parallel`` (each pp stage on the mesh without pp): sharded over
    ``ep`` (their FSDP over ``ep_fsdp``), or, without ep, FSDP-sharded like every other weight."""
    return [("ep_fsdp", "ep")] if parallel.get("ep_size", 1) > 1 else [("dp_shard_cp",)]


def _router(source: str) -> str:
    return source.rsplit(" ", 1)[-1]


def _merged(per_rank: list[dict]) -> dict[str, Any]:
    """One run's results on every rank, with each pp rank's stage parameters and biases merged; the losses,
    norms and loads must be the same on every rank."""
    first = per_rank[0]
    assert all(got["fresh"] for got in per_rank), "router buffers must start at zero"
    for other in per_rank[1:]:
        assert other["losses"] == first["losses"] and other["loads"] == first["loads"]
        assert other["grad_norms"] == first["grad_norms"]
    merged = {**first, "params": {}, "biases": {}}
    for got in per_rank:
        merged["params"].update(got["params"])
        merged["biases"].update(got["biases"])
    return merged


PP_MEASURED: dict[str, dict[str, float]] = {}  # printed: pytest -s


def _errors(got: dict, ref: dict, first: int) -> dict[str, float]:
    """``errors`` above; a softmax router has no bias (``bias`` 0)."""
    if ref["biases"]:
        return errors(got, ref, first)
    none = {"(no bias)": np.zeros(1)}
    return errors({**got, "biases": none}, {**ref, "biases": none}, first)


def _check_pipeline(got: dict, ref: dict, label: str, first: int) -> None:
    """Exact against ``ref``'s steps ``first``..: every parameter and bias present, within ``TOL``; loads equal."""
    assert got["params"].keys() == ref["params"].keys() and got["biases"].keys() == ref["biases"].keys(), label
    PP_MEASURED[label] = err = _errors(got, ref, first)
    assert all(v <= TOL for v in err.values()), f"{label}: {err}"
    assert got["loads"] == ref["loads"][first:], label
    assert len(got["losses"]) == PP_STEPS - first, label


@pytest.mark.slow
def test_moe_pipeline_checkpoints_reshard_across_pp_and_ep_and_resume_exactly(tmp_path):
    from ndparallel.testing import run_distributed

    torch.set_num_threads(1)
    refs = {router: run_pipeline(None, router) for router in ("softmax", "sigmoid")}  # one process, 4 steps
    assert any(np.abs(b).max() > 0 for b in refs["sigmoid"]["biases"].values()), "the router bias must move"
    assert not refs["softmax"]["biases"] and len(refs["sigmoid"]["biases"]) == MOE["n_layers"]
    # the one-process save (steps 1-2 again, saved) that pp 2 x ep 2 loads
    single = run_pipeline(None, "sigmoid", stop=PP_SAVED_AT, save=str(tmp_path / "one process sigmoid"))
    assert single["losses"] == refs["sigmoid"]["losses"][:PP_SAVED_AT]
    results = run_distributed(_pipeline_group, 4, str(tmp_path), timeout=600, threads_per_rank=1)
    print(f"4-rank group: {max(r['seconds'] for r in results):.1f} s")

    for label, (parallel, router) in PP_SAVES.items():
        got = _merged([r["saved"][label] for r in results])
        assert got["losses"] == pytest.approx(refs[router]["losses"][:PP_SAVED_AT], abs=TOL), label
        assert got["loads"] == refs[router]["loads"][:PP_SAVED_AT], label
        assert all(r["saved"][label]["experts"] == _expert_dims(parallel) for r in results), label
    for label, (source, parallel) in PP_RESUMES.items():
        got = _merged([r["resumed"][label] for r in results])
        _check_pipeline(got, refs[_router(source)], label, PP_SAVED_AT)
        assert all(r["resumed"][label]["experts"] == _expert_dims(parallel) for r in results), label

    # World 1: one process, no pp, from each 4-rank checkpoint.
    for label, (_, router) in PP_SAVES.items():
        got = run_pipeline(None, router, seed=7, start=PP_SAVED_AT, load=str(tmp_path / label))
        _check_pipeline(got, refs[router], f"{label} -> one process", PP_SAVED_AT)
    # The checks can fail: a fresh AdamW, or the router biases reset after loading, is another trajectory.
    pp_ep = str(tmp_path / "pp2xep2 sigmoid")
    for label, kwargs in (("optimizer not loaded", {"load_optimizer": False}), ("bias reset", {"reset_bias": True})):
        got = run_pipeline(None, "sigmoid", seed=7, start=PP_SAVED_AT, load=pp_ep, **kwargs)
        PP_MEASURED[f"pp2xep2 sigmoid -> one process, {label}"] = err = _errors(got, refs["sigmoid"], PP_SAVED_AT)
        assert err["param"] > 1e-6, (label, err)
    for label, err in PP_MEASURED.items():
        print(f"{label:48s} " + "  ".join(f"{k} {v:.1e}" for k, v in err.items()))
