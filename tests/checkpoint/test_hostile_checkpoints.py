"""Hostile checkpoints (issue 27): a forged ``.metadata`` or forged shard data with the marker's hashes
recomputed, and the edge state a save leaves when it dies between the two renames of a replacement.

latest() skips a checkpoint whose metadata the allow-list refuses (with a warning naming it; never loaded,
never deleted); a shard torch cannot read is named in one line on every rank; a complete checkpoint left
in ``<name>.old-<id>`` is never pruned and offered back by name (``mv``).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from ndparallel import checkpoint as ckpt
from ndparallel.checkpoint import CheckpointError
from ndparallel.models import Transformer, TransformerConfig
from ndparallel.testing import run_distributed
from tests.checkpoint.test_checkpoint import _Payload, _rewrite_marker

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP's single-process note


def _tiny(seed: int = 0) -> Transformer:
    return Transformer(TransformerConfig.from_preset("tiny", seed=seed))


def _forge(checkpoint: Path, name: str, data: bytes) -> None:
    """Replace ``checkpoint/name`` by ``data`` and recompute the marker's size and SHA-256 for it, as a forger
    who knows the format would: the checksums pass."""
    (checkpoint / name).write_bytes(data)

    def rehash(marker: dict) -> None:
        marker["files"][name] = len(data)
        marker["sha256"][name] = hashlib.sha256(data).hexdigest()

    _rewrite_marker(checkpoint, rehash)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


# ----------------------------------------------------------------------------- 1: a forged .metadata


def test_latest_skips_a_checkpoint_whose_metadata_the_allow_list_refuses(tmp_path):
    import pickle

    ckpt.save(tmp_path / "step-1", _tiny(1), step=1)
    ckpt.save(tmp_path / "step-2", _tiny(2), step=2)
    pwned = tmp_path / "pwned.txt"
    _forge(tmp_path / "step-2", ".metadata", pickle.dumps(_Payload(pwned)))
    with pytest.warns(UserWarning, match=r"skipping corrupt checkpoint: checkpoint '.*step-2': '.metadata' is not"):
        assert ckpt.latest(tmp_path) == str(tmp_path / "step-1")
    with pytest.raises(CheckpointError, match="not plain DCP metadata"):
        ckpt.validate(tmp_path / "step-2")
    with pytest.warns(UserWarning, match="skipping corrupt checkpoint"):
        assert ckpt.prune(tmp_path, 1) == []  # the corrupt one is not counted, and never deleted
    assert (tmp_path / "step-2" / ".metadata").exists() and not pwned.exists()
    net = _tiny(3)
    with pytest.warns(UserWarning, match="skipping corrupt checkpoint"):
        ckpt.load(ckpt.resolve_latest(tmp_path), net)  # --resume falls back to the older valid one
    assert _same_weights(net, _tiny(1)) and not pwned.exists()


# ----------------------------------------------------------------------------- 3: forged shard data


def _load_forged_shards(root: str) -> dict:
    """2 ranks, dp_shard 2: save, forge rank 1's shard file (hashes recomputed), load; the error on each rank."""
    import torch.distributed as dist

    import ndparallel as ndp
    from ndparallel.parallel.parallelize import parallelize

    mesh = ndp.init_distributed(ndp.ParallelismConfig(dp_shard_size=2), device_type="cpu")
    net = parallelize(_tiny(1), mesh.config, mesh)
    path = Path(ckpt.save(Path(root) / "forged", net, step=1))
    shard = sorted(p.name for p in path.iterdir() if p.suffix == ".distcp")[-1]
    if dist.get_rank() == 0:
        _forge(path, shard, os.urandom((path / shard).stat().st_size))
    dist.barrier()
    try:
        ckpt.load(path, net)
    except CheckpointError as e:
        return {"shard": shard, "error": str(e)}
    return {"shard": shard, "error": None}


def test_forged_shard_data_is_named_in_one_line_on_every_rank(tmp_path):
    results = run_distributed(_load_forged_shards, 2, str(tmp_path), timeout=180)
    for result in results:
        error, shard = result["error"], result["shard"]
        assert error is not None, "the forged checkpoint loaded"
        assert error.startswith("rank 1: checkpoint "), error
        assert f"{shard!r} is not a DCP shard torch can read" in error and "\n" not in error, error
        assert "set to `False`" not in error, "torch's advice to load with weights_only=False must not be passed on"
    assert results[0]["error"] == results[1]["error"]
    with pytest.raises(CheckpointError, match=r"'__\d_0.distcp' is not a DCP shard torch can read") as caught:
        ckpt.load(tmp_path / "forged", _tiny())  # one process reads every file
    assert "\n" not in str(caught.value)


# ----------------------------------------------------------------------------- 2: a crash between the two renames


