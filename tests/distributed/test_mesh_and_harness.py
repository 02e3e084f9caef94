"""Rank groups of real gloo meshes against hand-written lists, and the harness's failure handling."""

from __future__ import annotations

import os
import time

import pytest

from ndparallel import ParallelismConfig
from ndparallel.distributed.mesh import VIEWS, format_rank_table, rank_groups
from ndparallel.testing import DistributedError, DistributedTimeout, run_distributed

# Hand-written: ranks laid out row-major over (dp_replicate, dp_shard, cp, tp).
EXPECTED = {
    "replicate2_shard2": (
        dict(dp_replicate_size=2, dp_shard_size=2),
        {
            "dp_replicate": [[0, 2], [1, 3]],
            "dp_shard": [[0, 1], [2, 3]],
            "tp": [[0], [1], [2], [3]],
            "dp": [[0, 1, 2, 3]],
            "dp_shard_cp": [[0, 1], [2, 3]],
            "dp_cp": [[0, 1, 2, 3]],
        },
    ),
    "replicate2_shard2_tp2": (
        dict(dp_replicate_size=2, dp_shard_size=2, tp_size=2),
        {
            "dp_replicate": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "dp_shard": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
            "dp_shard_cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        },
    ),
    "shard2_tp2": (
        dict(dp_shard_size=2, tp_size=2),
        {
            "dp_replicate": [[0], [1], [2], [3]],
            "dp_shard": [[0, 2], [1, 3]],
            "tp": [[0, 1], [2, 3]],
            "dp": [[0, 2], [1, 3]],
            "dp_shard_cp": [[0, 2], [1, 3]],
            "dp_cp": [[0, 2], [1, 3]],
        },
    ),
    "shard2_cp2": (
        dict(dp_shard_size=2, cp_size=2),
        {
            "cp": [[0, 1], [2, 3]],
            "dp": [[0, 2], [1, 3]],
            "dp_shard_cp": [[0, 1, 2, 3]],
            "dp_cp": [[0, 1, 2, 3]],
        },
    ),
}


def _mesh_groups(sizes: dict) -> dict:
    import torch.distributed as dist

    import ndparallel as ndp
    from ndparallel.config.dims import MESH_DIMS

    mesh = ndp.init_distributed(ndp.ParallelismConfig(**sizes), device_type="cpu")
    groups = {name: dist.get_process_group_ranks(mesh[name].get_group()) for name in (*MESH_DIMS, *VIEWS)}
    return {"groups": groups, "coordinate": mesh.coordinate, "sizes": {n: mesh.size(n) for n in groups}}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_rank_groups_match_hand_written_and_real_mesh(case):
    sizes, expected = EXPECTED[case]
    cfg = ParallelismConfig(**sizes).resolve(ParallelismConfig(**sizes).world_size)
    computed = rank_groups(cfg)
    for name, groups in expected.items():
        assert computed[name] == groups, name
    per_rank = run_distributed(_mesh_groups, cfg.world_size, sizes)
    for rank, result in enumerate(per_rank):
        for name, ranks in result["groups"].items():
            # The real process group of this rank is exactly the computed group containing it.
            mine = [g for g in computed[name] if rank in g]
            assert ranks == mine[0], (rank, name)
            assert result["sizes"][name] == len(mine[0])
            assert result["coordinate"][name] == mine[0].index(rank)


def test_rank_table_is_readable():
    text = format_rank_table(ParallelismConfig(dp_shard_size=2, tp_size=2).resolve(4))
    assert "dp_shard=2 x tp=2" in text
    assert "tp                                       size 2    groups: [0,1] [2,3]" in text
    assert "dp_shard_cp (dp_shard x cp)" in text


def _raise_on_rank_one() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank one")
    dist.barrier()  # rank 0 would wait here forever without the harness


def _hang_on_rank_zero() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(600)
    return os.getpid()


def _die_hard_on_rank_one() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _segfault_on_rank_one() -> None:
    import ctypes

    import torch.distributed as dist

    if dist.get_rank() == 1:
        ctypes.string_at(0)  # a real native crash: read address 0
    dist.barrier()


def _pid() -> int:
    return os.getpid()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_harness_returns_results_and_leaves_no_processes():
    pids = run_distributed(_pid, 3)
    assert len(set(pids)) == 3
    time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def test_harness_raising_rank_propagates_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedError) as info:
        run_distributed(_raise_on_rank_one, 2, timeout=60)
    assert info.value.rank == 1
    assert "deliberate failure on rank one" in str(info.value)
    assert "Traceback" in info.value.remote_traceback
    assert time.monotonic() - start < 30


