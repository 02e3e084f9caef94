"""Pure data parallel (apply_replicate): parity with one process on real gloo ranks.

Every scenario trains the tiny Transformer with AdamW for ``STEPS`` float64 steps on the same
global batches as a single-process reference built from the same seed, and compares the
loss at every step and every parameter's gradient at every step (tolerance 1e-10). Ranks build
their model from a DIFFERENT seed (``seed=rank``): parity then also proves that
``apply_replicate`` broadcast the first rank's weights.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ndparallel.errors import ConfigError
from ndparallel.models import Transformer, TransformerConfig
from ndparallel.testing import run_distributed

STEPS = 4  # even and odd steps alternate the unused parameter's presence: 4 steps show both twice
GLOBAL_BATCH = 4
SEQ = 32
TOL = 1e-10  # float64 (measured ~1e-16); fp32 smoke runs live in tests/parallel/test_fp32_smoke.py


class WithUnused(nn.Module):
    """The tiny Transformer plus ``extra`` (used only for masked rows, so on some ranks/steps only)
    and ``never`` (never used: its gradient must stay None, as in one process)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.model = Transformer(cfg)
        self.extra = nn.Linear(cfg.vocab_size, 1)
        self.never = nn.Linear(2, 2)
        with torch.no_grad():
            generator = torch.Generator().manual_seed(cfg.seed + 100)
            for p in (*self.extra.parameters(), *self.never.parameters()):
                p.normal_(0.0, 0.02, generator=generator)

    def forward(self, tokens: torch.Tensor, extra_rows: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens)
        if extra_rows.any():  # only then is `extra` part of the graph
            logits = logits + self.extra(logits) * extra_rows[:, None, None].to(logits.dtype)
        return logits


def _build(kind: str, seed: int) -> nn.Module:
    cfg = TransformerConfig.from_preset("tiny", seed=seed, dtype="float64")
    return WithUnused(cfg).double() if kind == "unused" else Transformer(cfg)


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=generator) for _ in range(STEPS)]


