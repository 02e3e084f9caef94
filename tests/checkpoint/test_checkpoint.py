"""Checkpoints: resharding (FSDP2 x4 -> dp_shard 2 x tp 2 -> one process), exact resume, async save,
atomic commit under a crash, corrupt-checkpoint detection, keep-last-k and commit order after a
rollback, rank-local failures agreed by every rank (no hang), safetensors export/import, and a checkpoint of
format version 2 still loads. Several stages per rank: test_rank_state.py; MoE layouts: test_resharding.py.

Every multi-rank check runs on real gloo ranks and writes real DCP directories under ``tmp_path``.
The three 4-rank jobs (save, resume on the same mesh, resume on another mesh) form one test so the
saved checkpoint is shared; the single-process reference runs in the pytest process.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import ndparallel as ndp
from ndparallel import checkpoint as ckpt
from ndparallel.checkpoint import CheckpointError
from ndparallel.distributed.reduce import average_over
from ndparallel.models import Transformer, TransformerConfig
from ndparallel.parallel.loss import cross_entropy_loss
from ndparallel.testing import DistributedError, run_distributed
from tests.parity import full_grads

GLOBAL_BATCH, SEQ, VOCAB = 8, 16, 256
FSDP4 = {"dp_shard_size": 4}
FSDP2 = {"dp_shard_size": 2}
FSDP2_TP2 = {"dp_shard_size": 2, "tp_size": 2}


# ----------------------------------------------------------------------------- training helpers (run in ranks)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """One torch thread: this tiny model runs ~10x faster so on two busy cores; the previous setting is restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _setup(parallel: dict | None, seed: int = 0):
    """Tiny Transformer, AdamW and a LinearLR schedule; parallelised on ``parallel`` (None: one process)."""
    net = Transformer(TransformerConfig.from_preset("tiny", seed=seed))
    mesh = None
    if parallel is not None:
        from ndparallel.parallel.parallelize import parallelize

        mesh = ndp.init_distributed(ndp.ParallelismConfig.from_dict(parallel))
        net = parallelize(net, mesh.config, mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=10)
    return net, opt, sched, mesh


def _step(net, opt, sched, mesh, grads: dict | None = None) -> tuple[float, list[float]]:
    """One step on a batch drawn from the *global* torch RNG (identical on every rank), so resuming
    with the wrong RNG state changes the data. Also draws from python's and numpy's RNGs."""
    data = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1))
    dp_size, dp_rank = (mesh.size("dp"), mesh.local_rank("dp")) if mesh else (1, 0)
    per = GLOBAL_BATCH // dp_size
    data = data[dp_rank * per : (dp_rank + 1) * per]
    loss = cross_entropy_loss(net(data[:, :-1]), data[:, 1:])
    loss.backward()
    if grads is not None:
        grads.update(full_grads(net))  # full fp32 gradients (a collective under DTensor)
    opt.step()
    sched.step()
    opt.zero_grad()
    return average_over(mesh["dp_cp"] if mesh else None, loss), [random.random(), float(np.random.rand())]


def _train(net, opt, sched, mesh, steps: int, grads: dict | None = None) -> tuple[list[float], list[list[float]]]:
    """``steps`` steps; ``grads`` (if given) receives the first step's full gradients."""
    losses, draws = [], []
    for i in range(steps):
        loss, draw = _step(net, opt, sched, mesh, grads if i == 0 else None)
        losses.append(loss)
        draws.append(draw)
    return losses, draws


