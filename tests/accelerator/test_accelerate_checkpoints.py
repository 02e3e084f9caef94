"""Accelerate's ``save_state`` folders and ndparallel's, both ways, for unsharded jobs (one process here; two
ranks in test_accelerate_examples.py's checkpointing runs): the
same files with the same contents, each loads into the other and training goes on identically. A folder of
unsharded weights is refused by name in a sharded job (test_accelerate_everyday.py); Accelerate's FSDP folders
stay refused (test_trainer.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ndparallel as ndp

accelerate = pytest.importorskip("accelerate")


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def _setup(accelerator_class, **kwargs):
    torch.manual_seed(0)
    acc = accelerator_class(cpu=True, **kwargs)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4, shuffle=True)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return acc, *acc.prepare(model, optimizer, data, scheduler), counter


def _steps(acc, model, optimizer, data, scheduler, counter, steps: int) -> list[float]:
    losses = []
    for features, labels in data:
        if len(losses) == steps:
            break
        loss = nn.functional.cross_entropy(model(features), labels)
        acc.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        counter.count += 1
        losses.append(loss.item())
    return losses


def _reset_accelerate():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two steps, save_state, then two more steps, with Accelerate and with ndparallel; their folders and
    what each run did after saving."""
    tmp_path = tmp_path_factory.mktemp("folders")
    runs = {}
    for name, accelerator_class in (("accelerate", accelerate.Accelerator), ("ndparallel", ndp.Accelerator)):
        acc, *objects = _setup(accelerator_class)
        first = _steps(acc, *objects, 2)
        acc.save_state(str(tmp_path / name))
        runs[name] = {"first": first, "after": _steps(acc, *objects, 2), "rng": torch.rand(3)}
        if name == "accelerate":
            _reset_accelerate()
        else:
            ndp.destroy_distributed()
    yield tmp_path, runs
    ndp.destroy_distributed()


def test_both_write_the_same_files(folders):
    root, runs = folders
    ours, theirs = root / "ndparallel", root / "accelerate"
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    assert _same(runs["ndparallel"], runs["accelerate"])  # the same run, bit for bit
    from safetensors.torch import load_file

    mine, reference = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert mine.keys() == reference.keys() and all(torch.equal(mine[k], reference[k]) for k in mine)
    for name in ("optimizer.bin", "scheduler.bin", "custom_checkpoint_0.pkl", "random_states_0.pkl"):
        assert _same(torch.load(ours / name, weights_only=False), torch.load(theirs / name, weights_only=False)), name
    for path in ours.iterdir():  # measured: byte for byte
        assert path.read_bytes() == (theirs / path.name).read_bytes(), path.name


def _same(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


@pytest.mark.parametrize("saved_by, loaded_by", [("accelerate", "ndparallel"), ("ndparallel", "accelerate")])
def test_each_loads_the_others_folder_and_trains_on_identically(folders, saved_by, loaded_by):
    root, runs = folders
    accelerator_class = ndp.Accelerator if loaded_by == "ndparallel" else accelerate.Accelerator
    random.seed(99)  # the folder restores every generator: nothing before the load matters
    acc, *objects = _setup(accelerator_class)
    acc.load_state(str(root / saved_by))
    assert objects[-1].count == 2 and acc.step == 0
    after = _steps(acc, *objects, 2)
    assert after == runs[saved_by]["after"] and torch.equal(torch.rand(3), runs[saved_by]["rng"])
    if loaded_by == "accelerate":
        _reset_accelerate()
