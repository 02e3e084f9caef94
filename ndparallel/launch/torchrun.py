"""``ndparallel launch``: torchrun underneath, with jobs that always end and name the right rank.

``launch(argv)`` runs ``torch.distributed.run`` (torchrun) in this process, and adds:

- **Hangs end, naming the rank behind**: ``init_distributed`` runs the hang watchdog on every rank;
  ``--timeout S`` (default 600) is how long a rank waits for a peer (``NDP_TIMEOUT_S`` for the ranks).
- **CPU simulation defaults** for ``--cpu-ranks N`` (``--nproc-per-node N --standalone``,
  ``NDP_DEVICE=cpu``, ``OMP_NUM_THREADS = cores / N``).
- **No orphans**: every worker starts through :mod:`ndparallel.launch.worker_guard`, which makes the
  kernel SIGKILL it when the launcher dies (even by SIGKILL), then execs the real program.
- **The right rank blamed**: torchrun stamps a failed worker with the second in which it *looked*
  (every ``--monitor-interval``), or with the time its error file was written; a rank killed
  outright can so look later than the peer that failed because of it. An :class:`ExitClock`
  thread notes when each worker actually exited (to ~20 ms) and the report blames the first.
- **One line, and the exit status the docs promise**: ``rank R failed first (exit code E)`` (1),
  ``the job hung: ...`` (124, from the ranks' watchdog), ``the ranks stopped on a signal`` or
  ``stopped by SIGTERM`` (130) instead of torchrun's tracebacks.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ndparallel.config.parallelism import CPU_RANKS_ENV
from ndparallel.errors import EXIT_HUNG, EXIT_INTERRUPTED, ConfigError

__all__ = ["WORKER_GUARD", "ExitClock", "children_of", "launch", "torchrun_argv"]

SUBCOMMANDS = ("mesh", "train", "launch", "plan", "bench")
WORKER_GUARD = Path(__file__).with_name("worker_guard.py")


def _option_value(argv: Sequence[str], option: str) -> str | None:
    """The value of ``option VALUE`` / ``option=VALUE`` in ``argv`` ("" when the value is missing)."""
    for i, arg in enumerate(argv):
        if arg == option:
            return argv[i + 1] if i + 1 < len(argv) else ""
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
    return None


def without_option(argv: Sequence[str], option: str) -> list[str]:
    """``argv`` minus ``option VALUE`` / ``option=VALUE``."""
    result, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            result.append(arg)
    return result


def cpu_ranks(value: str | int | None) -> int:
    """``--cpu-ranks`` as a positive integer, or a ConfigError."""
    try:
        ranks = int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError("--cpu-ranks needs a positive integer, e.g. --cpu-ranks 4") from None
    if ranks < 1:
        raise ConfigError(f"--cpu-ranks={ranks} must be >= 1 (the number of simulated CPU ranks)")
    return ranks


def _guarded(options: list[str], program: list[str]) -> tuple[list[str], list[str]]:
    """Route the worker command through the worker guard, in torchrun's ``--no-python`` form."""
    flags = {"-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path"}
    if any(o in ("--run-path", "--run_path") for o in options):
        return options, program  # torchrun runs the script in a multiprocessing child: nothing to wrap
    module = any(o in ("-m", "--module") for o in options)
    no_python = any(o in ("--no-python", "--no_python") for o in options)
    options = [o for o in options if o not in flags]
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    mode = ["exec"] if no_python else ["python", *(["-m"] if module else [])]
    return [*options, "--no-python"], [python, "-I", str(WORKER_GUARD), *mode, *program]


def torchrun_argv(argv: Sequence[str]) -> list[str]:
    """Translate ``[torchrun options] [--cpu-ranks N] [--timeout S] -- SUBCOMMAND|SCRIPT args`` into torchrun's
    argv. ``--timeout S``: a rank of a script that calls ``init_distributed`` and waits S seconds for a peer
    ends the job, naming the rank behind (default 600; ``ndparallel train`` reads it as ``train.timeout_s``)."""
    argv = list(argv)
    if "--" not in argv:
        raise ConfigError(
            "launch needs `--` before the program: ndparallel launch --cpu-ranks 4 -- train --config configs/demo.yaml"
        )
    split = argv.index("--")
    options, program = argv[:split], argv[split + 1 :]
    if not program:
        raise ConfigError("launch: nothing to run after `--` (an ndparallel subcommand or a script)")
    timeout = _option_value(options, "--timeout")
    if timeout is not None:  # the ranks' hang timeout (the watchdog's): init_distributed reads it
        from ndparallel.distributed.timeouts import TIMEOUT_ENV, parse_timeout

        os.environ[TIMEOUT_ENV] = str(parse_timeout(timeout, "--timeout"))
        options = without_option(options, "--timeout")
    value = _option_value(options, "--cpu-ranks")
    if value is not None:
        ranks = cpu_ranks(value)
        options = without_option(options, "--cpu-ranks")
        if not any(o.startswith(("--nproc-per-node", "--nproc_per_node")) for o in options):
            options += ["--nproc-per-node", str(ranks)]
        if not any(o.startswith(("--nnodes", "--rdzv", "--standalone", "--master")) for o in options):
            options.append("--standalone")
        os.environ["NDP_DEVICE"] = "cpu"
        os.environ[CPU_RANKS_ENV] = str(ranks)  # the ranks refuse a config asking for cuda (job_device)
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    if program[0] in SUBCOMMANDS:
        program = ["-m", "ndparallel", *program]
    options, program = _guarded(options, program)
    return [*options, *program]