def _full_state(net, opt) -> dict[str, np.ndarray] | None:
    """Full model + optimizer state as numpy (rank 0; None elsewhere). A collective under a process group."""
    model_sd, optim_sd = get_state_dict(net, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    out = {f"model.{k}": v.detach().numpy().copy() for k, v in model_sd.items()}
    for fqn, state in optim_sd["state"].items():
        for name, value in state.items():
            out[f"optim.{fqn}.{name}"] = value.detach().numpy().copy()
    out["lr"] = np.array([g["lr"] for g in optim_sd["param_groups"]])
    return out


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def job_save(root: str) -> dict[str, Any]:
    """FSDP2 x4: 5 steps, save (sync and async), export safetensors, 5 more steps while the async save writes."""
    _seed_all(1234)
    net, opt, sched, mesh = _setup(FSDP4)
    losses, draws = _train(net, opt, sched, mesh, 5)
    extra = dict(scheduler=sched.state_dict(), data={"position": 5 * GLOBAL_BATCH, "epoch": 0}, note=(1, "a"))
    path = ckpt.save(f"{root}/sync/step-5", net, opt, step=5, **extra)
    handle = ckpt.save_async(f"{root}/async/step-5", net, opt, step=5, **extra)
    state5 = _full_state(net, opt)
    ckpt.export_safetensors(net, f"{root}/full.safetensors")
    grads: dict = {}
    more_losses, more_draws = _train(net, opt, sched, mesh, 5, grads)  # runs while the async save writes
    async_path = handle.wait()
    return dict(
        losses=losses + more_losses,
        draws=draws + more_draws,
        state5=state5,
        path=path,
        async_path=async_path,
        async_done=handle.done(),
        grads6=grads,
    )


def job_resume(path: str, parallel: dict | None, safetensors_file: str | None = None) -> dict[str, Any]:
    """New process group (or one process): fresh model from another seed, load, compare state, 5 steps."""
    _seed_all(999)  # load must restore the RNG states saved at step 5
    net, opt, sched, mesh = _setup(parallel, seed=7)
    extra = ckpt.load(path, net, opt)
    sched.load_state_dict(extra["scheduler"])
    state = _full_state(net, opt)
    grads: dict = {}
    losses, draws = _train(net, opt, sched, mesh, 5, grads)
    out = dict(extra=extra, state=state, losses=losses, draws=draws, grads6=grads)
    if safetensors_file is not None:
        fresh, _, _, _ = _setup(parallel, seed=11)
        ckpt.import_safetensors(safetensors_file, fresh)
        out["imported"] = _full_state(fresh, torch.optim.AdamW(fresh.parameters()))
    if parallel is not None:
        out["world_size"] = dist.get_world_size()
    return out


def _assert_same_state(got: dict, ref: dict, prefix: str = "", atol: float = 0.0) -> None:
    keys = [k for k in ref if k.startswith(prefix)]
    assert keys and set(keys) == {k for k in got if k.startswith(prefix)}
    for k in keys:
        diff = float(np.abs(got[k] - ref[k]).max())
        assert diff <= atol, f"{k} differs by {diff:.3g}"


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ----------------------------------------------------------------------------- resharding + exact resume


def test_save_fsdp4_load_fsdp4_tp2x2_and_one_process(tmp_path):
    saved = run_distributed(job_save, 4, str(tmp_path))[0]
    path, async_path = saved["path"], saved["async_path"]
    assert saved["async_done"]
    assert ckpt.latest(tmp_path / "sync") == path and ckpt.latest(tmp_path / "async") == async_path
    marker = json.loads((Path(path) / ckpt.MARKER).read_text())
    assert marker["step"] == 5 and marker["world_size"] == 4 and marker["rng_ranks"] == 4
    assert marker["mesh"] == [{"dims": ["dp_shard_cp"], "shape": [4]}]
    straight = saved["losses"]

    # Same mesh, new process group: the resumed 5 steps are bit-identical to the straight run.
    same = run_distributed(job_resume, 4, path, FSDP4, str(tmp_path / "full.safetensors"))[0]
    _assert_same_state(same["state"], saved["state5"])
    assert same["losses"] == straight[5:], (same["losses"], straight[5:])
    assert same["draws"] == saved["draws"][5:]
    _assert_same_state(same["grads6"], saved["grads6"])
    assert same["extra"]["step"] == 5 and same["extra"]["data"] == {"position": 40, "epoch": 0}
    assert same["extra"]["note"] == (1, "a")  # tuples survive the JSON round trip
    _assert_same_state(same["imported"], saved["state5"], prefix="model.")

    # Another mesh (dp_shard 2 x tp 2), from the async checkpoint written while training went on.
    other = run_distributed(job_resume, 4, async_path, FSDP2_TP2, str(tmp_path / "full.safetensors"))[0]
    _assert_same_state(other["state"], saved["state5"])  # resharding copies values exactly
    dloss = max(abs(a - b) for a, b in zip(other["losses"], straight[5:], strict=True))
    assert dloss <= 1e-5, (other["losses"], straight[5:])
    assert other["draws"] == saved["draws"][5:]
    _assert_same_state(other["grads6"], saved["grads6"], atol=1e-5)
    _assert_same_state(other["imported"], saved["state5"], prefix="model.")

    # One process, no process group: same state, same trajectory within fp32 tolerance.
    assert not dist.is_initialized()
    rng = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        single = job_resume(path, None, str(tmp_path / "full.safetensors"))
    finally:
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])
    _assert_same_state(single["state"], saved["state5"])
    dloss = max(abs(a - b) for a, b in zip(single["losses"], straight[5:], strict=True))
    assert dloss <= 1e-5, (single["losses"], straight[5:])
    _assert_same_state(single["grads6"], saved["grads6"], atol=1e-5)
    _assert_same_state(single["imported"], saved["state5"], prefix="model.")

    # Offline export straight from the checkpoint directory equals the live gather.
    from safetensors.torch import load_file

    ckpt.export_safetensors(path, tmp_path / "offline.safetensors")
    live, offline = load_file(tmp_path / "full.safetensors"), load_file(tmp_path / "offline.safetensors")
    assert live.keys() == offline.keys() and all(torch.equal(live[k], offline[k]) for k in live)
    assert all(np.array_equal(live[k].numpy(), saved["state5"][f"model.{k}"]) for k in live)


# ----------------------------------------------------------------------------- atomic commit under a crash


def job_crash(root: str, first_save: bool, seed: int) -> None:
    """Optionally save ``step-1`` (and its weights as safetensors), then die inside the commit of another save."""
    parallel = FSDP2 if dist.get_world_size() > 1 else None
    net, opt, sched, mesh = _setup(parallel, seed=seed)
    _train(net, opt, sched, mesh, 1)
    if first_save:
        ckpt.save(f"{root}/step-1", net, opt, step=1)
        ckpt.export_safetensors(net, f"{root}/step-1.safetensors")
        _train(net, opt, sched, mesh, 1)
        os.environ["NDPARALLEL_CHECKPOINT_TEST_CRASH"] = "before_marker"
        ckpt.save(f"{root}/step-2", net, opt, step=2)
    else:  # replace step-1; die after the marker is written, before the rename
        os.environ["NDPARALLEL_CHECKPOINT_TEST_CRASH"] = "before_rename"
        ckpt.save(f"{root}/step-1", net, opt, step=1)
    raise AssertionError("the test hook should have killed rank 0 inside save")


def _load_one_process(path, seed: int = 5):
    net, opt, _, _ = _setup(None, seed=seed)
    ckpt.load(path, net, opt, restore_rng=False)
    return net


