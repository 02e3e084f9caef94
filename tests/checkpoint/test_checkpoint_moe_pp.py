"""Checkpoints of a mixture-of-experts pipeline reshard across pp and ep: tiny-moe (4 blocks, aux 0.1, z 0.01)
trained through ``TrainStep`` (what ``ndparallel train`` runs: pp stages built on the meta device) for 2 steps,
saved with :func:`ndparallel.checkpoint.save`, loaded on another layout and trained 2 more steps continues exactly
like one uninterrupted process (float64: losses, grad norms, parameters and sigmoid router biases to 1e-10; the
routers' tokens per expert, integers, equal).

Every layout runs the same 2 micro-batches a step (pp's micro-batches, or accumulation 2): the balancing loss uses
each micro-batch's token fractions, so micro-batch m must hold the same sequences everywhere (``_order``).

One 4-rank spawned group: saved on pp 2 x dp_shard 2 (softmax router) and on pp 2 x dp_shard 2 x ep 2 (sigmoid
router, its balancing bias moving); the latter loaded on the same layout, on pp 2 x dp_shard 2 (no ep) and on
ep 2 x ep_fsdp 2 (no pp), and a one-process checkpoint loaded on pp 2 x ep 2. The one-process reference, its save
and the one-process loads of both 4-rank checkpoints run in the pytest process. A load without the optimizer
state, and one whose router biases are reset after loading (a bias left out of the checkpoint), must differ, so
the checks can fail. Every run also checks that the routers' buffers start at zero: stages built on the meta
device used to start them from uninitialised memory (a token count of 47.0002 where one process has 47).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.checkpoint.test_resharding import _full, errors
from tests.parallel.pipeline.test_aux_loss import BATCH, BIAS_RATE, MAX_NORM, MICRO, MOE, TOL, _batches

SAVED_AT, STEPS = 2, 4
PP2 = {"pp_size": 2, "dp_shard_size": 2}
PP2_EP2 = {"pp_size": 2, "dp_shard_size": 2, "ep_size": 2}
EP2 = {"dp_shard_size": 4, "ep_size": 2}  # ep 2 x ep_fsdp 2, no pp
SAVES = {"pp2 softmax": (PP2, "softmax"), "pp2xep2 sigmoid": (PP2_EP2, "sigmoid")}
# label: (saved as, loaded on)
RESUMES = {
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


def run(
    parallel: dict | None,
    router: str,
    *,
    seed: int = 0,
    start: int = 0,
    stop: int = STEPS,
    load: str | None = None,
    load_optimizer: bool = True,
    save: str | None = None,
    reset_bias: bool = False,
) -> dict[str, Any]:
    """Build tiny-moe from ``seed`` on ``parallel`` (None: one process; pp: stages from the meta device), optionally
    load ``load``, run TrainSteps ``[start, stop)`` in ``MICRO`` micro-batches (AdamW, clip 0.5, the sigmoid
    router's bias rate), optionally save after step ``SAVED_AT``. Returns losses (global), grad norms, router
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
    rate = BIAS_RATE if router == "sigmoid" else 0.0
    step = TrainStep(target, optimizers if pipeline else optimizers[0], mesh, max_grad_norm=MAX_NORM,
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
        if save is not None and index + 1 == SAVED_AT:
            ckpt.save(save, saved_model, saved_optimizer, step=SAVED_AT)
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


def _group(root: str) -> dict[str, Any]:
    """On every rank of 4: the saving runs (steps 1-2), then every resume (steps 3-4)."""
    torch.set_num_threads(1)
    started = time.perf_counter()
    saved = {
        label: run(parallel, router, stop=SAVED_AT, save=f"{root}/{label}")
        for label, (parallel, router) in SAVES.items()
    }
    resumed = {
        label: run(parallel, _router(source), seed=7, start=SAVED_AT, load=f"{root}/{source}")
        for label, (source, parallel) in RESUMES.items()
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


MEASURED: dict[str, dict[str, float]] = {}  # printed: pytest -s


def _errors(got: dict, ref: dict, first: int) -> dict[str, float]:
    """test_checkpoint_ep's ``errors``; a softmax router has no bias (``bias`` 0)."""
    if ref["biases"]:
        return errors(got, ref, first)
    none = {"(no bias)": np.zeros(1)}
    return errors({**got, "biases": none}, {**ref, "biases": none}, first)


def _check(got: dict, ref: dict, label: str, first: int) -> None:
    """Exact against ``ref``'s steps ``first``..: every parameter and bias present, within ``TOL``; loads equal."""
    assert got["params"].keys() == ref["params"].keys() and got["biases"].keys() == ref["biases"].keys(), label
    MEASURED[label] = err = _errors(got, ref, first)
    assert all(v <= TOL for v in err.values()), f"{label}: {err}"
    assert got["loads"] == ref["loads"][first:], label
    assert len(got["losses"]) == STEPS - first, label


@pytest.mark.slow
def test_moe_pipeline_checkpoints_reshard_across_pp_and_ep_and_resume_exactly(tmp_path):
    from ndparallel.testing import run_distributed

    torch.set_num_threads(1)
    refs = {router: run(None, router) for router in ("softmax", "sigmoid")}  # one process, 4 steps
    assert any(np.abs(b).max() > 0 for b in refs["sigmoid"]["biases"].values()), "the router bias must move"
    assert not refs["softmax"]["biases"] and len(refs["sigmoid"]["biases"]) == MOE["n_layers"]
    # the one-process save (steps 1-2 again, saved) that pp 2 x ep 2 loads
    single = run(None, "sigmoid", stop=SAVED_AT, save=str(tmp_path / "one process sigmoid"))
    assert single["losses"] == refs["sigmoid"]["losses"][:SAVED_AT]
    results = run_distributed(_group, 4, str(tmp_path), timeout=600, threads_per_rank=1)
    print(f"4-rank group: {max(r['seconds'] for r in results):.1f} s")

    for label, (parallel, router) in SAVES.items():
        got = _merged([r["saved"][label] for r in results])
        assert got["losses"] == pytest.approx(refs[router]["losses"][:SAVED_AT], abs=TOL), label
        assert got["loads"] == refs[router]["loads"][:SAVED_AT], label
        assert all(r["saved"][label]["experts"] == _expert_dims(parallel) for r in results), label
    for label, (source, parallel) in RESUMES.items():
        got = _merged([r["resumed"][label] for r in results])
        _check(got, refs[_router(source)], label, SAVED_AT)
        assert all(r["resumed"][label]["experts"] == _expert_dims(parallel) for r in results), label

    # World 1: one process, no pp, from each 4-rank checkpoint.
    for label, (_, router) in SAVES.items():
        got = run(None, router, seed=7, start=SAVED_AT, load=str(tmp_path / label))
        _check(got, refs[router], f"{label} -> one process", SAVED_AT)
    # The checks can fail: a fresh AdamW, or the router biases reset after loading, is another trajectory.
    pp_ep = str(tmp_path / "pp2xep2 sigmoid")
    for label, kwargs in (("optimizer not loaded", {"load_optimizer": False}), ("bias reset", {"reset_bias": True})):
        got = run(None, "sigmoid", seed=7, start=SAVED_AT, load=pp_ep, **kwargs)
        MEASURED[f"pp2xep2 sigmoid -> one process, {label}"] = err = _errors(got, refs["sigmoid"], SAVED_AT)
        assert err["param"] > 1e-6, (label, err)
    for label, err in MEASURED.items():
        print(f"{label:48s} " + "  ".join(f"{k} {v:.1e}" for k, v in err.items()))
