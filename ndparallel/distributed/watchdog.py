"""The hang watchdog: a stuck job ends in bounded time, naming the rank(s) behind.

``init_distributed`` starts one on every rank of a multi-rank job (:meth:`Watchdog.for_job`; one per
process), so any script under ``ndparallel launch`` has it. The training loop also marks where each rank
is (``watchdog.phase("step 12: gradient clipping")``: one tuple assignment); a script that marks nothing
is watched collective by collective (the clock starts when the main thread enters, or leaves, a
``torch.distributed`` call). A daemon thread posts that position to the job's rendezvous store at every
new phase and every ``interval`` seconds, with a counter that grows with every post and the main thread's
current frame (where in the code, and which ``torch.distributed`` call, if any, it is blocked in): a
:class:`~ndparallel.distributed.heartbeat.Beat`. Then:

- When this rank has been in one phase (a script: in one collective) for ``timeout_s``, it reads
  every rank's heartbeat and :func:`~ndparallel.distributed.verdict.judge` names who is behind: a rank
  whose counter stopped (dead, frozen, or its node lost), a rank still in an earlier phase, or - all in
  one phase - a rank that is not in the collective its peers wait in. The verdict goes to the store (the
  first one wins), is printed on this rank, and the process ends with exit status 124.
- A rank that finds a verdict in the store prints it and ends too, so every rank reports. Each rank that
  printed says so in the store (``told/<rank>``), and no rank exits before every live peer has (at most
  :data:`_TELL_PEERS_S`): the first exit makes torchrun SIGTERM the rest, and a hung rank cannot print
  from a signal handler (its main thread is blocked in C; only its watchdog thread can speak).
- When a collective fails (a peer died: "Connection reset by peer"), :meth:`Watchdog.explain`
  watches the heartbeats for a few intervals and names the ranks - or the whole node - that went
  silent, instead of the gloo message that blames nobody.

All times are measured on each rank's own clock (no clock is compared across machines). The
process group's own timeout (:func:`~ndparallel.distributed.timeouts.process_group_timeout`) is set a little
later than ``timeout_s``, as a backstop: the watchdog speaks first. This module holds the thread and its store
mechanics; what a heartbeat holds is ``heartbeat``, the pure verdicts ``verdict``, the clocks ``timeouts``, the
store ``store``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from types import FrameType

import torch.distributed as dist

from ndparallel.distributed.heartbeat import Beat, main_thread_position, read_beats
from ndparallel.distributed.store import hosts_the_store, job_store
from ndparallel.distributed.timeouts import heartbeat_interval, silent_after
from ndparallel.distributed.verdict import (
    in_phase,
    judge,
    lost_peer_symptom,
    lost_peers,
    ranks_phrase,
    silence,
)
from ndparallel.errors import EXIT_HUNG, JobError

__all__ = ["Watchdog"]

_VERDICT = "verdict"
_LEAVING = "exiting:"  # the phase of a rank that has explained its failure and is about to exit
_STORE_TIMEOUT_FLOOR_S = 5.0  # the job store's timeout is at least this (a heartbeat's store call ends by then)
_PHASE_POST_GAP = 0.02  # seconds between two heartbeats posted for new phases: at most 50 a second
_TOLD = "told/"  # + rank: this rank has printed the verdict
_TELL_PEERS_S = 10.0
"""The longest a rank that printed the verdict waits for its peers to print it too before it exits (in
seconds, on a loaded machine too: not scaled with the heartbeat interval)."""
_GONE_AFTER_S = 5.0
"""A peer whose heartbeat has not moved for this long while a rank waits for it to print is not waited for
(dead or frozen: it cannot print)."""


class Watchdog:
    """Posts this rank's heartbeat and ends the job when it hangs (see the module docstring).

    ``Watchdog(None, ...)`` is inert (one process, or no store): ``phase`` and ``explain`` cost nothing.
    """

    _current: Watchdog | None = None  # the one running in this process (for_job hands it out)

    def __init__(self, store: dist.Store | None, rank: int, world_size: int, timeout_s: float):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.retune(timeout_s)
        self._position = (0, "", time.monotonic())  # (phases entered, phase, since): set by the main thread only
        # A script that enters no phase is timed per collective: the call its main thread was last seen in
        # (the frame object itself, held until the next heartbeat: an id could be reused by the next call)
        # and since when it is in it, or out of any.
        self._call: FrameType | None = None
        self._call_since = time.monotonic()
        self._count = 0
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (count, when this rank first saw it)
        self._parent = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        self._store_host = ""  # "node N (ranks ..., host H)", learned once from the store
        self._node = int(os.environ.get("GROUP_RANK", "0"))
        self._host = socket.gethostname()
        self._stop = threading.Event()
        self._wake = threading.Event()  # a new phase, or stop(): post now
        self._thread = threading.Thread(target=self._run, name="ndparallel-watchdog", daemon=True)
        if store is not None:
            self._post()
            if os.environ.get("LOCAL_RANK", "0") == "0" and hosts_the_store():
                self._announce_store_host()
            self._thread.start()

    @classmethod
    def for_job(cls, timeout_s: float) -> Watchdog:
        """The watchdog of this rank of the current process group (inert for one process): the one already
        running in this process (``init_distributed`` started it), set to ``timeout_s``, or a new one."""
        running = cls._current
        if running is not None and running.running() and dist.is_initialized():
            running.retune(timeout_s)
            return running
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return cls(None, 0, 1, timeout_s)
        store = job_store(max(_STORE_TIMEOUT_FLOOR_S, silent_after(timeout_s)))
        cls._current = cls(store, dist.get_rank(), dist.get_world_size(), timeout_s)
        return cls._current

    @classmethod
    def stop_current(cls) -> None:
        """Stop the watchdog running in this process, if any (``destroy_distributed``: the job is over)."""
        if cls._current is not None:
            cls._current.stop()
            cls._current = None

    def retune(self, timeout_s: float) -> None:
        """Wait ``timeout_s`` for peers from now on (``math.inf``: post heartbeats, never judge)."""
        self.timeout_s = timeout_s
        self.interval = heartbeat_interval(timeout_s)
        self.silent_after = silent_after(timeout_s)
        if hasattr(self, "_wake"):
            self._wake.set()  # the thread's next heartbeat comes at the new pace

    def running(self) -> bool:
        """Whether this watchdog's thread runs in this process (a forked child inherits the object, not the thread)."""
        return self._thread.is_alive() and not self._stop.is_set()

    # -------------------------------------------------------------- main thread
    def phase(self, label: str) -> None:
        """This rank now enters ``label`` (every rank enters the same phases in the same order)."""
        self._position = (self._position[0] + 1, label, time.monotonic())
        self._wake.set()  # so that a rank that dies in this phase is last seen in it

    def current_phase(self) -> str:
        """The label of the phase this rank is in (the last :meth:`phase`), or ``starting``."""
        return self._position[1] or "starting"

    def stop(self) -> None:
        """Stop the thread and wait until it has left any store call it was in (bounded by the store's timeout).

        Why wait that long: a daemon thread still inside a C++ store call when the interpreter finalizes aborts
        the process as the call returns (Python 3.11 ends such a thread with ``pthread_exit``, whose unwinding
        through pybind11's GIL guard calls ``std::terminate``: "terminate called without an active exception",
        docs/troubleshooting.md#exit-time-aborts)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._store_timeout_s() + 2 * self.interval + 1)

    def _store_timeout_s(self) -> float:
        timeout = getattr(self.store, "timeout", None) if self.store is not None else None
        return timeout.total_seconds() if timeout is not None else _STORE_TIMEOUT_FLOOR_S

    def explain(self, err: BaseException) -> JobError | None:
        """After a failed collective: a JobError naming the rank(s) or node(s) that went silent, or
        None when every peer still beats (then ``err`` is the story)."""
        if self.store is None or not lost_peer_symptom(err):
            return None
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        seen: dict[int, tuple[int, float]] = {}
        silent: dict[int, float] = {}
        # torchrun signals the ranks that are left once one exits: finish this explanation first
        # (a few heartbeats; torchrun waits 30 s before SIGKILL).
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN) if main else None
        try:
            self._end_if_judged()
            deadline = time.monotonic() + self.silent_after + 0.5 * self.interval
            while time.monotonic() < deadline:
                beats = self._read_beats()
                silent = silence(beats, seen, time.monotonic(), self.silent_after, self.rank)
                time.sleep(self.interval / 2)
            beats = self._read_beats()
        except Exception as store_err:  # the store went with the node that hosted it
            return JobError(f"{self._store_lost(store_err)}; this rank's collective failed with: {first_line}")
        finally:
            if main:
                signal.signal(signal.SIGTERM, previous)
        silent.update({r: self.silent_after for r in range(self.world_size) if r not in beats})
        silent.pop(self.rank, None)
        for rank in [r for r in silent if r in beats and beats[r].phase.startswith(_LEAVING)]:
            del silent[rank]  # a peer that explained its own failure and left: not lost
        if not silent:
            return None
        lost = JobError(lost_peers(silent, beats, self._position[1], first_line))
        self.phase(f"{_LEAVING} {str(lost)[:200]}")
        try:
            self._post()  # so that the peers still explaining do not count this rank as lost too
        except Exception:
            pass
        return lost

    # -------------------------------------------------------------- the thread
    def _run(self) -> None:
        last = time.monotonic()  # of the last periodic heartbeat and checks
        while not self._stop.is_set():
            woken = self._wake.wait(max(0.0, last + self.interval - time.monotonic()))
            if self._stop.is_set():
                return
            if woken:
                self._wake.clear()
                if time.monotonic() < last + self.interval:  # a new phase: tell the peers now
                    try:
                        self._post()
                    except Exception:
                        pass  # the periodic heartbeat reports an unreachable store
                    time.sleep(_PHASE_POST_GAP)
                    continue
            last = time.monotonic()
            if self._parent is not None and os.getppid() != self._parent:
                self._exit(1, f"rank {self.rank}: its launcher (pid {self._parent}) died; exiting")
            try:
                self._post()
                self._end_if_judged()
                self._watch()
            except Exception as err:  # the store is unreachable: a verdict of its own once this rank is stuck
                seq, phase, since = self._where()
                if self._waiting() and time.monotonic() - since >= self.timeout_s:
                    self._end(
                        f"{self._store_lost(err)}, and rank {self.rank} has been{in_phase(phase) or ' waiting'} for "
                        f"{time.monotonic() - since:.0f}s",
                        tell=False,
                    )

    def _where(self) -> tuple[int, str, float]:
        """(phases entered, phase, since): the last phase entered, or for a script the current collective."""
        seq, phase, since = self._position
        return (seq, phase, since) if seq else (0, "", self._call_since)

    def _waiting(self) -> bool:
        """Whether this rank's clock runs: always in a phase; in a script, inside a collective only (a rank
        busy on its own, or done while its peers finish, waits for nobody)."""
        return self._position[0] > 0 or self._call is not None

    def _post(self) -> None:
        where, collective, call = main_thread_position()
        if call is not self._call:
            self._call, self._call_since = call, time.monotonic()
        seq, phase, since = self._where()
        self._count += 1
        beat = Beat(
            self.rank, self._node, self._host, seq, phase, time.monotonic() - since, self._count, where, collective
        )
        self.store.set(f"beat/{self.rank}", json.dumps(asdict(beat)))
        if not self._store_host and self.store.check(["store-host"]):
            self._store_host = self.store.get("store-host").decode()

    def _watch(self) -> None:
        seq, phase, since = self._where()
        stuck = time.monotonic() - since
        if not self._waiting() or stuck < self.timeout_s - self.silent_after - self.interval:
            self._seen.clear()
            return
        beats = self._read_beats()
        silent = silence(beats, self._seen, time.monotonic(), self.silent_after, self.rank)
        if stuck >= self.timeout_s:
            verdict = judge(beats, silent, self.timeout_s)
            if verdict:
                self._end(self.store.compare_set(_VERDICT, "", verdict).decode() or verdict)

    def _end_if_judged(self) -> None:
        if self.store.check([_VERDICT]):
            self._end(self.store.get(_VERDICT).decode())

    def _read_beats(self) -> dict[int, Beat]:
        return read_beats(self.store, self.world_size)

    def _announce_store_host(self) -> None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        first = self.rank - int(os.environ.get("LOCAL_RANK", "0"))
        ranks = ranks_phrase(list(range(first, first + local)))
        self.store.set("store-host", f"node {self._node} ({ranks}, host {self._host})")

    def _store_lost(self, err: Exception) -> str:
        address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        host = self._store_host or "the node that hosted it"
        return f"lost {host}, which hosted the job's rendezvous store at {address} ({str(err).strip()[:100]})"

    def _end(self, verdict: str, tell: bool = True) -> None:
        """Print ``verdict`` and exit 124; with ``tell`` (the store answers), after the peers printed it too."""
        self._exit(
            EXIT_HUNG, f"the job hung: {verdict}", record=verdict, before_exit=self._wait_for_peers if tell else None
        )

    def _wait_for_peers(self) -> None:
        """Mark this rank as told, then wait (bounded) until every peer that still beats has printed the verdict.

        Without this, the first rank to exit makes torchrun (or ``notebook_launcher``) SIGTERM the others,
        often the hung rank, before its watchdog thread read the verdict and printed it."""
        try:
            self.store.set(f"{_TOLD}{self.rank}", "1")
            seen: dict[int, tuple[int, float]] = {}
            pending = [r for r in range(self.world_size) if r != self.rank]
            start = time.monotonic()
            while time.monotonic() < start + _TELL_PEERS_S:
                now = time.monotonic()
                pending = [r for r in pending if not self.store.check([f"{_TOLD}{r}"])]
                if not pending:
                    return  # every peer has printed it
                beats = self._read_beats()
                gone = silence(beats, seen, now, _GONE_AFTER_S, self.rank)
                if all(r in gone or (r not in beats and now - start >= _GONE_AFTER_S) for r in pending):
                    return
                time.sleep(min(0.5, self.interval / 2))
        except Exception:  # the store went away: nobody is left to wait for
            return

    @staticmethod
    def _exit(
        code: int, message: str, record: str | None = None, before_exit: Callable[[], None] | None = None
    ) -> None:
        """Print ``message``, leave it in torchrun's error file for the launcher's report, call ``before_exit``,
        and end the process: the main thread may be blocked in a collective that will never return."""
        # One write call: ranks sharing one stderr pipe must not glue their verdicts into one line (print()
        # writes the text and the newline separately; two ranks' lines came out as one)
        sys.stderr.write(f"ndparallel: error: {message}\n")
        sys.stderr.flush()
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if path:
            try:
                with open(path, "w") as f:
                    # torchrun's own format (what its @record writes), so its report shows the line.
                    info = {"py_callstack": message, "timestamp": str(int(time.time()))}
                    json.dump({"message": {"message": record or message, "extraInfo": info}}, f)
            except OSError:
                pass
        sys.stdout.flush()
        if before_exit is not None:
            before_exit()
        os._exit(code)
