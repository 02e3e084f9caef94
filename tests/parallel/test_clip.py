"""clip_grad_norm_ with gradients on different meshes, mixing Shard/Replicate/Partial DTensors and plain tensors:
float64 gradients give the float64 norm to 1e-12 (fp32 in the norm would show as ~1e-8), and ranks that
disagree on which parameters have gradients get the same error, naming the ranks."""

from __future__ import annotations

import math

import torch

from ndparallel.parallel.clip import clip_grad_norm_
from ndparallel.testing import run_distributed

NORM_TYPES = (2.0, 1.0, 3.0, math.inf)


def _full_grads(dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = [(8, 3), (4, 6), (4, 4), (5,), (6, 2)]
    grads = [torch.randn(s, generator=generator, dtype=dtype) for s in shapes]
    grads[2][1, 2] = 9.0  # the inf-norm lives in a Shard(1) piece on a 2-D mesh
    return grads


def _params_on_meshes(full: list[torch.Tensor]) -> list[torch.Tensor]:
    """Five parameters: Shard(0) on the 1-D world mesh; (Shard(0), Replicate) and (Replicate, Shard(1)) on a
    2x2 mesh; a plain tensor; a Replicate parameter whose gradient is Partial on a 1-D sub-mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    world = init_device_mesh("cpu", (4,), mesh_dim_names=("w",))
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    params = []
    for value, (mesh, placements) in zip(
        full[:3], [(world, [Shard(0)]), (grid, [Shard(0), Replicate()]), (grid, [Replicate(), Shard(1)])], strict=True
    ):
        param = torch.nn.Parameter(distribute_tensor(torch.zeros_like(value), mesh, placements))
        param.grad = distribute_tensor(value.clone(), mesh, placements)
        params.append(param)
    plain = torch.nn.Parameter(torch.zeros_like(full[3]))
    plain.grad = full[3].clone()
    params.append(plain)
    sub = grid["b"]
    weight = (sub.get_local_rank() + 1) / 3.0  # 1/3 + 2/3 = 1: the Partial pieces sum to the full gradient
    partial = torch.nn.Parameter(distribute_tensor(torch.zeros_like(full[4]), sub, [Replicate()]))
    partial.grad = DTensor.from_local(full[4] * weight, sub, [Partial()])
    params.append(partial)
    params.append(torch.nn.Parameter(torch.zeros(3, dtype=full[0].dtype)))  # no gradient: ignored
    assert dist.get_world_size() == 4
    return params


def _full(grad: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _clip_checks() -> dict:
    full = _full_grads()
    out = {}
    for norm_type in NORM_TYPES:
        ref = torch.linalg.vector_norm(torch.cat([g.flatten() for g in full]), norm_type).item()
        params = _params_on_meshes(full)
        unclipped = clip_grad_norm_(params, 1e9, norm_type)
        unchanged = max((_full(p.grad) - g).abs().max().item() for p, g in zip(params, full, strict=False))
        max_norm = ref / 4
        norm = clip_grad_norm_(params, max_norm, norm_type)
        coef = max_norm / (ref + 1e-6)
        clipped_err = max((_full(p.grad) - g * coef).abs().max().item() for p, g in zip(params, full, strict=False))
        after = clip_grad_norm_(params, 1e9, norm_type).item()
        out[norm_type] = dict(
            ref=ref,
            unclipped=unclipped.item(),
            plain=type(norm) is torch.Tensor,
            unchanged=unchanged,
            norm=norm.item(),
            clipped_err=clipped_err,
            after=after,
            max_norm=max_norm,
            dtype=str(norm.dtype),
        )
    out["some_ranks"] = _grads_on_some_ranks_only()
    out["pipeline"] = _pipeline_grads()
    return out


def _pipeline_grads() -> dict:
    """pp 2 x dp 2: the two pp slices hold different parameters (1 and 2 of them). With every gradient present
    the norm spans both stages; when rank 3 alone lacks one of its stage's gradients, every rank (both
    stages) raises the same error naming the pipeline rank and the ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    inner, pp_group = mesh["dp"], mesh["pp"].get_group()
    stage = mesh.get_local_rank("pp")
    params = [
        torch.nn.Parameter(distribute_tensor(torch.zeros(4, 2, dtype=torch.float64), inner, [Shard(0)]))
        for _ in range(stage + 1)
    ]
    for p in params:  # every local gradient holds ones: the norm is sqrt(number of elements of both stages)
        p.grad = DTensor.from_local(torch.ones(2, 2, dtype=torch.float64), inner, [Shard(0)])
    out = {"norm": clip_grad_norm_(params, 1e9, pp_group=pp_group).item()}
    if dist.get_rank() == 3:
        params[1].grad = None
    try:
        clip_grad_norm_(params, 1.0, pp_group=pp_group)
        out["message"] = "no error"
    except RuntimeError as err:
        out["message"] = str(err)
    return out


