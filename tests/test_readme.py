"""The README's usage example runs as written, on 4 CPU ranks (dp_shard 2 x tp 2) through launch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_readme_usage_example_runs(tmp_path):
    readme = (REPO / "README.md").read_text()
    code = re.search(r"## Usage\s+```python\n(.*?)```", readme, re.S).group(1)
    script = tmp_path / "usage.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run(
        # Each rank's stdout to its own file (torchrun's --log-dir/--redirects): 4 ranks printing to one
        # pipe at once can interleave within a line.
        [
            sys.executable,
            "-m",
            "ndparallel",
            "launch",
            "--cpu-ranks",
            "4",
            "--log-dir",
            str(tmp_path / "logs"),
            "--redirects",
            "1",
            "--",
            str(script),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = sorted((tmp_path / "logs").rglob("stdout.log"))
    assert len(outputs) == 4, outputs
    losses = [
        float(line.split()[1]) for out in outputs for line in out.read_text().splitlines() if line.startswith("19 ")
    ]
    assert len(losses) == 4 and len(set(losses)) == 1, losses  # every rank prints the same global loss