def _crash_between_renames(root: Path) -> tuple[Path, Path]:
    """The state ``_replace_dir`` leaves where RENAME_EXCHANGE is missing and the save dies between its two
    renames while replacing ``root/last``: ``last`` moved to ``last.old-<id>``, the new one still in
    ``last.tmp-<id>`` (complete: the marker was written before the renames), ``last`` itself missing."""
    ckpt.save(root / "step-1", _tiny(1), step=1)
    ckpt.save(root / "last", _tiny(2), step=2)
    token = "00000000deadbeef"
    new = root.parent / f"{root.name}-elsewhere"
    ckpt.save(new / "last", _tiny(3), step=3)  # the new save's complete temporary directory
    old = root / f"last.old-{token}"
    os.rename(root / "last", old)  # the first rename
    os.rename(new / "last", root / f"last.tmp-{token}")  # where the second rename would have started
    return old, root / "last"


def test_a_checkpoint_left_between_the_two_renames_is_offered_back_and_never_pruned(tmp_path):
    """Both folders are complete and ``last`` is missing: the new checkpoint (``.tmp-``, step 3) is the newest,
    offered back by name; neither it nor the previous one (``.old-``, step 2) is ever pruned."""
    root = tmp_path / "ckpts"
    old, target = _crash_between_renames(root)
    new = root / "last.tmp-00000000deadbeef"
    restore = re.escape(f"mv {new} {target}")
    with pytest.raises(CheckpointError, match=f"complete new checkpoint in .*restore it with `{restore}`, or delete"):
        ckpt.latest(root)
    with pytest.raises(CheckpointError, match=f"restore it with `{restore}`"):
        ckpt.resolve_latest(root)  # what --resume asks
    with pytest.raises(
        CheckpointError, match=f"no checkpoint directory at {re.escape(repr(str(target)))}; .*`{restore}`"
    ):
        ckpt.load(target, _tiny())
    assert ckpt.prune(root, 1) == [] and old.is_dir() and new.is_dir()

    # A later save to another name (a job that resumed from step-1): both kept, and both offered back.
    for folder in (old, new):
        os.utime(folder, (0, 0))  # long before the newest commit, like any leftover prune would remove
    ckpt.save(root / "step-4", _tiny(4), step=4, keep_last=1)
    assert old.is_dir() and new.is_dir() and not (root / "step-1").exists()
    with pytest.warns(UserWarning) as said:
        assert ckpt.latest(root) == str(root / "step-4")
    kept = sorted(str(w.message) for w in said)
    assert len(kept) == 2 and re.search(f"kept: .*`{restore}`, or delete it", kept[0]), kept
    assert "complete previous checkpoint in" in kept[1] and str(old) in kept[1], kept

    # Renamed back as told: the new checkpoint loads bit-exactly, and the previous one is an ordinary leftover.
    os.rename(new, target)
    net = _tiny()
    ckpt.load(target, net)
    assert _same_weights(net, _tiny(3))
    assert ckpt.latest(root) == str(root / "step-4")
    assert ckpt.prune(root, 2) == [str(old)]


def test_a_save_of_the_same_name_keeps_the_stranded_copies_until_it_commits(tmp_path):
    """The crash state above, then a new save of ``last`` itself: its start (which removes what crashed saves of
    ``last`` left) keeps both complete copies, since that save may fail too; an incomplete leftover goes."""
    from ndparallel.checkpoint import storage

    root = tmp_path / "ckpts"
    old, target = _crash_between_renames(root)
    new = root / "last.tmp-00000000deadbeef"
    partial = root / "last.tmp-00000000cafef00d"
    partial.mkdir()
    storage.leftovers.write_stamp(partial, "last")  # ours, no marker: a save that died before committing
    storage.create_tmp(target, storage.tmp_path(target, "0000000012345678"))
    assert old.is_dir() and new.is_dir() and not partial.exists()
    ckpt.save(target, _tiny(5), step=5)  # it commits: the stranded copies are ordinary leftovers now
    net = _tiny()
    ckpt.load(target, net)
    assert _same_weights(net, _tiny(5)) and ckpt.latest(root) == str(target)


def test_a_first_save_that_died_before_its_rename_is_offered_back(tmp_path):
    """A save of a new name killed after its marker, before the rename: its complete ``.tmp-`` folder is the
    only copy of that checkpoint, newer than every committed one: offered back, not pruned."""
    root = tmp_path / "ckpts"
    ckpt.save(root / "step-1", _tiny(1), step=1)
    ckpt.save(tmp_path / "elsewhere" / "step-2", _tiny(2), step=2)
    new = root / "step-2.tmp-00000000feedf00d"
    os.rename(tmp_path / "elsewhere" / "step-2", new)
    restore = re.escape(f"mv {new} {root / 'step-2'}")
    with pytest.raises(CheckpointError, match=f"restore it with `{restore}`, or delete it to use '.*step-1'"):
        ckpt.latest(root)
    os.utime(new, (0, 0))
    assert ckpt.prune(root, 1) == [] and new.is_dir()


def test_an_old_folder_whose_replacement_finished_is_an_ordinary_leftover(tmp_path):
    """A crash after the second rename (before the old copy is deleted): ``last`` is complete, so its
    ``.old-`` folder is garbage and pruned as before."""
    root = tmp_path / "ckpts"
    old, target = _crash_between_renames(root)
    shutil.rmtree(root / "last.tmp-00000000deadbeef")
    ckpt.save(target, _tiny(5), step=5)
    os.utime(old, (0, 0))
    assert ckpt.latest(root) == str(target)
    assert ckpt.prune(root, 2) == [str(old)]
