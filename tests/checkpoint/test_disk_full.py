"""A save into a full disk, on 2 real gloo ranks: one line naming "no space left on device" and the folder on
every rank (it was DCP's CheckpointException with every rank's traceback, 193 lines, ending in torch's
"unexpected pos 704 vs 598"), nothing committed, no partial folder left, the previous checkpoint intact.

The full disk is a 256 KiB tmpfs mounted in a private mount namespace (``unshare --mount``, as root or through a
user namespace); the child that mounts it runs the ranks. Where neither is allowed the test is skipped, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.jobs  # a child process in its own mount namespace

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, sys
from tests.checkpoint.test_disk_full import save_twice
from ndparallel.testing import run_distributed
print(json.dumps(run_distributed(save_twice, 2, sys.argv[1], timeout=240)))
"""


def save_twice(root: str) -> dict:
    """On every rank: a small checkpoint that fits, then one that does not; what each left behind."""
    import torch
    from torch import nn

    import ndparallel.checkpoint as ck
    from ndparallel.errors import CheckpointError

    torch.manual_seed(0)
    small = nn.Linear(8, 8)
    ck.save(f"{root}/step-1", small)
    try:
        ck.save(f"{root}/step-2", nn.Linear(512, 512))  # 1 MiB of weights into 256 KiB
        error = "saved"
    except CheckpointError as err:
        error = str(err)
    loaded = nn.Linear(8, 8)
    ck.load(f"{root}/step-1", loaded)
    same = all(
        torch.equal(a, b) for a, b in zip(small.state_dict().values(), loaded.state_dict().values(), strict=True)
    )
    return {"error": error, "left": sorted(os.listdir(root)), "step1_intact": same}


def test_a_full_disk_is_one_line_and_the_previous_checkpoint_stays(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    shell = f'mount -t tmpfs -o size=256k tmpfs {mount} && exec {sys.executable} -c "$0" {mount}'
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        ["unshare", "--mount", "--map-root-user", "sh", "-c", shell, SCRIPT],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=env,
    )  # fmt: skip
    if done.returncode and "mount" in done.stderr and "Traceback" not in done.stderr:
        pytest.skip(f"no private mount namespace here to make a full disk: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = json.loads(done.stdout.strip().splitlines()[-1])
    for r in ranks:
        assert r["error"].startswith("checkpoint 'step-2' not saved: no space left on device in "), r
        assert f"in '{mount}'" in r["error"] and "\n" not in r["error"] and "previous checkpoints are untouched" in r[
            "error"
        ], r  # fmt: skip
        assert r["left"] == ["step-1"] and r["step1_intact"], r
