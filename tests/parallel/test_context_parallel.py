"""Context parallel on the whole model vs one process, in float64 (losses over 3 AdamW steps, grad norms,
step-1 gradients within 1e-10): cp 2 with both rotate methods, with and without load balancing, cp 4, and
cp combined with FSDP, TP and activation checkpointing (the 3-D dp_shard x cp x tp shape runs in
tests/parallel/test_parallelize.py's 8-rank group); plus the context manager's in-place sharding, the module swap,
the positions derived for a model called without them, and the ConfigErrors."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from ndparallel.errors import ConfigError
from ndparallel.parallel.loss import cross_entropy_loss
from ndparallel.testing import run_distributed
from tests.parity import NO_CLIP, adamw, assert_parity, build_model, full_grads, make_batches, reference, run_many

STEPS = 3
DATA = {"lr": 1e-2, "global_batch": 8, "seq_len": 32}  # explicit, so the hand-written loop below matches
F64 = {"dtype": "float64"}
BF16_LOSS_TOL = 2e-2  # bf16 parameters/compute vs the fp32 reference (as in tests/parallel/test_parallelize.py)


def cp_loss(model, tokens, labels, mesh):
    """parity.train_steps' loss hook: shard tokens, labels and positions over cp, mean over local tokens.
    backward runs after the block, so the buffers stay sharded (no_restore) for autograd's saved tensors."""
    from ndparallel.parallel.context_parallel import context_parallel, make_positions

    positions = make_positions(tokens)
    buffers = [tokens, labels, positions]
    with context_parallel(mesh, buffers, seq_dims=[1, 1, 0], no_restore=buffers):
        return cross_entropy_loss(model(tokens, positions), labels)


def cp_loss_as_users_write_it(model, tokens, labels, mesh):
    """The same loss as users often write it: tokens and labels as overlapping views of one tensor, labels
    listed twice (Accelerate's ``labels`` / ``shift_labels`` are one object), no positions (derived)."""
    from ndparallel.parallel.context_parallel import context_parallel

    data = torch.cat([tokens, labels[:, -1:]], dim=1)
    tokens, labels = data[:, :-1], data[:, 1:]
    buffers = [tokens, labels, labels]
    with context_parallel(mesh, buffers, seq_dims=[1, 1, 1], no_restore=buffers):
        return cross_entropy_loss(model(tokens), labels)


def _run(parallel: dict, dtype: str = "float64", loss_fn=cp_loss, **kwargs) -> tuple[dict, dict]:
    return parallel, {"steps": STEPS, "loss_fn": loss_fn, "dtype": dtype, **DATA, **kwargs}


RUNS = {
    2: {
        "cp2": _run({"cp_size": 2}),
        "cp2_allgather_unbalanced": _run({"cp_size": 2, "cp_rotate_method": "allgather", "cp_load_balance": False}),
        "cp2_ring_unbalanced": _run({"cp_size": 2, "cp_load_balance": False}),
        # bf16 kernels vs the fp32 reference; compared at BF16_LOSS_TOL
        "cp2_bf16": _run({"cp_size": 2, "mixed_precision": "bf16"}, dtype="float32"),
    },
    4: {
        # derived positions (head-tail over 4 ranks), overlapping views and a buffer listed twice: exact too
        "cp4_users_loss": _run({"cp_size": 4}, loss_fn=cp_loss_as_users_write_it),
        "dp_shard2_cp2_users_loss": _run({"dp_shard_size": 2, "cp_size": 2}, loss_fn=cp_loss_as_users_write_it),
        "cp2_tp2": _run({"cp_size": 2, "tp_size": 2}),
        "dp_shard2_cp2_allgather_ac": _run(
            {"dp_shard_size": 2, "cp_size": 2, "cp_rotate_method": "allgather", "activation_checkpointing": "full"}
        ),
    },
}


# ------------------------------------------------------------------ cp 2 by hand (no parallelize)


