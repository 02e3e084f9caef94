"""The everyday names of Accelerate's ``Accelerator`` and ``accelerate.utils`` on 2 gloo ranks, with
Accelerate's semantics: nested gathers, ``gather_for_metrics`` at the end of an uneven evaluation loader,
padding, splitting, per-process decorators, triggers, broadcasts, ``save``, ``register_for_checkpointing`` and
the state hooks, automatic checkpoint naming, ``skip_first_batches`` on a dealt loader, ``LocalSGD``, the
profiler, the multi-process logger and the rank properties. One spawned group runs every check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ndparallel.testing import run_distributed


class Counter:
    """An object with state for register_for_checkpointing."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def _group(root: str) -> dict[str, Any]:
    import logging

    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import ndparallel as ndp
    from ndparallel.errors import ConfigError
    from ndparallel.local_sgd import LocalSGD
    from ndparallel.logging import get_logger
    from ndparallel.utils import ProfileKwargs, ProjectConfiguration, broadcast, broadcast_object_list, gather_object

    project = ProjectConfiguration(project_dir=f"{root}/project", automatic_checkpoint_naming=True, total_limit=2)
    acc = ndp.Accelerator(project_config=project, cpu=True)
    rank, out = acc.process_index, {}
    out["kind"] = (str(acc.distributed_type), acc.num_processes, acc.state.num_processes, acc.use_distributed)
    out["ranks"] = (acc.data_parallel_rank, acc.data_parallel_shard_rank, acc.tensor_parallel_rank, acc.is_last_process)

    value = torch.tensor(float(rank))
    out["gather"] = acc.gather({"a": (value, torch.full((2, 2), rank)), "b": [torch.arange(rank + 1)[:1]]})
    out["pad"] = acc.pad_across_processes(torch.ones(rank + 1), pad_index=-1).tolist()
    out["pad_first"] = acc.pad_across_processes(torch.ones(rank + 1), pad_index=-1, pad_first=True).tolist()
    out["reduce"] = (acc.reduce(value + 1, "sum").item(), acc.reduce(value + 1, "mean").item())
    out["gather_object"] = gather_object([f"r{rank}"])
    out["broadcast"] = broadcast(torch.tensor([rank, rank]), from_process=1).tolist()
    out["broadcast_objects"] = broadcast_object_list([rank, {"r": rank}], from_process=1)
    with acc.split_between_processes(list(range(5))) as share:
        out["split"] = share
    with acc.split_between_processes({"x": list(range(5)), "y": torch.arange(5)}, apply_padding=True) as share:
        out["split_padded"] = (share["x"], share["y"].tolist())

    ran = []
    acc.on_main_process(lambda: ran.append("main"))()
    acc.on_last_process(lambda: ran.append("last"))()
    acc.on_local_main_process(lambda: ran.append("local main"))()
    acc.on_process(process_index=1)(lambda: ran.append("process 1"))()
    out["ran"] = ran
    order = Path(root) / "order.txt"
    with acc.local_main_process_first():
        with order.open("a") as f:
            f.write(f"{rank}\n")
    acc.wait_for_everyone()
    out["order"] = order.read_text().split()

    if rank == 1:
        acc.set_trigger()
    out["trigger"] = (acc.check_trigger(), acc.check_trigger())

    # gather_for_metrics at the end of an evaluation loader of 5 samples in batches of 2: the last round repeats
    # 3 samples (even_batches), which it drops; tuples and dicts alike, objects through gather_object
    evaluation = acc.prepare(DataLoader(TensorDataset(torch.arange(5)), batch_size=2))
    gathered, pairs, objects = [], [], []
    for (batch,) in evaluation:
        gathered += acc.gather_for_metrics(batch).tolist()
        first, second = acc.gather_for_metrics((batch, {"twice": batch * 2}))
        pairs += list(zip(first.tolist(), second["twice"].tolist(), strict=True))
        objects += acc.gather_for_metrics([f"s{i}" for i in batch.tolist()])
    out["metrics"] = (gathered, pairs, objects)

    # a stream (IterableDataset): the first rank reads one batch per rank each step and dispatches; 11 samples in
    # batches of 2 end with a step of 3, split 2 + 2 with the first sample repeated, which gather_for_metrics drops
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(11))

    stream = acc.prepare(DataLoader(Stream(), batch_size=2))
    seen, gathered = [], []
    for batch in stream:
        seen.append(batch.tolist())
        gathered += acc.gather_for_metrics(batch).tolist()
    out["stream"] = (seen, gathered)
    for config in ({"dispatch_batches": False}, {"split_batches": True}):
        try:
            ndp.Accelerator(cpu=True, **config).prepare(DataLoader(Stream(), batch_size=2))
        except ConfigError as error:
            out[f"stream refused {config}"] = str(error)

    # skip_first_batches on a dealt shuffling loader: the rest of the same (rank-0-synced) order
    torch.manual_seed(100 + rank)  # different global generators: the loader's own is synced from rank 0
    train = acc.prepare(DataLoader(TensorDataset(torch.arange(12)), batch_size=2, shuffle=True))
    state = train.synchronized_generator.get_state()
    full = [b.tolist() for (b,) in train]
    train.synchronized_generator.set_state(state)
    out["skip"] = (full, [b.tolist() for (b,) in acc.skip_first_batches(train, 2)])

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    counter = Counter()
    counter.count = 5
    acc.register_for_checkpointing(counter)
    hooked = []
    acc.register_save_state_pre_hook(lambda models, weights, folder: hooked.append(("save", len(models), len(weights))))
    acc.register_load_state_pre_hook(lambda models, folder: hooked.append(("load", len(models))))
    model(torch.ones(4, 3) * (rank + 1)).sum().backward()
    acc.clip_grad_value_(model.parameters(), 0.5)
    out["clipped"] = max(p.grad.abs().max().item() for p in model.parameters())
    optimizer.step()
    folders = [acc.save_state() for _ in range(3)]  # checkpoint_0..2, the last 2 kept
    counter.count = 0
    acc.load_state()
    out["state"] = (counter.count, hooked[-1], [Path(f).name for f in folders], acc.save_iteration)
    out["kept"] = sorted(p.name for p in (Path(root) / "project" / "checkpoints").iterdir())
    acc.save({"rank": rank}, f"{root}/saved.pt")

    with acc.profile(ProfileKwargs(output_trace_dir=f"{root}/traces")):
        model(torch.ones(1, 3))
    out["traces"] = sorted(p.name for p in Path(f"{root}/traces").iterdir())

    # broadcast_buffers (DDP's default): every forward takes rank 0's running statistics, so after a training step
    # on different data the ranks evaluate alike; without it they do not
    from ndparallel.utils import DistributedDataParallelKwargs

    evals = {}
    for label, accelerator in (("synced", acc), ("off", ndp.Accelerator(cpu=True, kwargs_handlers=[
            DistributedDataParallelKwargs(broadcast_buffers=False)]))):  # fmt: skip
        torch.manual_seed(0)
        norm = accelerator.prepare(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
        norm(torch.randn(8, 2) * (rank + 1)).sum().backward()
        norm.eval()
        evals[label] = norm(torch.ones(1, 2)).tolist()
    out["batch norm"] = evals

    # LocalSGD: no gradient sync inside; the parameters are averaged every 2 steps
    local = nn.Linear(2, 1, bias=False)
    local, local_opt = acc.prepare(local, torch.optim.SGD(local.parameters(), lr=0.1))
    with LocalSGD(acc, local, local_sgd_steps=2) as sgd:
        for step in range(3):
            local(torch.full((1, 2), float(rank + 1))).sum().backward()
            local_opt.step()
            local_opt.zero_grad()
            sgd.step()
            out[f"local {step}"] = local.weight.detach().clone().tolist()

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = get_logger("ndparallel.test.everyday", log_level="INFO")
    logger.logger.addHandler(handler)
    logger.info("main only")
    logger.info("everyone", main_process_only=False)
    out["logged"] = records
    out["freed"] = acc.free_memory(model, optimizer)

    # FSDP over both ranks from rank 0's weights (accelerate launch's default sync_module_states)
    torch.manual_seed(rank)
    synced = ndp.Accelerator(fsdp_plugin=ndp.FullyShardedDataParallelPlugin(sync_module_states=True), cpu=True)
    sharded = synced.prepare(nn.Linear(3, 2))
    out["synced"] = (str(synced.distributed_type), sharded.weight.full_tensor().tolist())
    try:  # the data-parallel run's Accelerate-layout folder, in a sharded job
        synced.load_state(folders[-1])
    except ConfigError as error:
        out["sharded load"] = str(error)
    acc.end_training()
    return out


@pytest.mark.slow
def test_everyday_names_have_accelerates_semantics_on_two_ranks(tmp_path):
    import torch

    results = run_distributed(_group, 2, str(tmp_path), timeout=300)
    zero, one = results
    assert zero["kind"] == one["kind"] == ("DistributedType.MULTI_CPU", 2, 2, True)
    assert (zero["ranks"], one["ranks"]) == ((0, 0, 0, False), (1, 0, 0, True))
    for result in results:
        assert result["gather"]["a"][0].tolist() == [0.0, 1.0] and result["gather"]["a"][1].shape == (4, 2)
        assert result["gather"]["b"][0].tolist() == [0, 0]
        assert result["pad"] in ([1.0, -1.0], [1.0, 1.0]) and result["reduce"] == (3.0, 1.5)
        assert result["gather_object"] == ["r0", "r1"] and result["broadcast"] == [1, 1]
        assert result["broadcast_objects"] == [1, {"r": 1}] and result["trigger"] == (True, False)
        assert result["order"][0] == "0"  # the local main process went first
        gathered, pairs, objects = result["metrics"]
        assert gathered == [0, 1, 2, 3, 4] and pairs == [(i, 2 * i) for i in range(5)]
        assert objects == [f"s{i}" for i in range(5)]
        assert result["clipped"] <= 0.5
        assert result["state"] == (5, ("load", 1), ["checkpoint_0", "checkpoint_1", "checkpoint_2"], 3)
        assert result["kept"] == ["checkpoint_1", "checkpoint_2"]
        assert result["traces"] == ["profile_0.json", "profile_1.json"]
        assert result["freed"] == [None, None]
    assert (zero["pad"], zero["pad_first"], one["pad"]) == ([1.0, -1.0], [-1.0, 1.0], [1.0, 1.0])
    assert (zero["split"], one["split"]) == ([0, 1, 2], [3, 4])
    assert (zero["split_padded"], one["split_padded"]) == (([0, 1, 2], [0, 1, 2]), ([3, 4, 4], [3, 4, 4]))
    assert (zero["ran"], one["ran"]) == (["main", "local main"], ["last", "process 1"])
    assert zero["stream"] == ([[0, 1], [4, 5], [8, 9]], list(range(11)))
    assert one["stream"] == ([[2, 3], [6, 7], [10, 0]], list(range(11)))
    assert (
        "dispatch_batches=False with an IterableDataset is not supported"
        in zero["stream refused {'dispatch_batches': False}"]
    )
    assert "split_batches=True with an IterableDataset" in zero["stream refused {'split_batches': True}"]
    full, skipped = zero["skip"]
    assert full != one["skip"][0] and skipped == full[2:]  # ranks get different batches of one synced order
    assert sorted(sum(zero["skip"][0] + one["skip"][0], [])) == list(range(12))
    assert zero["batch norm"]["synced"] == one["batch norm"]["synced"]
    assert zero["batch norm"]["off"] != one["batch norm"]["off"]
    assert zero["local 0"] != one["local 0"]  # local steps: no gradient sync
    assert zero["local 1"] == one["local 1"] and zero["local 2"] != one["local 2"]  # averaged every 2 steps
    assert zero["logged"] == ["main only", "everyone"] and one["logged"] == ["everyone"]
    assert torch.load(tmp_path / "saved.pt") == {"rank": 0}
    for result in results:
        assert "is an Accelerate save_state folder of unsharded weights; this job shards them" in result["sharded load"]
    torch.manual_seed(0)
    assert zero["synced"] == one["synced"] == ("DistributedType.FSDP", torch.nn.Linear(3, 2).weight.tolist())
    assert json.loads((tmp_path / "traces" / "profile_1.json").read_text())
