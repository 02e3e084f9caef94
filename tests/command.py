"""Run the ``ndparallel`` command in a child process, as a user's shell would (shared by the CLI tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
COMMAND = [sys.executable, "-m", "ndparallel"]


def clean_env() -> dict[str, str]:
    """This environment minus torchrun's rank variables (pytest may itself run inside a launcher)."""
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


def run_ndparallel(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``ndparallel ARGS`` from the repository root; waits and captures stdout/stderr as text."""
    return subprocess.run([*COMMAND, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=clean_env())


def start_ndparallel(*args: str, **popen: Any) -> subprocess.Popen:
    """``ndparallel ARGS`` from the repository root, without waiting."""
    return subprocess.Popen([*COMMAND, *args], cwd=REPO, env=clean_env(), **popen)