def _equal_to_file(net, file) -> bool:
    from safetensors.torch import load_file

    expected = load_file(file)
    return expected.keys() == net.state_dict().keys() and all(
        torch.equal(v, expected[k]) for k, v in net.state_dict().items()
    )


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpts"
    with pytest.raises(DistributedError, match="exited with code -9"):
        run_distributed(job_crash, 2, str(root), True, 0, timeout=120)
    partial = [p for p in root.iterdir() if p.name.startswith("step-2.tmp-")]
    assert len(partial) == 1 and not (partial[0] / ckpt.MARKER).exists()
    assert (partial[0] / ".metadata").exists()  # DCP finished; only the commit was cut
    assert ckpt.latest(root) == str(root / "step-1")
    with pytest.raises(CheckpointError, match="no ndparallel_meta.json"):
        ckpt.validate(partial[0])
    assert _equal_to_file(_load_one_process(root / "step-1"), root / "step-1.safetensors")

    # A crash after the marker but before the rename, while replacing step-1: step-1 is untouched,
    # and the marked temporary directory is still not a checkpoint for latest().
    with pytest.raises(DistributedError, match="exited with code -9"):
        run_distributed(job_crash, 1, str(root), False, 3, timeout=120)
    marked = [p for p in root.iterdir() if p.name.startswith("step-1.tmp-")]
    assert len(marked) == 1 and (marked[0] / ckpt.MARKER).exists()
    assert ckpt.latest(root) == str(root / "step-1")
    assert _equal_to_file(_load_one_process(root / "step-1"), root / "step-1.safetensors")

    # A successful save replaces step-1 and clears the leftovers of its own crashed save.
    net, opt, _, _ = _setup(None, seed=8)
    ckpt.save(root / "step-1", net, opt, step=1)
    assert not any(p.name.startswith("step-1.tmp-") for p in root.iterdir())
    loaded = _load_one_process(root / "step-1")
    assert _same_weights(loaded, net)
    # prune() removes the crashed step-2 leftover once it is older than the newest checkpoint.
    old = time.time() - 60
    os.utime(partial[0], (old, old))
    assert ckpt.prune(root, 1) == [str(partial[0])]
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step-1"]


# ----------------------------------------------------------------------------- corrupt checkpoints


def _snapshot(net, opt) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.clone() for k, v in net.state_dict().items()}
    for i, s in opt.state.items():
        out.update({f"o.{id(i)}.{k}": v.clone() for k, v in s.items()})
    return out