# ----------------------------------------------------------------------------- exit times
def _child_pids() -> set[int]:
    """This process's children (Linux: /proc/self/task/*/children, else a scan of /proc/*/stat);
    empty where there is no /proc."""
    pids: set[int] = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return pids
    listed = False
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids.update(int(p) for p in f.read().split())
            listed = True
        except OSError:
            continue
    return pids if listed else children_of(os.getpid())


def children_of(pid: int) -> set[int]:
    """PIDs whose parent is ``pid``, found through every process's parent pid in /proc (Linux; also on kernels
    without CONFIG_PROC_CHILDREN)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.add(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return found


class ExitClock:
    """Notes when each child process of this one exits (polled every ``period`` s, without reaping it:
    ``waitid(WNOWAIT)`` leaves the zombie for torchrun to collect)."""

    def __init__(self, period: float = 0.02):
        self.period = period
        self._exits: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ndparallel-exit-clock", daemon=True)

    def __enter__(self) -> ExitClock:
        if hasattr(os, "waitid") and hasattr(os, "WNOWAIT"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1)

    def _run(self) -> None:
        live: set[int] = set()
        ticks = 0
        while not self._stop.wait(self.period):
            if ticks % 10 == 0:  # new workers appear rarely (start, restart): look for them every 0.2 s
                live.update(p for p in _child_pids() if p not in self._exits)
            ticks += 1
            for pid in list(live):
                try:
                    exited = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
                except ChildProcessError:
                    exited = True  # torchrun reaped it between two looks
                if exited:
                    self._exits[pid] = time.monotonic()
                    live.discard(pid)

    def exit_time(self, pid: int) -> float:
        """Monotonic time ``pid`` was seen to exit; infinity if it was not."""
        return self._exits.get(pid, math.inf)


# ----------------------------------------------------------------------------- the report
def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name if exitcode < 0 else ""
    except ValueError:
        return ""


def _error_message(failure) -> str:
    """The first line of a failed rank's recorded error (its error file), or ""."""
    data = getattr(failure, "error_file_data", None) or {}
    message = data.get("message", "")
    if isinstance(message, dict):
        message = message.get("message", "")
    if not isinstance(message, str) or message == "<NONE>":
        return ""
    line = message.strip().splitlines()[0] if message.strip() else ""
    return line if len(line) <= 400 else line[:397] + "..."


_SAME_MOMENT_S = 1.0
"""Exits this close together are one event for the blame (a loaded machine: torchrun's SIGTERM lands within ms)."""


def _cause_behind_the_closing_sigterm(ordered: list[int], failures: dict, clock: ExitClock) -> int | None:
    """A rank that ended the job on its own (hung: its watchdog's exit code; or a crash signal such as SIGSEGV)
    when the rank seen first died of SIGTERM at about the same moment: torchrun's closing SIGTERM to the
    survivors, which a loaded machine's exit clock can see in the same tick, or even first. A SIGTERM well before
    (someone's ``kill``) keeps the blame, and so does a rank's plain error exit, which a peer's death can cause."""
    head = failures[ordered[0]]
    if head.exitcode != -signal.SIGTERM:
        return None
    stopping = (-signal.SIGTERM, -signal.SIGKILL, -signal.SIGINT)
    for rank in ordered[1:]:
        failure = failures[rank]
        on_its_own = failure.exitcode == EXIT_HUNG or (failure.exitcode < 0 and failure.exitcode not in stopping)
        apart = abs(clock.exit_time(failure.pid) - clock.exit_time(head.pid))
        if on_its_own and (apart < _SAME_MOMENT_S or not math.isfinite(apart)):
            return rank
    return None


