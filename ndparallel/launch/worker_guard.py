"""torchrun's worker command under ``ndparallel launch``: tie the rank's life to its launcher, then exec.

torchrun starts every worker in a session of its own, so a launcher killed with SIGKILL (which
cannot forward anything) used to leave its ranks running under PID 1. ``ndparallel launch``
therefore makes each worker run ``python -I worker_guard.py MODE PROGRAM...`` first, which:

1. asks Linux to SIGKILL this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``; it
   survives the ``exec`` below, and the pid stays the one torchrun watches). Strictly, when the
   parent *thread* that forked it exits: torchrun's agent starts workers from its main thread;
2. checks that the parent is still the launcher (``NDP_LAUNCHER_PID``): one that died before
   step 1 took effect would otherwise go unnoticed;
3. replaces itself with the real program: ``python -u ARGS`` (MODE ``python``; a script runs under
   ``-m ndparallel.launch.script_runner``, which gives its process group the hang watchdog) or ``ARGS`` as
   an executable (MODE ``exec``, torchrun's ``--no-python``).

Run with ``python -I`` by file path: only the standard library, nothing of ndparallel or torch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> bool:
    """Have the kernel SIGKILL this process when its parent exits; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def launcher_gone() -> bool:
    """True when ``NDP_LAUNCHER_PID`` names a launcher that is no longer this process's parent."""
    expected = os.environ.get("NDP_LAUNCHER_PID", "")
    return expected.isdigit() and os.getppid() != int(expected)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("python", "exec"):
        print("usage: python -I worker_guard.py python|exec PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    die_with_parent()
    if launcher_gone():
        rank = os.environ.get("RANK", "?")
        print(
            f"ndparallel: rank {rank} not started: its launcher (pid {os.environ['NDP_LAUNCHER_PID']}) is gone",
            file=sys.stderr,
        )
        return 1
    mode, program = argv[0], argv[1:]
    # a script file runs with the hang watchdog (script_runner.py); interpreter options (-m, -c) run as given
    if mode == "python" and not program[0].startswith("-"):
        program = ["-m", "ndparallel.launch.script_runner", *program]
    try:
        if mode == "python":
            os.execv(sys.executable, [sys.executable, "-u", *program])
        os.execvp(program[0], program)
    except OSError as err:
        print(f"ndparallel: cannot run {program[0]!r}: {err.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
