"""parallelize() on every mesh shape reproduces one process: losses, grad norms, step-1 gradients (gloo ranks).

The tables run in float64 (parameters, activations, gradients, reductions and the reference), held to
``tests.parity.FLOAT64_TOL`` (1e-10): that is the exactness proof. bf16 keeps its own measured bound;
fp32 is a smoke check in tests/parallel/test_fp32_smoke.py. Runs are packed: one spawned group per world size
trains several shapes in turn (see ``tests.parity.run_cached``); tests/bench/test_memory.py reads the same
runs' memory numbers, and the 8-rank group also holds context parallel's 3-D shape
(tests/parallel/test_context_parallel.py checks it).
"""

from __future__ import annotations

import math

import pytest
import torch

from ndparallel.testing import run_distributed
from tests.parity import assert_parity, context_parallel_loss_fn, parity_error, reference, run_cached, train_steps

# 3 AdamW steps: step-1 gradients, then losses and norms after one and two updates (the sharded optimizer
# state and weight decay at work). More steps add time, not proof: float64 holds 1e-15 at every step.
STEPS = 3
CLIP = 0.5  # below the real grad norm (~0.8-1.1 for the tiny model), so clipping is active
F64 = {"dtype": "float64"}
# bf16 parameters/compute vs the fp32 reference (gradients reduce in fp32). Measured on torch 2.13 CPU:
# max |dloss| 1.2e-4, grad-norm rel. error 1.2e-3, step-1 gradient max abs error 1.5e-4.
BF16_TOL = dict(loss_tol=2e-3, norm_rtol=1e-2, grad_tol=2e-3)
CP_DATA = {"lr": 1e-2, "global_batch": 8, "seq_len": 32}  # tests/parallel/test_context_parallel.py's data