def _extra_rows(step: int, rows: slice) -> torch.Tensor:
    """``extra`` is used on even steps for the first half of the global batch (rank 0 of 2), never on odd steps."""
    mask = torch.zeros(GLOBAL_BATCH, dtype=torch.bool)
    if step % 2 == 0:
        mask[: GLOBAL_BATCH // 2] = True
    return mask[rows]


def _loss(model: nn.Module, kind: str, data: torch.Tensor, step: int, rows: slice) -> torch.Tensor:
    tokens, labels = data[rows, :-1], data[rows, 1:]
    logits = model(tokens, _extra_rows(step, rows)) if kind == "unused" else model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


# Results travel back from ranks as numpy arrays: torch tensors would be passed through shared-memory
# file descriptors that vanish when the rank process exits.
def _full(t: torch.Tensor) -> np.ndarray:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().numpy().copy()


def _grads(model: nn.Module) -> dict[str, np.ndarray | None]:
    return {name: None if p.grad is None else _full(p.grad) for name, p in model.named_parameters()}


def _params(model: nn.Module) -> dict[str, np.ndarray]:
    return {name: _full(p) for name, p in model.named_parameters()}


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # foreach=False: under tensor parallelism the model mixes DTensor and plain parameters.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def reference(kind: str) -> dict:
    """One process, whole global batch, one backward per step."""
    model = _build(kind, seed=0)
    opt = _optimizer(model)
    losses, grads = [], []
    for step, data in enumerate(_batches()):
        if kind == "unused":  # same math as the ranks: mean over the two halves' means
            halves = [slice(0, GLOBAL_BATCH // 2), slice(GLOBAL_BATCH // 2, GLOBAL_BATCH)]
            loss = sum(_loss(model, kind, data, step, h) for h in halves) / 2
        else:
            loss = _loss(model, kind, data, step, slice(None))
        loss.backward()
        losses.append(loss.item())
        grads.append(_grads(model))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads}


def train_replicated(model: nn.Module, kind: str, mode: str, dp_rank: int, dp_size: int, dp_group) -> dict:
    """Train a replicated model on this rank's slice of each global batch.

    ``mode``: ``plain`` (one backward), ``accum`` (two micro-batches, the first under no_sync),
    ``two_backward`` (two micro-batches, both synchronising).
    """
    from ndparallel.parallel.replicate import no_sync

    opt = _optimizer(model)
    per_rank = GLOBAL_BATCH // dp_size
    losses, grads, local_sums = [], [], []
    for step, data in enumerate(_batches()):
        rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        if mode == "plain":
            loss = _loss(model, kind, data, step, rows)
            loss.backward()
            total = loss.detach()
        else:
            half = per_rank // 2
            first, second = slice(rows.start, rows.start + half), slice(rows.start + half, rows.stop)
            if mode == "accum":
                with no_sync(model):
                    loss_a = _loss(model, kind, data, step, first) / 2
                    loss_a.backward()
                # No communication inside no_sync: each rank holds its own micro-batch's gradient.
                local_sums.append(sum(float(p.grad.sum()) for p in model.parameters() if p.grad is not None))
            else:
                loss_a = _loss(model, kind, data, step, first) / 2
                loss_a.backward()
            loss_b = _loss(model, kind, data, step, second) / 2
            loss_b.backward()
            total = (loss_a + loss_b).detach()
        dist.all_reduce(total, group=dp_group)
        losses.append(total.item() / dp_size)
        grads.append(_grads(model))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "params": _params(model), "local_sums": local_sums}


def _failed_backward(model: nn.Module) -> None:
    """A backward that raises near its end (after most buckets went out), on every rank."""

    def fail(_grad: torch.Tensor) -> None:
        raise RuntimeError("boom")

    def arm(_module: nn.Module, _args: tuple, out: torch.Tensor) -> None:
        out.register_hook(fail)

    handle = model.tok_embeddings.register_forward_hook(arm)
    tokens = _batches()[0][:1, :-1]
    try:
        model(tokens).sum().backward()
    except RuntimeError as err:
        assert "boom" in str(err)
    else:
        raise AssertionError("backward should have raised")
    handle.remove()
    model.zero_grad(set_to_none=True)


def _two_rank_checks() -> dict:
    import ndparallel as ndp
    from ndparallel.parallel.replicate import apply_replicate, no_sync, replicate_state

    rank = dist.get_rank()
    mesh = ndp.init_distributed(ndp.ParallelismConfig(dp_replicate_size=2))
    dp = mesh["dp_replicate"]
    out = {}
    for name, kind, mode, bucket_mb in [
        ("dp2", "plain", "plain", 25.0),
        ("accum", "plain", "accum", 25.0),
        ("two_backward", "plain", "two_backward", 0.05),
        ("unused", "unused", "plain", 0.05),
        ("after_error", "plain", "plain", 0.05),
        ("meta_init", "plain", "plain", 0.05),
    ]:
        if name == "meta_init":  # replicated on the meta device, then materialised with the same seed
            with torch.device("meta"):
                model = apply_replicate(_build(kind, seed=0), dp, bucket_mb=bucket_mb)
            model.to_empty(device="cpu")
            model.init_weights()
        else:
            model = apply_replicate(_build(kind, seed=rank), dp, bucket_mb=bucket_mb)
        if name == "after_error":
            _failed_backward(model)
        result = train_replicated(model, kind, mode, dp.get_local_rank(), 2, dp.get_group())
        result["n_buckets"] = len(replicate_state(model).buckets)
        out[name] = result if rank == 0 else {"params": result["params"], "local_sums": result["local_sums"]}
    errors = {}
    for label, call in {
        "bucket_zero": lambda: apply_replicate(_build("plain", 0), dp, bucket_mb=0),
        "twice": lambda: apply_replicate(apply_replicate(_build("plain", 0), dp), dp),
        "no_sync_plain": lambda: no_sync(_build("plain", 0)).__enter__(),
        "mesh_2d": lambda: apply_replicate(_build("plain", 0), mesh["dp_replicate", "tp"]),
    }.items():
        try:
            call()
            errors[label] = None
        except ConfigError as err:
            errors[label] = str(err)
    out["errors"] = errors
    return out


def _four_rank_checks() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import ndparallel as ndp
    from ndparallel.parallel.replicate import apply_replicate, replicate_state

    rank = dist.get_rank()
    out = {}
    # dp_replicate 4, small buckets: several all-reduces in flight during backward.
    mesh = ndp.init_distributed(ndp.ParallelismConfig(dp_replicate_size=4))
    dp = mesh["dp_replicate"]
    model = apply_replicate(_build("plain", seed=rank), dp, bucket_mb=0.02)
    result = train_replicated(model, "plain", "plain", dp.get_local_rank(), 4, dp.get_group())
    result["n_buckets"] = len(replicate_state(model).buckets)
    out["dp4"] = result if rank == 0 else {"params": result["params"]}

    # Tensor parallel inside each replica (DTensor parameters), replicated over 2.
    mesh = ndp.init_distributed(ndp.ParallelismConfig(dp_replicate_size=2, tp_size=2))
    model = _build("plain", seed=mesh.local_rank("dp_replicate"))  # tp ranks of one replica agree
    plan = {}
    for i in range(len(model.layers)):
        plan.update({f"layers.{i}.attention.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")})
        plan.update({f"layers.{i}.feed_forward.{n}": ColwiseParallel() for n in ("w1", "w3")})
        plan[f"layers.{i}.attention.wo"] = RowwiseParallel()
        plan[f"layers.{i}.feed_forward.w2"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    dp = mesh["dp_replicate"]
    model = apply_replicate(model, dp, bucket_mb=0.02)
    result = train_replicated(model, "plain", "plain", dp.get_local_rank(), 2, dp.get_group())
    result["n_dtensor"] = sum(isinstance(p, DTensor) for p in model.parameters())
    out["tp2_dp2"] = result if rank == 0 else {"params": result["params"]}
    return out


def _assert_parity(got: dict, ref: dict, label: str) -> None:
    dloss = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True))
    assert dloss <= TOL, f"{label}: max |dloss| {dloss:.3g}: {got['losses']} vs {ref['losses']}"
    for step, (g_step, r_step) in enumerate(zip(got["grads"], ref["grads"], strict=True)):
        assert g_step.keys() == r_step.keys(), label
        for name, r in r_step.items():
            g = g_step[name]
            if r is None or g is None:
                assert r is None and g is None, f"{label} step {step}: {name} grad None on one side only"
                continue
            diff = float(np.abs(g - r).max())
            assert diff <= TOL, f"{label} step {step}: gradient of {name} differs by {diff:.3g}"