def test_harness_hanging_rank_times_out():
    start = time.monotonic()
    with pytest.raises(DistributedTimeout) as info:
        run_distributed(_hang_on_rank_zero, 2, timeout=6)
    assert 0 in info.value.unfinished  # rank 1 normally finishes too, unless the machine is very loaded
    assert time.monotonic() - start < 20


def test_harness_dead_rank_is_reported():
    with pytest.raises(DistributedError) as info:
        run_distributed(_die_hard_on_rank_one, 2, timeout=60)
    assert info.value.rank == 1
    assert "exited with code 3" in str(info.value)


def test_harness_native_crash_is_reported_with_its_python_stack():
    with pytest.raises(DistributedError) as info:
        run_distributed(_segfault_on_rank_one, 2, timeout=60)
    assert info.value.rank == 1
    assert "exited with code -11" in str(info.value)
    assert "Segmentation fault" in str(info.value)
    assert "_segfault_on_rank_one" in str(info.value), "the crashing rank's Python stack names the function"


def test_the_forkserver_preloads_the_engine_modules_not_only_their_lazy_packages():
    """The harness's forkserver imports the engine once for every rank it forks. Packages whose names load on first
    use (ndparallel/lazy.py) would import almost nothing: every module their tables name must be preloaded. So must
    torch._dynamo, which FSDP2's first sharding imports (a 1-rank gloo group shards and steps a layer here)."""
    import subprocess
    import sys

    code = """
import importlib, sys
from ndparallel.distributed.spawn import _preload
for name in _preload():
    importlib.import_module(name)
missing = []
for package in ("ndparallel.models", "ndparallel.models.transformer", "ndparallel.checkpoint", "ndparallel.train",
                "ndparallel.parallel.pipeline"):
    missing += [m for m in vars(sys.modules[package])["_EXPORTS"].values() if m not in sys.modules]
print(sorted(set(missing)))
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
preloaded = set(sys.modules)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
fully_shard(torch.nn.Linear(4, 4))(torch.ones(2, 4)).sum().backward()
dist.destroy_process_group()
print(sorted(name for name in set(sys.modules) - preloaded if name.startswith("torch._dynamo")))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["[]", "[]"], done.stdout


def _shardwise_adamw_against_torchs() -> dict:
    import torch
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import ndparallel as ndp
    from tests.parity import ShardwiseAdamW

    mesh = ndp.init_distributed(ndp.ParallelismConfig(dp_shard_size=2), device_type="cpu")["dp_shard"]
    torch.manual_seed(0)
    start = torch.randn(5, 3, dtype=torch.float64)  # 5 rows over 2 ranks: uneven shards
    grads = [torch.randn(5, 3, dtype=torch.float64) for _ in range(3)]
    options = dict(lr=0.1, betas=(0.9, 0.95), weight_decay=0.1)
    same = {}
    for placement in (Shard(0), Replicate()):  # a replicated parameter gets a Partial gradient: each rank a half
        ours, torchs = (torch.nn.Parameter(distribute_tensor(start.clone(), mesh, [placement])) for _ in range(2))
        for param, optimizer in (
            (ours, ShardwiseAdamW([ours], **options)),
            (torchs, torch.optim.AdamW([torchs], **options)),
        ):
            for grad in grads:
                if placement == Replicate():
                    param.grad = DTensor.from_local(grad / 2, mesh, [Partial()], run_check=False)
                else:
                    param.grad = distribute_tensor(grad, mesh, [placement])
                optimizer.step()
                optimizer.zero_grad()
        moved = not torch.equal(ours.full_tensor(), start)
        same[str(placement)] = moved and torch.equal(ours.full_tensor(), torchs.full_tensor())
    return same


def test_the_parity_runs_adamw_steps_shards_exactly_as_torchs_adamw_on_dtensors():
    # tests/parity.py's ShardwiseAdamW (docs/parallelize.md): bitwise torch's AdamW on the DTensor parameter, on
    # uneven shards and on a replicated parameter whose gradient is Partial (redistributed first, as DTensor does).
    for rank in run_distributed(_shardwise_adamw_against_torchs, 2, timeout=120):
        assert rank == {"S(0)": True, "R": True}, rank
