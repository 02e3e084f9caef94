"""The ``ndparallel`` command skips the interpreter's garbage collections at exit, and only them.

A real child process runs the command's ``main`` and then leaves an object that only a reference cycle keeps
alive, whose ``__del__`` prints: the collections at exit would finalize it (the control, a plain process, shows
they do), a frozen heap does not. An ``atexit`` handler and a buffered file still run and flush as before.
"""

from __future__ import annotations

import subprocess
import sys

from tests.command import REPO, clean_env

SCRIPT = """
import atexit, sys
if sys.argv[1] == "command":
    from ndparallel.launch.cli import main
    assert main(["mesh", "--world-size", "4", "configs/demo.yaml"]) == 0

class Cycle:
    def __init__(self):
        self.me = self
    def __del__(self):
        print("finalized by the collector")

Cycle()
out = open(sys.argv[2], "w")
out.write("flushed at exit")  # never closed: module teardown flushes it
atexit.register(print, "atexit handler ran")
"""


def _run(mode: str, tmp_path) -> tuple[str, str]:
    written = tmp_path / f"{mode}.txt"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode, str(written)], capture_output=True, text=True, timeout=120, cwd=REPO,
        env=clean_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, written.read_text()


def test_the_command_freezes_the_heap_at_exit_and_keeps_the_rest_of_exit(tmp_path):
    plain, plain_file = _run("plain", tmp_path)
    assert "finalized by the collector" in plain  # the control: without the freeze the collector reaches it
    command, command_file = _run("command", tmp_path)
    assert "finalized by the collector" not in command, command
    assert "tp=2" in command  # the mesh command ran
    for printed, file in ((plain, plain_file), (command, command_file)):
        assert "atexit handler ran" in printed and file == "flushed at exit"
