"""Accelerator: a hand-written loop with accumulation on dp_shard 2 x tp 2 and on pure data parallel
equals one process (losses, clipped grad norms, step-1 gradients), and save_state/load_state resumes."""

from __future__ import annotations

import numpy as np
import pytest

from ndparallel.testing import run_distributed

STEPS = 5


def _loop(sizes: dict, accumulation: int, batch_size: int, ckpt_dir: str | None) -> dict:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import ndparallel as ndp
    from ndparallel.models import Transformer, TransformerConfig
    from ndparallel.train.accelerator import Accelerator

    acc = Accelerator(ndp.ParallelismConfig(**sizes), gradient_accumulation_steps=accumulation, device_type="cpu")
    data = torch.randint(0, 256, (64, 17), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(data), batch_size=batch_size, shuffle=False)

    def fresh():
        model = Transformer(TransformerConfig.from_preset("tiny"))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)  # built before prepare
        return acc.prepare(model, optimizer)

    model, optimizer = fresh()
    loader = acc.prepare(loader)
    losses, norms, seen = [], [], []
    batches = iter(loader)
    for step in range(STEPS):
        total = torch.zeros(())
        for _ in range(accumulation):
            (window,) = next(batches)
            seen.append(acc.gather_for_metrics(window[:, 0]))
            with acc.accumulate(model):
                loss = ndp.cross_entropy_loss(model(window[:, :-1]), window[:, 1:])
                acc.backward(loss)
                total += loss.detach() / accumulation
        assert acc.sync_gradients
        norms.append(float(acc.clip_grad_norm_(model.parameters(), 0.5)))
        if step == 0:
            grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(acc.reduce(total)))
        if ckpt_dir and step == 2:
            acc.save_state(ckpt_dir, note="after step 3")
    resumed = []
    if ckpt_dir:
        acc._models.clear()
        acc._optimizers.clear()
        model, optimizer = fresh()
        state = acc.load_state(ckpt_dir)
        assert state["note"] == "after step 3"
        batches = iter(loader)
        for _ in range(3 * accumulation):
            next(batches)
        for _ in range(3, STEPS):
            total = torch.zeros(())
            for _ in range(accumulation):
                (window,) = next(batches)
                with acc.accumulate(model):
                    loss = ndp.cross_entropy_loss(model(window[:, :-1]), window[:, 1:])
                    acc.backward(loss)
                    total += loss.detach() / accumulation
            acc.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
            resumed.append(float(acc.reduce(total)))
    return {"losses": losses, "norms": norms, "grads": grads, "seen": torch.cat(seen).tolist(), "resumed": resumed}


def _full(tensor):
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().numpy().copy()


@pytest.fixture(scope="module")
def reference():
    # One process, no accumulation, the whole global batch (2 dp ranks x 2 micro x 2) at once.
    return run_distributed(_loop, 1, {}, 1, 8, None)[0]


@pytest.mark.parametrize(
    "world, sizes", [(4, {"dp_shard_size": 2, "tp_size": 2}), (2, {"dp_replicate_size": 2})], ids=["2d", "replicate"]
)
def test_accelerator_with_accumulation_matches_one_process(reference, tmp_path, world, sizes):
    results = run_distributed(_loop, world, sizes, 2, 2, str(tmp_path / "ckpt"))
    for rank, got in enumerate(results):
        assert max(abs(a - b) for a, b in zip(got["losses"], reference["losses"], strict=True)) <= 1e-5, rank
        assert got["norms"] == pytest.approx(reference["norms"], rel=1e-5)
        for name, grad in reference["grads"].items():
            assert np.abs(got["grads"][name] - grad).max() <= 1e-5, (rank, name)
        # Resumed from the step-3 checkpoint, steps 4-5 repeat the uninterrupted run.
        assert got["resumed"] == pytest.approx(got["losses"][3:], abs=1e-6)
    assert reference["norms"][0] > 0.5, "clipping must be active for the test to mean anything"
    # Every sample is seen exactly once per epoch slice: gathered over dp, not the world.
    assert sorted(results[0]["seen"]) == sorted(reference["seen"])