def _corrupt_variants(good: Path) -> dict[str, tuple[Path, str]]:
    variants = {}

    def variant(name: str) -> Path:
        p = good.parent / name
        shutil.copytree(good, p)
        return p

    shard = next(p.name for p in good.iterdir() if p.suffix == ".distcp")
    p = variant("deleted-shard")
    (p / shard).unlink()
    variants["deleted shard"] = (p, "is missing")
    p = variant("truncated")
    with open(p / shard, "r+b") as f:
        f.truncate((p / shard).stat().st_size // 2)
    variants["truncated shard"] = (p, "truncated or modified")
    p = variant("no-marker")
    (p / ckpt.MARKER).unlink()
    variants["missing marker"] = (p, "no ndparallel_meta.json")
    p = variant("marker-mismatch")
    marker = json.loads((p / ckpt.MARKER).read_text())
    marker["files"][shard] += 1
    (p / ckpt.MARKER).write_text(json.dumps(marker))
    variants["marker size mismatch"] = (p, "recorded")
    p = variant("metadata-flipped")
    data = bytearray((p / ".metadata").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (p / ".metadata").write_bytes(bytes(data))
    variants["same-size corruption of .metadata"] = (p, "SHA-256")
    p = variant("bad-marker-json")
    (p / ckpt.MARKER).write_text("{not json")
    variants["unparsable marker"] = (p, "not JSON")
    return variants


def test_corrupt_checkpoints_raise_before_touching_the_model(tmp_path):
    net, opt, sched, _ = _setup(None)
    _train(net, opt, sched, None, 1)
    good = Path(ckpt.save(tmp_path / "good", net, opt, step=1, scheduler=sched.state_dict()))
    target, target_opt, target_sched, _ = _setup(None, seed=3)
    _train(target, target_opt, target_sched, None, 1)
    before = _snapshot(target, target_opt)
    fresh, fresh_opt, _, _ = _setup(None, seed=4)
    rng_before = torch.get_rng_state()
    for label, (path, message) in _corrupt_variants(good).items():
        with pytest.raises(CheckpointError, match=message):
            ckpt.load(path, target, target_opt)
        after = _snapshot(target, target_opt)
        assert all(torch.equal(before[k], after[k]) for k in before), f"{label}: model or optimizer was touched"
        with pytest.raises(CheckpointError, match=message):
            ckpt.load(path, fresh, fresh_opt)
        assert not fresh_opt.state, f"{label}: a fresh optimizer got state"
    assert torch.equal(torch.get_rng_state(), rng_before)

    # The wrong model, a missing optimizer state, a path that is a root of checkpoints.
    other = Transformer(TransformerConfig.from_preset("tiny", n_layers=3))
    with pytest.raises(CheckpointError, match="does not fit the model"):
        ckpt.load(good, other)
    wide = Transformer(TransformerConfig.from_preset("tiny", ffn_dim=256))
    with pytest.raises(CheckpointError, match="shapes differ"):
        ckpt.load(good, wide)
    model_only = Path(ckpt.save(tmp_path / "model-only", target))
    with pytest.raises(CheckpointError, match="no optimizer state"):
        ckpt.load(model_only, target, target_opt)
    with pytest.raises(CheckpointError, match=r"pass resolve_latest\(root\)"):
        ckpt.load(tmp_path, target)
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        ckpt.load(tmp_path / "absent", target)
    after = _snapshot(target, target_opt)
    assert all(torch.equal(before[k], after[k]) for k in before)

    # latest() skips the corrupt ones (with a warning) and the unmarked one silently.
    with pytest.warns(UserWarning, match="skipping corrupt checkpoint"):
        found = ckpt.latest(tmp_path)
    assert found in (str(good), str(model_only))


def test_extra_state_must_be_tensors_or_json(tmp_path):
    net = Transformer(TransformerConfig.from_preset("tiny"))
    opt = torch.optim.AdamW(net.parameters())
    sched = torch.optim.lr_scheduler.LinearLR(opt)
    with pytest.raises(CheckpointError, match="'scheduler' is a LinearLR.*scheduler.state_dict"):
        ckpt.save(tmp_path / "x", net, opt, scheduler=sched)
    with pytest.raises(CheckpointError, match="dict keys must be strings"):
        ckpt.save(tmp_path / "x", net, data={1: 2})
    with pytest.raises(CheckpointError, match="keep_last=0"):
        ckpt.save(tmp_path / "x", net, keep_last=0)
    assert list(tmp_path.iterdir()) == []  # nothing written
    # Tensors and nested JSON values round-trip exactly.
    extra = dict(step=3, t=torch.arange(4.0), nested={"a": [1, 2.5, None, True], "b": (torch.ones(2, 2), "x")})
    path = ckpt.save(tmp_path / "y", net, **extra)
    got = ckpt.load(path, net)
    assert got["step"] == 3 and got["nested"]["a"] == [1, 2.5, None, True] and got["nested"]["b"][1] == "x"
    assert torch.equal(got["t"], extra["t"]) and torch.equal(got["nested"]["b"][0], torch.ones(2, 2))


# ----------------------------------------------------------------------------- rollback + rank-local failures, 2 ranks


def _caught(fn, *args, **kwargs) -> str | None:
    """``fn``'s CheckpointError message, or None if it returned."""
    try:
        fn(*args, **kwargs)
    except CheckpointError as e:
        return str(e)
    return None


def job_rollback_and_agreement(root: str) -> dict[str, Any]:
    """FSDP2 x2. Rollback: save step-5, step-10 (keep_last=2), resume from step-5, save step-6
    (keep_last=1). Then failures seen by rank 1 only (a corrupt view of the files, another path, bad
    extra state, a failed async write): both ranks must raise the same CheckpointError, no hang."""
    import warnings
    from concurrent.futures import Future

    rank = dist.get_rank()
    run = Path(root) / "run"
    _seed_all(0)
    net, opt, sched, mesh = _setup(FSDP2)
    out: dict[str, Any] = {}
    _train(net, opt, sched, mesh, 5)
    ckpt.save(run / "step-5", net, opt, step=5, keep_last=2)
    _train(net, opt, sched, mesh, 5)
    ckpt.save(run / "step-10", net, opt, step=10, keep_last=2)
    out["before_rollback"] = _names(run)
    assert ckpt.load(run / "step-5", net, opt)["step"] == 5  # the rollback
    _train(net, opt, sched, mesh, 1)
    out["state6"] = _full_state(net, opt)
    ckpt.save(run / "step-6", net, opt, step=6, keep_last=1)
    out["after_rollback"] = _names(run)
    out["resolved"] = ckpt.resolve_latest(run)
    _train(net, opt, sched, mesh, 1)  # move away from step 6, so loading it back is visible

    # Rank 1 sees every checkpoint as corrupt (its reads hash to something else).
    from ndparallel.checkpoint import checksums

    real_sha256 = checksums.sha256_file
    if rank == 1:
        checksums.sha256_file = lambda path: "0" * 64
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out["own_latest"] = ckpt.latest(run)  # rank 1 alone would resume from nothing
        out["resolved_corrupt_view"] = ckpt.resolve_latest(run)
    before = _full_state(net, opt)
    start = time.monotonic()
    out["corrupt"] = _caught(ckpt.load, out["resolved"], net, opt)
    out["corrupt_s"] = time.monotonic() - start
    checksums.sha256_file = real_sha256
    after = _full_state(net, opt)  # a collective: every rank calls it
    out["untouched"] = before is None or all(np.array_equal(v, before[k]) for k, v in after.items())

    # Another path on rank 1 (e.g. each rank called latest() and saw different directories).
    out["other_path"] = _caught(ckpt.load, run / "step-5" if rank == 1 else out["resolved"], net, opt)
    # Extra state that only rank 1 cannot store.
    out["bad_extra"] = _caught(ckpt.save, run / "step-7", net, opt, step=7 if rank == 0 else np.int64(7))
    # An asynchronous write that failed on rank 1 only: nothing is committed, on any rank.
    handle = ckpt.save_async(run / "step-8", net, opt, step=8)
    if rank == 1:
        handle._future.result()  # the real write finishes (its collectives need this rank)
        handle._future = Future()
        handle._future.set_exception(OSError(28, "No space left on device"))
    out["async"] = _caught(handle.wait)
    dist.barrier()
    out["after_failures"] = _names(run)
    # Flipped bytes in the shard that rank 1 verifies: both ranks raise, naming the file and rank 1.
    flipped = Path(root) / "flipped"
    if rank == 0:
        shutil.copytree(out["resolved"], flipped)
        _flip_bytes(flipped / "__1_0.distcp")
    dist.barrier()
    out["flipped"] = _caught(ckpt.load, flipped, net, opt)

    # The process group is still in step: load step-6 back and compare with the state saved.
    ckpt.load(out["resolved"], net, opt)
    out["loaded6"] = _full_state(net, opt)
    return out


def test_rollback_newest_commit_wins_and_rank_local_failures_raise_everywhere(tmp_path):
    results = run_distributed(job_rollback_and_agreement, 2, str(tmp_path), timeout=120)
    r0, r1 = results
    step6 = str(tmp_path / "run" / "step-6")
    # Defect 1: the new branch's step-6 survives keep_last=1 and is the latest; step-10 is pruned.
    assert r0["before_rollback"] == ["step-10", "step-5"]
    assert r0["after_rollback"] == r1["after_rollback"] == ["step-6"]
    assert r0["resolved"] == r1["resolved"] == step6 == ckpt.latest(tmp_path / "run")
    _assert_same_state(r0["loaded6"], r0["state6"])
    # resolve_latest: rank 0 decides, even where rank 1's own scan disagrees.
    assert r0["own_latest"] == step6 and r1["own_latest"] is None
    assert r0["resolved_corrupt_view"] == r1["resolved_corrupt_view"] == step6
    # Defect 2: rank 1's corrupt view stops both ranks before DCP, with the same error naming rank 1.
    for key, reason in [
        ("corrupt", "rank 1 of 2: checkpoint .* is corrupt: '.metadata' does not match its SHA-256"),
        ("other_path", "rank 1 of 2: rank 1 loads .*step-5', rank 0 .*step-6': every rank must load the same"),
        ("bad_extra", r"not saved \(nothing written\): rank 1 of 2: checkpoint state 'step' is a int64"),
        ("async", r"nothing committed\): rank 1 of 2: OSError: \[Errno 28\] No space left on device"),
        ("flipped", r"rank 1 of 2: checkpoint .*flipped' is corrupt: '__1_0.distcp' does not match its SHA-256"),
    ]:
        assert r0[key] is not None and r0[key] == r1[key], (key, r0[key], r1[key])
        assert re.search(reason, r0[key]), (key, r0[key])
    assert r0["untouched"]
    assert r0["after_failures"] == ["step-6"]  # no step-7, no step-8, no temporary directories
    print(f"agreed failure of a corrupt view on rank 1 took {max(r0['corrupt_s'], r1['corrupt_s']):.2f}s")


# ----------------------------------------------------------------------------- keep-last-k, safetensors


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP's single-process note, from its thread
def test_keep_last_prune_replace_and_async(tmp_path, monkeypatch):
    net = Transformer(TransformerConfig.from_preset("tiny"))
    for step in (1, 2, 3, 4):
        ckpt.save(tmp_path / f"step-{step}", net, step=step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3", "step-4"]
    assert ckpt.latest(tmp_path) == str(tmp_path / "step-4")
    # Ordered by commit, not by name or step: step-9 committed after step-10 (a rollback) is the latest.
    ckpt.save(tmp_path / "step-10", net, step=10)
    ckpt.save(tmp_path / "step-9", net, step=9)
    assert ckpt.latest(tmp_path) == ckpt.resolve_latest(tmp_path) == str(tmp_path / "step-9")
    assert sorted(Path(p).name for p in ckpt.prune(tmp_path, 1)) == ["step-10", "step-3", "step-4"]
    assert [p.name for p in tmp_path.iterdir()] == ["step-9"]
    assert ckpt.latest(tmp_path / "empty") is None and ckpt.resolve_latest(tmp_path / "empty") is None
    # Replacing an existing checkpoint: atomic exchange (Linux), and the two-rename fallback.
    for exchange in (True, False):
        if not exchange:
            monkeypatch.setattr(ckpt.storage, "_exchange", lambda a, b: False)
        net = Transformer(TransformerConfig.from_preset("tiny", seed=20 + exchange))
        ckpt.save(tmp_path / "step-9", net, step=9)
        assert [p.name for p in tmp_path.iterdir()] == ["step-9"]
        loaded = Transformer(TransformerConfig.from_preset("tiny", seed=1))
        ckpt.load(tmp_path / "step-9", loaded)
        assert _same_weights(net, loaded)
    # Asynchronous save in one process: nothing at the path until wait() commits.
    handle = ckpt.save_async(tmp_path / "step-11", net, step=11, keep_last=1)
    assert isinstance(handle, ckpt.AsyncSave)
    assert handle.wait() == str(tmp_path / "step-11") == ckpt.latest(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["step-11"]


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_rollback_keep_last_two_and_clock_behind(tmp_path):
    """keep_last=2 across a rollback, and a commit whose clock is behind a sibling's marker."""
    net = Transformer(TransformerConfig.from_preset("tiny"))
    for step in (5, 10):
        ckpt.save(tmp_path / f"step-{step}", net, step=step, keep_last=2)
    # Resumed from step-5: the new branch's saves are the newest commits; the abandoned step-10
    # ages out like any older commit (here it is the second most recent, so it is kept once).
    ckpt.save(tmp_path / "step-6", net, step=6, keep_last=2)
    assert _names(tmp_path) == ["step-10", "step-6"] and ckpt.latest(tmp_path) == str(tmp_path / "step-6")
    ckpt.save(tmp_path / "step-7", net, step=7, keep_last=2)
    assert _names(tmp_path) == ["step-6", "step-7"] and ckpt.latest(tmp_path) == str(tmp_path / "step-7")
    # A sibling committed "in the future" (another host's clock ahead, a copied-in checkpoint):
    # the checkpoint committed now still comes last, so keep_last=1 keeps it, not the sibling.
    marker = json.loads((tmp_path / "step-7" / ckpt.MARKER).read_text())
    marker["created_unix"] = time.time() + 3600
    (tmp_path / "step-7" / ckpt.MARKER).write_text(json.dumps(marker))
    ckpt.validate(tmp_path / "step-7")  # the marker itself is not hashed: still a valid checkpoint
    ckpt.save(tmp_path / "step-8", net, step=8, keep_last=1)
    assert _names(tmp_path) == ["step-8"] and ckpt.latest(tmp_path) == str(tmp_path / "step-8")
    committed = json.loads((tmp_path / "step-8" / ckpt.MARKER).read_text())["created_unix"]
    assert committed > marker["created_unix"]


def test_safetensors_import_checks_and_missing_package(tmp_path, monkeypatch):
    net = Transformer(TransformerConfig.from_preset("tiny"))
    file = ckpt.export_safetensors(net, tmp_path / "w.safetensors")
    other = Transformer(TransformerConfig.from_preset("tiny", seed=4))
    ckpt.import_safetensors(file, other)
    assert _same_weights(net, other)
    with pytest.raises(CheckpointError, match="does not fit the model"):
        ckpt.import_safetensors(file, Transformer(TransformerConfig.from_preset("tiny", n_layers=3)))
    (tmp_path / "bad.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        ckpt.import_safetensors(tmp_path / "bad.safetensors", other)
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match="pip install safetensors"):
        ckpt.export_safetensors(net, tmp_path / "w2.safetensors")


# ----------------------------------------------------------------------------- hostile checkpoints (issue 11)


class _Payload:
    """Unpickling this writes ``file``: stands for any code a forged checkpoint could try to run."""

    def __init__(self, file: Path):
        self.file = str(file)

    def __reduce__(self):
        return (exec, (f"open({self.file!r}, 'w').write('pwned')",))


def _small_checkpoint(root: Path, name: str = "good", seed: int = 0) -> Path:
    net = Transformer(TransformerConfig.from_preset("tiny", seed=seed))
    return Path(ckpt.save(root / name, net, step=1))


def _rewrite_marker(path: Path, edit) -> None:
    marker = json.loads((path / ckpt.MARKER).read_text())
    edit(marker)
    (path / ckpt.MARKER).write_text(json.dumps(marker))


def _forge_metadata(good: Path, dest: Path, obj: Any, fix_hash: bool = True) -> Path:
    """A copy of ``good`` whose DCP ``.metadata`` is the pickle of ``obj``; the marker's hash forged to match."""
    import hashlib
    import pickle

    shutil.copytree(good, dest)
    (dest / ".metadata").write_bytes(pickle.dumps(obj))

    def forge(marker: dict) -> None:
        marker["files"][".metadata"] = (dest / ".metadata").stat().st_size
        marker["sha256"][".metadata"] = hashlib.sha256((dest / ".metadata").read_bytes()).hexdigest()

    if fix_hash:
        _rewrite_marker(dest, forge)
    return dest


def test_forged_metadata_never_runs_code(tmp_path):
    """DCP's .metadata is a pickle: a forged one (hash forged too, or deleted) must be refused, never run."""
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    good = _small_checkpoint(tmp_path)
    pwned = tmp_path / "pwned.txt"
    real = pickle.loads((good / ".metadata").read_bytes())  # our own file: trusted here
    nested = pickle.loads((good / ".metadata").read_bytes())
    nested.planner_data = {"x": _Payload(pwned)}  # hidden deep inside a valid Metadata
    as_bytes = pickle.loads((good / ".metadata").read_bytes())
    key = next(iter(as_bytes.state_dict_metadata))
    as_bytes.state_dict_metadata[key] = BytesStorageMetadata()  # DCP would torch.load(weights_only=False) it
    forged = {
        "payload": _forge_metadata(good, tmp_path / "payload", _Payload(pwned)),
        "nested": _forge_metadata(good, tmp_path / "nested", nested),
        "bytes-entry": _forge_metadata(good, tmp_path / "bytes-entry", as_bytes),
    }
    no_hash = _forge_metadata(good, tmp_path / "no-hash", _Payload(pwned))
    _rewrite_marker(no_hash, lambda m: m["sha256"].pop(".metadata"))
    bad_hash = _forge_metadata(good, tmp_path / "bad-hash", real, fix_hash=False)
    _rewrite_marker(bad_hash, lambda m: m["sha256"].update({".metadata": "x"}))
    net = Transformer(TransformerConfig.from_preset("tiny", seed=3))
    for name, path in forged.items():
        for attempt in (lambda p=path: ckpt.load(p, net), lambda p=path: ckpt.export_safetensors(p, tmp_path / "o")):
            with pytest.raises(CheckpointError, match=r"not plain DCP metadata: .*refused, nothing in it was run"):
                attempt()
            assert not pwned.exists(), f"{name}: the forged checkpoint ran code"
    for path, message in [
        (no_hash, r"no SHA-256 for \['.metadata'\]"),
        (bad_hash, "field 'sha256' is .*must be a table of file names to 64 lowercase hex"),
    ]:
        with pytest.raises(CheckpointError, match=message):
            ckpt.load(path, net)
        with pytest.raises(CheckpointError, match=message):
            ckpt.export_safetensors(path, tmp_path / "o")
    assert not pwned.exists()
    assert not (tmp_path / "o").exists()

    # The state JSON names dtypes as torch attributes: only a dtype is accepted (hash forged too).
    import hashlib

    odd = tmp_path / "odd-dtype"
    shutil.copytree(_small_checkpoint(tmp_path, "with-extra", seed=1), odd)
    state = json.loads((odd / ckpt.STATE_FILE).read_text())
    state["extra"] = {"t": {"__tensor__": "extra.t", "shape": [1], "dtype": "load"}}
    (odd / ckpt.STATE_FILE).write_text(json.dumps(state))
    digest = hashlib.sha256((odd / ckpt.STATE_FILE).read_bytes()).hexdigest()
    size = (odd / ckpt.STATE_FILE).stat().st_size
    _rewrite_marker(
        odd, lambda m: (m["sha256"].update({ckpt.STATE_FILE: digest}), m["files"].update({ckpt.STATE_FILE: size}))
    )
    with pytest.raises(CheckpointError, match="dtype 'load', not a torch dtype"):
        ckpt.load(odd, net)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP's single-process note, from its thread
def test_pruning_removes_only_what_ndparallel_created(tmp_path):
    """Leftover-looking names of the user's (``results.old-2024``, ``db.tmp-1``, even our exact format
    without our stamp) survive every save and prune; a leftover of our own crashed save does not."""
    net = Transformer(TransformerConfig.from_preset("tiny"))
    day_ago = time.time() - 86400
    users = ["results.old-2024", "db.tmp-1", "step-2.tmp-1", "step-2.old-abc", "x.tmp-0123456789abcdef"]
    for name in users:
        (tmp_path / name).mkdir()
        (tmp_path / name / "data.txt").write_text("the user's")
        os.utime(tmp_path / name, (day_ago, day_ago))
    handle = ckpt.save_async(tmp_path / "step-1", net, step=1)
    handle._future.result()  # written, never committed: a leftover of ours, as after a crash
    ours = [p for p in tmp_path.iterdir() if p.name.startswith("step-1.tmp-")]
    assert len(ours) == 1
    os.utime(ours[0], (day_ago, day_ago))
    for step in (2, 3):
        ckpt.save(tmp_path / f"step-{step}", net, step=step, keep_last=1)
    assert _names(tmp_path) == sorted([*users, "step-3"]), "only our own leftover and step-2 may go"
    assert ckpt.prune(tmp_path, 1) == []
    for name in users:
        assert (tmp_path / name / "data.txt").read_text() == "the user's"


_BAD_FIELDS: list[tuple[str, Any, str]] = [
    ("created_unix", float("nan"), "created_unix"),
    ("created_unix", float("inf"), "created_unix"),
    ("created_unix", "yesterday", "created_unix"),
    ("created_unix", True, "created_unix"),
    ("step", "5", "step"),
    ("step", True, "step"),
    ("step", -1, "step"),
    ("world_size", 0, "world_size"),
    ("rng_ranks", -2, "rng_ranks"),
    ("has_optimizer", "yes", "has_optimizer"),
    ("mesh", "dp_shard", "mesh"),
    ("format_version", "1", "format_version"),
    ("format_version", True, "format_version"),
    ("files", ["__0_0.distcp"], "files"),
    ("files", {"../../etc/passwd": 1}, "files"),
    ("files", {"/etc/passwd": 1}, "files"),
    ("sha256", ["x"], "sha256"),
    ("sha256", {".metadata": 5}, "sha256"),
]


def test_markers_are_validated_field_by_field_and_order_trusts_no_bad_number(tmp_path):
    net = Transformer(TransformerConfig.from_preset("tiny"))
    good = Path(ckpt.save(tmp_path / "fields" / "good", net, step=1))
    for field, value, message in _BAD_FIELDS:
        bad = tmp_path / "fields" / "bad"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(good, bad)
        _rewrite_marker(bad, lambda m, f=field, v=value: m.update({f: v}))
        with pytest.raises(CheckpointError, match=message):
            ckpt.validate(bad)
    _rewrite_marker(bad, lambda m: m.pop("created_unix"))
    with pytest.raises(CheckpointError, match="created_unix"):
        ckpt.validate(bad)
    unknown = tmp_path / "fields" / "future"
    shutil.copytree(good, unknown)
    _rewrite_marker(unknown, lambda m: m.update(format_version=99))
    with pytest.raises(CheckpointError, match="format_version 99; this ndparallel reads version"):
        ckpt.validate(unknown)

    # A NaN commit time in step-2's marker: step-2 is skipped (with a warning naming it), never
    # taken for the latest, never the reason a newer checkpoint is pruned, and no new commit time is NaN.
    run = tmp_path / "run"
    for step in (2, 4, 6):
        ckpt.save(run / f"step-{step}", net, step=step, keep_last=3)
    _rewrite_marker(run / "step-2", lambda m: m.update(created_unix=float("nan")))
    _rewrite_marker(run / "step-4", lambda m: m.update(sha256=["x"]))
    with pytest.warns(UserWarning) as caught:
        assert ckpt.latest(run) == ckpt.resolve_latest(run) == str(run / "step-6")
    skipped = " ".join(str(w.message) for w in caught)
    assert "step-2" in skipped and "step-4" in skipped and "skipping corrupt checkpoint" in skipped
    with pytest.warns(UserWarning, match="skipping corrupt checkpoint"):
        ckpt.save(run / "step-8", net, step=8, keep_last=2)
    assert _names(run) == ["step-2", "step-4", "step-6", "step-8"], "corrupt ones are left alone, good ones kept"
    created = json.loads((run / "step-8" / ckpt.MARKER).read_text())["created_unix"]
    assert np.isfinite(created)
    with pytest.warns(UserWarning, match="skipping corrupt checkpoint"):
        assert ckpt.latest(run) == str(run / "step-8")


def _flip_bytes(file: Path, offset: int = 20000, count: int = 8) -> None:
    data = bytearray(file.read_bytes())
    assert len(data) >= offset + count
    for i in range(offset, offset + count):
        data[i] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP's single-process note, from its thread
def test_every_file_is_checksummed_at_save_and_verified_at_load(tmp_path, monkeypatch):
    import threading

    from ndparallel.checkpoint import checksums

    net, opt, sched, _ = _setup(None)
    _train(net, opt, sched, None, 1)
    hashed_in: dict[str, str] = {}
    real_sha256 = checksums.sha256_file

    def recording_sha256(path: Path) -> str:
        hashed_in.setdefault(Path(path).name, threading.current_thread().name)
        return real_sha256(path)

    monkeypatch.setattr(checksums, "sha256_file", recording_sha256)
    handle = ckpt.save_async(tmp_path / "step-1", net, opt, step=1)
    path = Path(handle.wait())
    monkeypatch.undo()
    marker = json.loads((path / ckpt.MARKER).read_text())
    assert marker["format_version"] == 3
    assert set(marker["sha256"]) == set(marker["files"]) and "__0_0.distcp" in marker["files"]
    assert hashed_in["__0_0.distcp"] != threading.main_thread().name, "an async save hashes in the background"

    # 8 flipped bytes in the shard (same size): refused by default, naming the file; loads with verify=False.
    _flip_bytes(path / "__0_0.distcp")
    ckpt.validate(path)  # the quick check (sizes, small files) cannot see it ...
    with pytest.raises(CheckpointError, match=r"'__0_0.distcp' does not match its SHA-256"):
        ckpt.validate(path, checksums=True)  # ... the full one can
    target, target_opt, _, _ = _setup(None, seed=3)
    before = _snapshot(target, target_opt)
    with pytest.raises(CheckpointError, match=r"'__0_0.distcp' does not match its SHA-256"):
        ckpt.load(path, target, target_opt)
    assert all(torch.equal(v, _snapshot(target, target_opt)[k]) for k, v in before.items())
    with pytest.raises(CheckpointError, match=r"'__0_0.distcp' does not match its SHA-256"):
        ckpt.export_safetensors(path, tmp_path / "w.safetensors")
    ckpt.load(path, target, target_opt, verify=False)  # the user's choice for huge checkpoints
    assert not _same_weights(target, net), "the flipped bytes reached a tensor"
    ckpt.export_safetensors(path, tmp_path / "w.safetensors", verify=False)

    # A checkpoint of format version 1 (hashes of .metadata and the state JSON only) still loads.
    v1 = Path(ckpt.save(tmp_path / "v1", net, opt, step=1))
    _rewrite_marker(
        v1, lambda m: m.update(format_version=1, sha256={k: m["sha256"][k] for k in (".metadata", ckpt.STATE_FILE)})
    )
    ckpt.load(v1, target, target_opt)
    assert _same_weights(target, net)


def test_a_non_finite_state_is_never_committed_nor_prunes_a_finite_one(tmp_path):
    net, opt, sched, _ = _setup(None)
    _train(net, opt, sched, None, 1)
    for step in (1, 2):
        ckpt.save(tmp_path / f"step-{step}", net, opt, step=step, keep_last=2)
    with torch.no_grad():
        net.layers[1].attention.wq.weight[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match=r"'model.layers.1.attention.wq.weight' has NaN or inf"):
        ckpt.save(tmp_path / "step-3", net, opt, step=3, keep_last=2)
    with pytest.raises(CheckpointError, match=r"'model.layers.1.attention.wq.weight' has NaN or inf"):
        ckpt.save_async(tmp_path / "step-3", net, opt, step=3, keep_last=2)
    assert _names(tmp_path) == ["step-1", "step-2"], "nothing written, nothing pruned"
    with torch.no_grad():
        net.layers[1].attention.wq.weight[0, 0] = 0.0
        next(iter(opt.state.values()))["exp_avg_sq"].fill_(float("inf"))
    with pytest.raises(CheckpointError, match=r"'optimizer.state.* has NaN or inf"):
        ckpt.save(tmp_path / "step-3", net, opt, step=3, keep_last=2)
    assert _names(tmp_path) == ["step-1", "step-2"]
    ckpt.save(tmp_path / "inspect", net, opt, allow_nonfinite=True)  # on purpose, e.g. to debug a divergence
    assert ckpt.latest(tmp_path) == str(tmp_path / "inspect")


# ----------------------------------------------------------------------------- format version 2 still loads

V2_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_v2"
"""Written by ndparallel at b7fe050 (format version 2: nested optimizer section, one rank's keys) with
``make_v2_fixture(V2_FIXTURE)`` below, run against that commit's code. Tiny (a 3-4-2 MLP): a few KB."""


def _v2_setup(shift: float = 0.0, lr: float | None = None):
    """A float64 MLP with weights from linspace (no RNG), AdamW with two param groups, a LinearLR schedule."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.linspace(-1, 1, p.numel(), dtype=torch.float64).reshape(p.shape) * (i + 1) + shift)
    groups = [
        {"params": model[0].parameters(), "lr": lr or 1e-2},
        {"params": model[2].parameters(), "lr": lr or 5e-3, "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95), weight_decay=0.1)
    return model, opt, torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=4)


def _v2_step(model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> None:
    model(torch.linspace(-1, 1, 15, dtype=torch.float64).reshape(5, 3)).pow(2).mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def make_v2_fixture(path: Path) -> None:
    model, opt, sched = _v2_setup()
    _v2_step(model, opt, sched)
    ckpt.save(path, model, opt, step=1, scheduler=sched.state_dict(), save_rng=False)


@_one_thread()
def test_a_format_version_2_checkpoint_still_loads_and_continues():
    assert json.loads((V2_FIXTURE / ckpt.MARKER).read_text())["format_version"] == 2
    assert isinstance(json.loads((V2_FIXTURE / ckpt.STATE_FILE).read_text())["optimizer"]["param_groups"], list)
    ref_model, ref_opt, ref_sched = _v2_setup()
    _v2_step(ref_model, ref_opt, ref_sched)
    model, opt, sched = _v2_setup(shift=0.3, lr=0.9)
    extra = ckpt.load(V2_FIXTURE, model, opt)
    sched.load_state_dict(extra["scheduler"])
    assert extra["step"] == 1
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in ref_opt.param_groups
    ]
    # The fixture's step ran on another CPU: float64 kernels differ there by an ulp (8.9e-16 measured on an
    # AVX-512 Xeon), so the reference step recomputed here is matched to 1e-12, the step counts exactly.
    for name, state in ref_opt.state_dict()["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(
                opt.state_dict()["state"][name][key], value, rtol=0, atol=1e-12, msg=str((name, key))
            )
    _v2_step(ref_model, ref_opt, ref_sched)
    _v2_step(model, opt, sched)
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)

    # The two saved groups (lr 1e-2 and 5e-3) regrouped into one live group: refused, model untouched.
    one_group = torch.optim.AdamW(model.parameters(), lr=0.9, betas=(0.9, 0.95), weight_decay=0.1)
    before = _params(model)
    with pytest.raises(CheckpointError, match=r"one live parameter group \(that of '0.weight'\) different 'lr' values"):
        ckpt.load(V2_FIXTURE, model, one_group)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