def report_failure(failures: dict, clock: ExitClock) -> int:
    """One line about a failed job (``failures``: global rank -> torchrun ProcessFailure); the exit status."""
    ordered = sorted(failures, key=lambda r: (clock.exit_time(failures[r].pid), failures[r].timestamp, r))
    first = _cause_behind_the_closing_sigterm(ordered, failures, clock)
    first = ordered[0] if first is None else first
    if failures[first].exitcode == EXIT_INTERRUPTED:
        # The ranks agreed to stop on a signal; torchrun may have signalled the slower ones on its way out.
        stopping = (EXIT_INTERRUPTED, -signal.SIGTERM, -signal.SIGKILL)
        errors = [r for r in ordered if failures[r].exitcode not in stopping]
        if not errors:
            print(
                f"ndparallel launch: the ranks stopped on a signal (exit code {EXIT_INTERRUPTED}; rank {first} first)",
                file=sys.stderr,
            )
            return EXIT_INTERRUPTED
        first = errors[0]  # a rank that failed while the job was stopping
    failure = failures[first]
    message = _error_message(failure)
    if failure.exitcode == EXIT_HUNG:
        print(f"ndparallel launch: the job hung: {message or 'see the ranks report above'}", file=sys.stderr)
        return EXIT_HUNG
    others = sorted(set(failures) - {first})
    killed_by = _signal_name(failure.exitcode)
    print(
        f"ndparallel launch: rank {first} failed first (exit code {failure.exitcode})"
        + (f" [{killed_by}]" if killed_by else "")
        + (f": {message}" if message else "")
        + (f"; ranks {others} were stopped" if others else "")
        + ". Its traceback, if any, is above.",
        file=sys.stderr,
    )
    return 1


def _rendezvous_failure(err: BaseException, args: Sequence[str]) -> str:
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    endpoint = _option_value(args, "--rdzv-endpoint") or _option_value(args, "--rdzv_endpoint") or "?"
    text = str(err.__cause__ or err).strip()
    cause = f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"
    if isinstance(err, RendezvousConnectionError):  # the node that hosted the store is gone
        return (
            f"lost the job's rendezvous store at {endpoint} ({cause}): the node that hosted it is gone; "
            "the ranks' last lines above name it"
        )
    return f"the rendezvous at {endpoint} failed ({cause}): did every node start, with the same --rdzv-id?"


_TIMER_FILE = os.path.join("elastic", "rendezvous", "utils.py")


def _quiet_timer_self_join() -> None:
    """Silence one known torch teardown error in this (the launcher's) process, and only it.

    torch's rendezvous keep-alive ``_PeriodicTimer`` (torch/distributed/elastic/rendezvous/utils.py, torch 2.11 to
    2.13) stops its thread from a ``weakref.finalize``; when the garbage collector happens to collect the timer on
    that very thread, the finalizer's ``thread.join()`` raises ``RuntimeError: cannot join current thread``, which
    Python prints as "Exception ignored in: <finalize object ...>" with a traceback after the job's last line. The
    stop event is set before the join, so the thread ends anyway: nothing is lost but the user's trust in the
    output. Seen once under heavy load after a SIGTERM (docs/troubleshooting.md#exit-time-aborts-and-native-crashes)."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        frames = [frame.f_code for frame, _ in traceback.walk_tb(unraisable.exc_traceback)]
        if (
            isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "cannot join current thread"
            and any(code.co_name == "_stop_thread" and code.co_filename.endswith(_TIMER_FILE) for code in frames)
        ):
            return
        previous(unraisable)

    sys.unraisablehook = hook


def launch(argv: Sequence[str]) -> int:
    """Run ``torch.distributed.run`` (torchrun) with translated arguments; returns the exit status."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import main as torchrun_main

    args = torchrun_argv(argv)
    os.environ["NDP_LAUNCHER_PID"] = str(os.getpid())  # the worker guard checks its parent against it
    # A rank that crashes natively (SIGSEGV, SIGABRT in a C++ library) prints the Python stack it crashed
    # under to its stderr, not just torchrun's "exitcode: -11". A user's own setting wins.
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    _quiet_timer_self_join()
    with ExitClock() as clock:
        try:
            torchrun_main(args)
        except ChildFailedError as err:
            return report_failure(err.failures, clock)
        except SignalException as err:
            name = signal.Signals(err.sigval).name
            print(f"ndparallel launch: stopped by {name}: the ranks were asked to save and stop", file=sys.stderr)
            return EXIT_INTERRUPTED
        except RendezvousError as err:
            print(f"ndparallel launch: {_rendezvous_failure(err, args)}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # before torchrun installed its handlers
            print("ndparallel launch: stopped by SIGINT before the ranks started", file=sys.stderr)
            return EXIT_INTERRUPTED
    return 0
