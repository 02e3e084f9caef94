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
        [sys.executable, "-m", "ndparallel", "launch", "--cpu-ranks", "4", "--", str(script)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(line.split()[1]) for line in result.stdout.splitlines() if re.match(r"^19 \d", line)]
    assert len(losses) == 4 and len(set(losses)) == 1, result.stdout[-2000:]  # every rank prints the global loss
