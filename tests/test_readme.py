"""The README's usage example runs as written, on 4 CPU ranks (dp_shard 2 x tp 2) through launch."""

from __future__ import annotations

import re

import pytest

from tests.command import REPO, run_ndparallel

pytestmark = pytest.mark.jobs  # real launchers, torchrun, CLI processes or signals: not in make test-fast


def test_readme_usage_example_runs(tmp_path):
    readme = (REPO / "README.md").read_text()
    code = re.search(r"## Usage\s+```python\n(.*?)```", readme, re.S).group(1)
    script = tmp_path / "usage.py"
    script.write_text(code)
    # Each rank's stdout to its own file (torchrun's --log-dir/--redirects): 4 ranks printing to one
    # pipe at once can interleave within a line.
    logs = tmp_path / "logs"
    result = run_ndparallel(
        "launch", "--cpu-ranks", "4", "--log-dir", str(logs), "--redirects", "1", "--", str(script), timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = sorted(logs.rglob("stdout.log"))
    assert len(outputs) == 4, outputs
    losses = [
        float(line.split()[1]) for out in outputs for line in out.read_text().splitlines() if line.startswith("19 ")
    ]
    assert len(losses) == 4 and len(set(losses)) == 1, losses  # every rank prints the same global loss