# label -> (parallel config, train_steps kwargs). Grouped by world size: one spawn per group.
RUNS_4 = {
    "dp_shard4": ({"dp_shard_size": 4}, F64),
    "tp4_gqa": ({"tp_size": 4}, F64),
    "dp_shard2_tp2_clip_ac": (
        {"dp_shard_size": 2, "tp_size": 2, "activation_checkpointing": "full"},
        {"max_norm": CLIP, **F64},
    ),
    "hsdp2x2_clip_ac_accum2": (
        {"dp_replicate_size": 2, "dp_shard_size": 2, "activation_checkpointing": "selective"},
        {"max_norm": CLIP, "grad_accum": 2, **F64},
    ),
    # HSDP over a (dp_replicate, dp_shard_cp) mesh whose shard dim is the flattened cp dim (ring attention).
    "hsdp2_cp2": ({"dp_replicate_size": 2, "cp_size": 2}, {"loss_fn": context_parallel_loss_fn, **F64}),
    "dp_shard4_bf16": ({"dp_shard_size": 4, "mixed_precision": "bf16", "reshard_after_forward": False}, {}),
    # Pure replicate composed with TP DTensors, with accumulation and clipping.
    "dp_replicate2_tp2_accum2_clip": (
        {"dp_replicate_size": 2, "tp_size": 2},
        {"grad_accum": 2, "max_norm": CLIP, **F64},
    ),
}
RUNS_2 = {
    "tp2": ({"tp_size": 2}, F64),
    "dp_replicate2": ({"dp_replicate_size": 2}, F64),
    "dp_replicate2_accum2_clip": ({"dp_replicate_size": 2}, {"grad_accum": 2, "max_norm": CLIP, **F64}),
    "dp_shard2_cpu_offload": ({"dp_shard_size": 2, "cpu_offload": True}, F64),
}
RUNS_8 = {
    "hsdp2x2_tp2_clip": ({"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2}, {"max_norm": CLIP, **F64}),
    # Context parallel's 3-D shape rides in this group (one 8-rank spawn instead of two).
    "dp_shard2_cp2_tp2": (
        {"dp_shard_size": 2, "cp_size": 2, "tp_size": 2},
        {"loss_fn": context_parallel_loss_fn, **CP_DATA, **F64},
    ),
}
ALL_RUNS = {4: RUNS_4, 2: RUNS_2, 8: RUNS_8}


def _with_steps(runs: dict) -> list:
    return [(parallel, {"steps": STEPS, **kwargs}) for parallel, kwargs in runs.values()]


def results(world_size: int) -> dict[str, list[dict]]:
    """label -> per-rank results for the group of ``world_size`` (spawned once per pytest process)."""
    runs = ALL_RUNS[world_size]
    per_rank = run_cached(world_size, _with_steps(runs))
    return {label: [rank[i] for rank in per_rank] for i, label in enumerate(runs)}


def reference_for(kwargs: dict) -> dict:
    """The single-process run that a parallel run with train_steps ``kwargs`` is compared with."""
    same = {k: v for k, v in kwargs.items() if k in ("max_norm", "dtype", "lr", "global_batch", "seq_len")}
    return reference(steps=STEPS, **{"max_norm": None, **same})


def _check_group(world_size: int) -> None:
    for label, ranks in results(world_size).items():
        parallel, kwargs = ALL_RUNS[world_size][label]
        ref = reference_for(kwargs)
        for rank, got in enumerate(ranks):
            tag = f"{label} rank {rank}"
            sharded = any(parallel.get(f"{d}_size", 1) > 1 for d in ("dp_shard", "cp", "tp"))
            assert got["all_dtensor"] == sharded, f"{tag}: every parameter is a DTensor iff FSDP or TP is on"
            assert list(got["grads"]) == list(ref["grads"]), f"{tag}: FQNs changed"
            if parallel.get("mixed_precision", "no") != "no":
                assert_parity(got, ref, label=tag, max_norm=kwargs.get("max_norm"), **BF16_TOL)
                assert all(v == "torch.float32" for v in got["dtypes"].values()), "sharded params stay fp32"
            else:
                assert got["dtype"] == "float64" and set(got["dtypes"].values()) == {"torch.float64"}, tag
                assert_parity(got, ref, label=tag, max_norm=kwargs.get("max_norm"))
                assert ("clipped_norms" in got) == ("max_norm" in kwargs), tag


def test_parity_4_ranks_fsdp_tp_2d_hsdp_bf16():
    _check_group(4)


def test_parity_2_ranks_tp_and_replicate():
    _check_group(2)


@pytest.mark.slow
def test_parity_8_ranks_hsdp_x_tp():
    _check_group(8)


def test_clipping_is_active_in_clipped_runs():
    ref, clipped = reference(steps=STEPS, max_norm=None, **F64), reference(steps=STEPS, max_norm=CLIP, **F64)
    assert min(ref["grad_norms"]) > CLIP
    assert all(math.isclose(n, CLIP, rel_tol=1e-5) for n in clipped["clipped_norms"])


# ----------------------------------------------------------------------------- API behaviour (2 ranks)
def _api_checks() -> dict:
    import ndparallel as ndp
    from ndparallel.errors import ConfigError
    from ndparallel.parallel.parallelize import parallelize
    from tests.parity import build_model

    out = {}
    # mesh=None: parallelize builds the mesh from cfg (dp_shard fills the world).
    model = build_model()
    names = [n for n, _ in model.named_parameters()]
    returned = parallelize(model, ndp.ParallelismConfig(dp_shard_size=-1))
    out["same_object"] = returned is model
    out["fqns_kept"] = [n for n, _ in model.named_parameters()] == names
    mesh = ndp.init_distributed(ndp.ParallelismConfig(tp_size=2))
    errors = {}
    for label, call in {
        "blocks_compile_tp": lambda: parallelize(
            build_model(), ndp.ParallelismConfig(tp_size=2, compile="blocks"), mesh
        ),
        "cfg_mismatch": lambda: parallelize(build_model(), ndp.ParallelismConfig(dp_shard_size=2), mesh),
        "tp_divides_heads": lambda: parallelize(build_model({"n_heads": 8, "n_kv_heads": 1}), None, mesh),
        "twice": lambda: parallelize(returned, ndp.ParallelismConfig(dp_shard_size=-1)),
    }.items():
        try:
            call()
            errors[label] = None
        except ConfigError as err:
            errors[label] = str(err)
    out["errors"] = errors
    # compile="blocks" refused before anything changed: the model is untouched.
    model = build_model()
    try:
        parallelize(model, ndp.ParallelismConfig(tp_size=2, compile="blocks"), mesh)
    except ConfigError:
        pass
    out["untouched_after_error"] = not any(type(p).__name__ == "DTensor" for p in model.parameters())
    # labels= makes the output projection return the loss: under tp its vocab is sharded, so it is refused
    import torch

    tp_model = parallelize(build_model(), ndp.ParallelismConfig(tp_size=2), mesh)
    tokens = torch.zeros(2, 8, dtype=torch.long)
    try:
        tp_model(tokens, labels=tokens)
        out["labels_under_tp"] = None
    except ValueError as err:
        out["labels_under_tp"] = str(err)
    return out


def test_parallelize_api_on_2_ranks():
    out = run_distributed(_api_checks, 2)[0]
    assert out["same_object"] and out["fqns_kept"]
    assert out["untouched_after_error"]
    errors = out["errors"]
    assert "compile='blocks' with tp_size=2" in errors["blocks_compile_tp"]
    assert "differ from the mesh" in errors["cfg_mismatch"]
    assert errors["tp_divides_heads"] == "tp_size=2 does not divide n_kv_heads=1; choose a tp_size that divides it"
    assert errors["twice"] and "already parallelized" in errors["twice"], errors["twice"]
    assert "under tensor parallelism" in (out["labels_under_tp"] or ""), out["labels_under_tp"]


# ------------------------------------------------------------------------ HSDP mesh with cp > 1 (4 ranks)
def _hsdp_cp_mesh() -> dict:
    import ndparallel as ndp
    from ndparallel.distributed.mesh import _unflatten
    from ndparallel.parallel.fully_shard import fsdp_mesh

    mesh = ndp.init_distributed(ndp.ParallelismConfig(dp_replicate_size=2, cp_size=2))
    dp_mesh = fsdp_mesh(mesh)
    # The path Mesh takes once torch drops flattened-name slicing.
    fallback = _unflatten(mesh["dp_cp"], (2, 2), ("dp_replicate", "dp_shard_cp"))
    # Train a tiny Linear with HSDP over it and compare with the full-batch gradient.
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4, bias=False)
    full_weight = layer.weight.detach().clone()
    from torch.distributed.fsdp import fully_shard

    fully_shard(layer, mesh=dp_mesh)
    data = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(1))
    rank = mesh.local_rank("dp_cp")
    layer(data[rank]).pow(2).mean().backward()
    ref = full_weight.clone().requires_grad_(True)
    torch.stack([(x @ ref.T).pow(2).mean() for x in data]).mean().backward()
    grad = layer.weight.grad.full_tensor()
    return {
        "names": dp_mesh.mesh_dim_names,
        "ranks": dp_mesh.mesh.tolist(),
        "fallback": (fallback.mesh_dim_names, fallback.mesh.tolist()),
        "grad_diff": (grad - ref.grad).abs().max().item(),
    }


