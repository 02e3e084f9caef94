"""Launch an Accelerate script under real torchrun ranks, once with ndparallel and once with 🤗 Accelerate
(tests/accelerator/twin.py), and read back what each rank of each run wrote, for the comparison tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.command import REPO, clean_env

TWIN = REPO / "tests" / "accelerator" / "twin.py"
SCRIPTS = REPO / "tests" / "accelerator" / "scripts"


def run_twin(script: Path, out: Path, ranks: int, *args: str, timeout: float = 900, env: dict | None = None) -> str:
    """``script`` on ``ranks`` CPU processes, as ``accelerate launch --cpu`` would start it (ACCELERATE_USE_CPU),
    under ndparallel then Accelerate; results under ``out/ndparallel`` and ``out/accelerate``. Returns the log."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               str(TWIN), str(script), str(out), *args]  # fmt: skip
    variables = {**clean_env(), "ACCELERATE_USE_CPU": "true", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                 **(env or {})}  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=variables, cwd=REPO)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    return log


def rank_results(folder: Path, ranks: int) -> list[dict[str, Any]]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(ranks)]


def largest_difference(ours: Any, theirs: Any, path: str = "") -> tuple[float, str]:
    """The largest absolute difference between two JSON values of one shape (inf, and where, if they differ
    in shape, type or a non-number)."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        if ours.keys() != theirs.keys():
            return float("inf"), f"{path}: keys {sorted(ours)} != {sorted(theirs)}"
        found = [largest_difference(ours[k], theirs[k], f"{path}.{k}") for k in ours]
        return max(found, default=(0.0, path))
    if isinstance(ours, list) and isinstance(theirs, list):
        if len(ours) != len(theirs):
            return float("inf"), f"{path}: {len(ours)} items != {len(theirs)}"
        found = [largest_difference(a, b, f"{path}[{i}]") for i, (a, b) in enumerate(zip(ours, theirs, strict=True))]
        return max(found, default=(0.0, path))
    numbers = (int, float)
    if isinstance(ours, numbers) and isinstance(theirs, numbers) and not isinstance(ours, bool):
        return abs(ours - theirs), path
    return (0.0, path) if ours == theirs else (float("inf"), f"{path}: {ours!r} != {theirs!r}")