def manual_cp_training(steps: int = STEPS, lr: float = DATA["lr"]) -> dict:
    """apply_context_parallel alone (float64), gradients averaged over the cp group by hand; same model, data
    and optimizer (AdamW, weight decay 0.1) as tests.parity.train_steps, so its single-process reference applies."""
    import ndparallel as ndp
    from ndparallel.parallel.context_parallel import apply_context_parallel

    torch.manual_seed(0)
    mesh = ndp.init_distributed(ndp.ParallelismConfig(cp_size=dist.get_world_size()))
    model = apply_context_parallel(build_model(seed=0, dtype="float64"), mesh, mesh.config)
    optimizer = adamw(model.parameters(), lr=lr, weight_decay=0.1)
    group = mesh["cp"].get_group()
    result = {"losses": [], "grad_norms": [], "dtype": "float64"}
    batches = make_batches(steps, DATA["global_batch"], DATA["seq_len"], model.config.vocab_size, 1)
    for step, (tokens, labels) in enumerate(batches):
        loss = cp_loss(model, tokens, labels, mesh)
        loss.backward()
        for param in model.parameters():
            dist.all_reduce(param.grad, group=group)
            param.grad /= mesh.size("cp")
        dist.all_reduce(loss := loss.detach(), group=group)
        result["losses"].append(loss.item() / mesh.size("cp"))
        if step == 0:
            result["grads"] = full_grads(model)
        result["grad_norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), NO_CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
    result["ring_modules"] = sum(type(m).__name__ == "RingAttention" for m in model.modules())
    return result


# ---------------------------------------------------------- the context manager and module swap


def api_checks() -> dict:
    import ndparallel as ndp
    from ndparallel.parallel.context_parallel import (
        RingAttention,
        apply_context_parallel,
        context_parallel,
        sequence_indices,
    )

    mesh = ndp.init_distributed(ndp.ParallelismConfig(cp_size=2))
    rank = mesh.local_rank("cp")
    out: dict = {"errors": {}}
    tokens = torch.arange(24).view(2, 12)
    labels = tokens + 100
    keep = tokens.clone()
    with context_parallel(mesh, [tokens, labels], seq_dims=[1, 1], no_restore=[labels]):
        idx = sequence_indices(12, 2, rank, load_balance=True)
        out["sharded"] = tokens.shape == (2, 6) and torch.equal(tokens, keep[:, idx])
    out["restored"] = torch.equal(tokens, keep)
    out["not_restored"] = labels.shape == (2, 6) and torch.equal(labels, keep[:, idx] + 100)
    one = ndp.init_distributed(ndp.ParallelismConfig(dp_shard_size=2))  # cp 1: both calls are no-ops
    with context_parallel(one, [tokens], seq_dims=[1]):
        out["noop"] = torch.equal(tokens, keep)
    model = build_model()
    out["cp1_model_unchanged"] = apply_context_parallel(model, one, one.config) is model and not any(
        isinstance(m, RingAttention) for m in model.modules()
    )

    def error(name, fn):
        with pytest.raises(ConfigError) as err:
            fn()
        out["errors"][name] = str(err.value)

    def enter(m, buffers, dims):
        with context_parallel(m, buffers, seq_dims=dims):
            pass

    error("seq_len", lambda: enter(mesh, [torch.zeros(2, 10)], [1]))
    error("seq_len_unbalanced", lambda: enter(_mesh(cp_size=2, cp_load_balance=False), [torch.zeros(2, 9)], [1]))
    error("lengths_differ", lambda: enter(mesh, [torch.zeros(2, 8), torch.zeros(12)], [1, 0]))
    error("dims_count", lambda: enter(mesh, [torch.zeros(2, 8)], [1, 0]))
    error("mask", lambda: RingAttention(mesh["cp"], mask="sliding_window"))
    ring = RingAttention(mesh["cp"])
    q = torch.zeros(1, 4, 2, 4)
    error("attn_mask", lambda: ring(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool)))
    error("no_attention", lambda: apply_context_parallel(torch.nn.Linear(2, 2), mesh, mesh.config))
    torch_cfg = mesh.config.with_overrides({"cp_backend": "torch"})
    error("torch_backend_model", lambda: apply_context_parallel(build_model(), mesh, torch_cfg))
    error("torch_backend_buffers", lambda: enter(_mesh(cp_size=2, cp_backend="torch"), [torch.zeros(2, 8)], [1]))
    unbalanced = mesh.config.with_overrides({"cp_load_balance": False})
    error("cfg_vs_mesh", lambda: ndp.parallelize(build_model(), unbalanced, mesh))
    # A tensor listed twice is sharded once; overlapping views shard exactly here, are refused by torch's backend.
    twice = torch.arange(24).view(2, 12)
    with context_parallel(mesh, [twice, twice], seq_dims=[1, 1]):
        out["twice_shape"] = tuple(twice.shape)
    out["twice_restored"] = torch.equal(twice, keep)
    error("twice_other_dim", lambda: enter(mesh, [twice, twice], [1, 0]))
    data = torch.arange(26).view(2, 13)
    views = [data[:, :-1], data[:, 1:]]
    with context_parallel(mesh, views, seq_dims=[1, 1]):
        out["views"] = torch.equal(views[0], keep[:, idx] // 12 + keep[:, idx]) and torch.equal(views[1] - 1, views[0])
    error("views_torch", lambda: enter(_mesh(cp_size=2, cp_backend="torch"), views, [1, 1]))
    # The reference model called without positions: derived inside context_parallel, refused outside.
    model = apply_context_parallel(build_model(dtype="float64"), mesh, mesh.config)
    full = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    tokens, positions = full.clone(), torch.arange(16)
    with torch.no_grad(), context_parallel(mesh, [tokens, positions], seq_dims=[1, 0]):
        out["derived_positions"] = torch.equal(model(tokens), model(tokens, positions))
        error("positions_unsharded", lambda: model(tokens, torch.arange(16)))
    error("positions_outside", lambda: model(full[:, :8]))
    named = apply_context_parallel(build_model(), mesh, mesh.config, targets=["layers.0.attention.core_attention"])
    out["swapped"] = [type(layer.attention.core_attention).__name__ for layer in named.layers]
    return out


def _mesh(**fields):
    import ndparallel as ndp

    return ndp.init_distributed(ndp.ParallelismConfig(**fields))


def two_rank_job() -> dict:
    return {"api": api_checks(), "manual": manual_cp_training(), "runs": run_many(list(RUNS[2].values()))}


@functools.cache
def _results(world_size: int):
    if world_size == 2:
        return run_distributed(two_rank_job, 2, timeout=600)
    return run_distributed(run_many, world_size, list(RUNS[world_size].values()), timeout=600)


@functools.cache
def _reference(dtype: str = "float64") -> dict:
    return reference(steps=STEPS, max_norm=None, dtype=dtype, **DATA)


# -------------------------------------------------------------------------------------------- tests


def test_context_manager_and_module_swap():
    api = _results(2)[0]["api"]
    assert api["sharded"] and api["restored"] and api["not_restored"] and api["noop"]
    assert api["cp1_model_unchanged"]
    assert api["swapped"] == ["RingAttention", "RingAttention"]
    errors = api["errors"]
    assert "buffer 0 sequence length 10 is not divisible by 2 x cp_size = 4" in errors["seq_len"]
    assert "sequence length 9 is not divisible by cp_size=2" in errors["seq_len_unbalanced"]
    assert "different sequence lengths [8, 12]" in errors["lengths_differ"]
    assert "1 buffers but 2 seq_dims" in errors["dims_count"]
    assert "mask='sliding_window'" in errors["mask"] and "attn_mask" in errors["attn_mask"]
    assert "no CoreAttention" in errors["no_attention"]
    assert "cfg.cp_load_balance=False differs from the mesh's True" in errors["cfg_vs_mesh"]
    for key in ("torch_backend_model", "torch_backend_buffers"):
        assert "cp_backend='torch' needs CUDA" in errors[key]
    assert api["twice_shape"] == (2, 6) and api["twice_restored"], "a tensor listed twice is sharded once"
    assert "same tensor as an earlier buffer but with seq dim 0" in errors["twice_other_dim"]
    assert api["views"], "overlapping views are sharded exactly by ndparallel's backend"
    assert "overlapping memory" in errors["views_torch"] and ".clone()" in errors["views_torch"]
    assert api["derived_positions"], "positions derived inside context_parallel equal the explicit global ones"
    assert "positions has 16 entries but each rank holds 8" in errors["positions_unsharded"]
    assert "called without positions outside ndparallel.context_parallel" in errors["positions_outside"]


def test_cp2_by_hand_matches_one_process():
    for rank, got in enumerate(r["manual"] for r in _results(2)):
        assert got["ring_modules"] == 2
        assert_parity(got, _reference(), label=f"manual cp2 rank {rank}")


def _check_runs(labels, per_rank) -> None:
    for i, label in enumerate(labels):
        for rank, runs in enumerate(per_rank):
            if label.endswith("bf16"):
                dloss = max(abs(a - b) for a, b in zip(runs[i]["losses"], _reference("float32")["losses"], strict=True))
                assert dloss <= BF16_LOSS_TOL, f"{label} rank {rank}: max |dloss| {dloss:.3g}"
            else:
                assert runs[i]["dtype"] == "float64", label
                assert_parity(runs[i], _reference(), label=f"{label} rank {rank}")


# The 4-rank group (cp 4, cp composed with dp_shard and tp) is `slow`: the fast tier keeps cp 2's variants
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_parallelize_with_cp_matches_one_process(world_size):
    results = _results(world_size)
    _check_runs(list(RUNS[world_size]), [r["runs"] for r in results] if world_size == 2 else results)


@pytest.mark.slow  # as the 8-rank group's own parity test: the fast tier keeps cp's 2-rank group above
def test_dp_shard2_cp2_tp2_matches_one_process():
    """The 8-rank shape, trained in tests/parallel/test_parallelize.py's 8-rank group (one spawn for both files)."""
    from tests.parallel.test_parallelize import RUNS_8, results
    from tests.parallel.test_parallelize import STEPS as PARALLELIZE_STEPS

    assert RUNS_8["dp_shard2_cp2_tp2"][1]["loss_fn"].__name__ == "context_parallel_loss_fn"
    assert PARALLELIZE_STEPS == STEPS
    _check_runs(["dp_shard2_cp2_tp2"], [[r] for r in results(8)["dp_shard2_cp2_tp2"]])