def _assert_ranks_equal(results: list[dict], label: str) -> None:
    for rank, result in enumerate(results[1:], start=1):
        for name, p in results[0][label]["params"].items():
            assert np.array_equal(p, result[label]["params"][name]), f"{label}: rank {rank} diverged on {name}"


@pytest.fixture(scope="module")
def refs() -> dict:
    return {"plain": reference("plain"), "unused": reference("unused")}


def test_replicate_two_ranks(refs):
    results = run_distributed(_two_rank_checks, 2, timeout=120)
    rank0 = results[0]
    # after_error: a backward that raised midway must not break the averaging of the next steps.
    for label, kind in [
        ("dp2", "plain"),
        ("accum", "plain"),
        ("two_backward", "plain"),
        ("unused", "unused"),
        ("after_error", "plain"),
        ("meta_init", "plain"),
    ]:
        _assert_parity(rank0[label], refs[kind], label)
        _assert_ranks_equal(results, label)
    sums = [r["accum"]["local_sums"] for r in results]
    assert len(sums[0]) == STEPS and all(a != b for a, b in zip(*sums, strict=True)), "no_sync must not communicate"
    assert rank0["dp2"]["n_buckets"] == 1
    assert rank0["unused"]["n_buckets"] > 2
    # `never` got no gradient anywhere; `extra` only on even steps.
    unused_grads = rank0["unused"]["grads"]
    assert all(g["never.weight"] is None for g in unused_grads)
    assert [g["extra.weight"] is not None for g in unused_grads] == [s % 2 == 0 for s in range(STEPS)]
    errors = rank0["errors"]
    assert "bucket_mb=0" in errors["bucket_zero"]
    assert "already replicated" in errors["twice"]
    assert "not replicated" in errors["no_sync_plain"]
    assert "1-D DeviceMesh" in errors["mesh_2d"]


def test_replicate_four_ranks_and_tensor_parallel(refs):
    results = run_distributed(_four_rank_checks, 4, timeout=180)
    rank0 = results[0]
    _assert_parity(rank0["dp4"], refs["plain"], "dp4")
    assert rank0["dp4"]["n_buckets"] >= 4
    _assert_ranks_equal(results, "dp4")
    _assert_parity(rank0["tp2_dp2"], refs["plain"], "tp2_dp2")
    assert rank0["tp2_dp2"]["n_dtensor"] == 2 * 7  # wq wk wv wo w1 w3 w2 per layer
    _assert_ranks_equal(results, "tp2_dp2")


@pytest.mark.parametrize("bad", [0, -1.0, "25", True, math.nan, math.inf, None])
def test_bad_bucket_mb(bad):
    from ndparallel.parallel.replicate import apply_replicate

    with pytest.raises(ConfigError, match="bucket_mb"):
        apply_replicate(_build("plain", 0), None, bucket_mb=bad)  # checked before the mesh is touched


def test_bad_mesh_and_no_sync_without_replicate():
    from ndparallel.parallel.replicate import apply_replicate, no_sync

    with pytest.raises(ConfigError, match="dp_replicate"):
        apply_replicate(_build("plain", 0), None)
    with pytest.raises(ConfigError, match="not replicated"):
        with no_sync(_build("plain", 0)):
            pass


def test_bucket_assignment():
    from ndparallel.distributed.buckets import assign_buckets

    params = [torch.zeros(10), torch.zeros(10), torch.zeros(30), torch.zeros(5, dtype=torch.float64), torch.zeros(1)]
    # cap 80 bytes = 20 fp32: [10,10] | [30] alone (larger than the cap) | float64 | [1]
    assert assign_buckets(params, 80) == [[0, 1], [2], [3], [4]]
