"""Checkpoints reshard across expert parallelism: a tiny-moe model (sigmoid router, its balancing bias moving) +
AdamW trained 3 steps, saved with :func:`ndparallel.checkpoint.save`, loaded on another layout and trained 2 more
steps continues exactly like one uninterrupted process (float64, losses, grad norms, parameters and router biases
to 1e-10; measured in docs/checkpointing.md).

One 4-rank spawned group: saved on ep 2 x ep_fsdp 2 (experts S(0) over ``ep``, their FSDP over ``ep_fsdp``), on
plain FSDP dp_shard 4 and on ep 2 x tp 2 (experts also split over tp); loaded on ep 4, FSDP 4, ep 2 and ep 2 x tp 2.
The world-1 loads run in the pytest process. A load that skips the optimizer state (AdamW's moments and step
restart), and one whose router biases are reset after loading, must differ, so the checks can fail.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.parallel.test_moe_parity import BIAS_RATE, SIGMOID, moe_loss_fn
from tests.parity import FLOAT64_TOL, build_model, make_batches

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