def test_hsdp_mesh_with_context_parallel_dims():
    """(dp_replicate, dp_shard_cp) 2-D mesh: replicate groups x flattened shard*cp groups, usable by fully_shard."""
    out = run_distributed(_hsdp_cp_mesh, 4)
    for got in out:
        assert got["names"] == ("dp_replicate", "dp_shard_cp")
        assert got["ranks"] == [[0, 1], [2, 3]]
        assert got["fallback"] == (got["names"], got["ranks"])
        assert got["grad_diff"] < 1e-6


# ---------------------------------------------------------------------------- compile: one small check
def _compiled_model_run() -> dict:
    return train_steps({"compile": "model"}, 1)


@pytest.mark.slow
def test_compile_model_matches_eager_one_rank():
    # fp32: inductor's fused CPU kernels round differently from eager; 1e-5 measured headroom (~1e-7 seen).
    got = run_distributed(_compiled_model_run, 1, timeout=600)[0]
    assert_parity(got, reference(steps=1, max_norm=None), loss_tol=1e-5, norm_rtol=1e-4, grad_tol=1e-5)


def parity_table() -> str:
    """Markdown table of the measured differences (``python -m tests.parallel.test_parallelize``; spawns every
    group)."""
    lines = ["| run | ranks | dtype | max abs dloss | grad-norm rel. | step-1 grad |", "|---|---|---|---|---|---|"]
    for world_size, runs in ALL_RUNS.items():
        for label, ranks in results(world_size).items():
            kwargs = runs[label][1]
            err = max((parity_error(got, reference_for(kwargs)) for got in ranks), key=lambda e: e["dloss"])
            dtype = "bf16" if "bf16" in label else ranks[0]["dtype"]
            lines.append(
                f"| {label} | {world_size} | {dtype} | {err['dloss']:.1e} | {err['dnorm']:.1e} | {err['dgrad']:.1e} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(parity_table())
    from tests.bench.test_memory import format_table, memory_rows

    print(format_table(memory_rows()))


# ------------------------------------------------------------------------- single-process unit checks
def test_find_blocks_default_fqns_and_predicate():
    from torch import nn

    from ndparallel.errors import ConfigError
    from ndparallel.parallel.parallelize import find_blocks
    from tests.parity import build_model

    model = build_model()
    assert find_blocks(model) == list(model.layers)
    assert find_blocks(model, ["layers.1"]) == [model.layers[1]]
    assert find_blocks(model, lambda fqn, m: fqn.endswith("feed_forward")) == [b.feed_forward for b in model.layers]
    with pytest.raises(ConfigError, match="'layers.7' is not a submodule"):
        find_blocks(model, ["layers.7"])
    with pytest.raises(ConfigError, match="no nn.ModuleList"):
        find_blocks(nn.Sequential(nn.Linear(2, 2)))


def test_activation_checkpointing_modes_keep_fqns_and_values():
    from ndparallel.parallel.activation_checkpoint import apply_activation_checkpointing
    from tests.parity import build_model

    model = build_model({"n_layers": 3})
    names = [n for n, _ in model.named_parameters()]
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    expected = model(tokens)
    assert apply_activation_checkpointing(list(model.layers), "selective") == [model.layers[0], model.layers[2]]
    assert apply_activation_checkpointing(list(model.layers), "none") == []
    assert [n for n, _ in model.named_parameters()] == names
    assert torch.equal(model(tokens), expected)