def _grads_on_some_ranks_only() -> dict:
    """Rank 0 alone has gradients: every rank must raise the same error (today: rank 0 waited in a collective
    the others never entered, "Connection closed by peer"), and the group stays usable afterwards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    world = init_device_mesh("cpu", (4,))
    params = [torch.nn.Parameter(distribute_tensor(torch.zeros(8, 2, dtype=torch.float64), world, [Shard(0)]))]
    if dist.get_rank() == 0:  # from_local: no collective, so only rank 0 builds it
        params[0].grad = DTensor.from_local(torch.ones(2, 2, dtype=torch.float64), world, [Shard(0)])
    try:
        clip_grad_norm_(params, 1.0)
        message = "no error"
    except RuntimeError as err:
        message = str(err)
    flag = torch.ones(1)
    dist.all_reduce(flag)
    return {"message": message, "after": flag.item()}


def test_clip_across_meshes_and_tensor_kinds_4_ranks():
    for rank, rank_out in enumerate(run_distributed(_clip_checks, 4)):
        some = rank_out.pop("some_ranks")
        pipeline = rank_out.pop("pipeline")
        assert math.isclose(pipeline["norm"], math.sqrt(8 + 16), rel_tol=1e-14), (rank, pipeline)
        expected = "parameter 1 of pipeline rank 1 has a gradient on rank(s) [2] but not on rank(s) [3]"
        assert expected in pipeline["message"], (rank, pipeline)
        assert "has a gradient on rank(s) [0] but not on rank(s) [1, 2, 3]" in some["message"], (rank, some)
        assert some["after"] == 4.0, "the process group must stay usable after the refusal"
        for norm_type, r in rank_out.items():
            label = f"norm_type={norm_type}"
            assert r["dtype"] == "torch.float64", f"{label}: float64 gradients give a float64 norm"
            assert math.isclose(r["unclipped"], r["ref"], rel_tol=1e-12), (label, r)
            assert math.isclose(r["norm"], r["ref"], rel_tol=1e-12), (label, r)
            assert r["plain"], f"{label}: the returned norm must be a plain tensor"
            assert r["unchanged"] < 1e-12, f"{label}: max_norm above the norm must not change gradients"
            assert r["clipped_err"] < 1e-12, (label, r)
            assert math.isclose(r["after"], r["max_norm"] * r["ref"] / (r["ref"] + 1e-6), rel_tol=1e-12), (label, r)


def test_clip_single_process_matches_torch():
    full = _full_grads(torch.float32)
    for norm_type in NORM_TYPES:
        ours = [torch.nn.Parameter(torch.zeros_like(g)) for g in full]
        theirs = [torch.nn.Parameter(torch.zeros_like(g)) for g in full]
        for a, b, g in zip(ours, theirs, full, strict=True):
            a.grad, b.grad = g.clone(), g.clone()
        norm = clip_grad_norm_(ours, 1.0, norm_type)
        expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type)
        assert torch.allclose(norm, expected, rtol=1e-6)
        for a, b in zip(ours, theirs, strict=True):
            assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_clip_nonfinite_raises_when_asked():
    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([1.0, math.nan])
    try:
        clip_grad_norm_([param], 1.0, error_if_nonfinite=True)
    except RuntimeError as err:
        assert "non-finite" in str(err)
    else:
        raise AssertionError("expected a RuntimeError for a NaN gradient")


def test_the_reduce_warning_is_quiet_only_inside_the_block_and_its_thread():
    """The DTensor warning silenced around the norm reduction: below ERROR, in that block, on that thread only;
    the logger's level and filters are as before afterwards (no process-wide logging change)."""
    import logging
    import threading

    from ndparallel.parallel.clip import _REDISTRIBUTE_LOGGER, _quiet_sequential_reduce_warning

    logger = logging.getLogger(_REDISTRIBUTE_LOGGER)
    level, filters = logger.level, list(logger.filters)
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    keep = Keep()
    logger.addHandler(keep)
    logger.setLevel(logging.DEBUG)
    try:
        with _quiet_sequential_reduce_warning():
            logger.warning("inside")
            with _quiet_sequential_reduce_warning():
                logger.info("nested")
            logger.warning("inside, after the nested block")
            logger.error("an error")
            other = threading.Thread(target=logger.warning, args=("another thread",))
            other.start()
            other.join()
        logger.warning("after")
        assert seen == ["an error", "another thread", "after"]
        assert logger.filters == filters
    finally:
        logger.removeHandler(keep)
        logger.setLevel(level)
    assert logger.level == level
