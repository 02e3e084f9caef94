"""Run a function on N real gloo ranks on one machine and collect what each rank returns.

This is public API, meant for users' own tests as much as for ndparallel's::

    from ndparallel.testing import run_distributed

    def check(scale):                      # must be importable (module level)
        import torch, torch.distributed as dist
        t = torch.ones(1) * scale
        dist.all_reduce(t)
        return t.item()

    assert run_distributed(check, 4, 2.0) == [8.0] * 4

Every rank runs in its own process with a real process group (``init_process_group``
over a file store, so there are no port races). A rank that raises makes the call raise
:class:`DistributedError` naming that rank and carrying its traceback; a job that does not
finish within ``timeout`` seconds is killed and raises :class:`DistributedTimeout`. Every
child process is killed before the call returns, whatever happens: no orphans.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import multiprocessing as mp
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "DistributedError",
    "DistributedTimeout",
    "defined_interactively",
    "pickled_call",
    "run_distributed",
    "run_ranks",
    "spawn_context",
]


class DistributedError(RuntimeError):
    """A rank raised (or died). ``rank`` is the first rank that failed; ``remote_traceback`` its traceback."""

    def __init__(self, rank: int, remote_traceback: str):
        self.rank = rank
        self.remote_traceback = remote_traceback
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")


class DistributedTimeout(DistributedError, TimeoutError):
    """The job did not finish in time; every rank was killed. ``behind``: the ranks' heartbeats' verdict on
    who kept the others waiting, and where (``""`` when they were all busy, or posted none)."""

    def __init__(self, timeout: float, unfinished: list[int], behind: str = ""):
        self.unfinished = unfinished
        self.behind = behind
        cause = f": {behind}" if behind else " (a hang, e.g. a collective that not every rank entered)"
        RuntimeError.__init__(
            self, f"ranks {unfinished} did not finish within {timeout:.0f}s{cause}; all ranks were killed"
        )
        self.rank = unfinished[0] if unfinished else -1
        self.remote_traceback = ""


# Libraries preloaded only when this process has imported them: its ranks will most likely import them too
# (transformers' modeling_utils costs ~3 s of CPU per process; pytest 0.06 s, in every rank whose function a test
# module defines), and a process that never did pays nothing.
_PRELOAD_WHEN_IMPORTED = {"transformers": ("transformers", "transformers.modeling_utils"), "pytest": ("pytest",)}


# What `import ndparallel` gives a user: named here, not imported, since the harness sits below them; the
# forkserver imports them once for every rank it forks. The modules themselves, not their packages, whose names
# load on first use (ndparallel/lazy.py): importing a package alone would leave each rank to import its engine
# (a guard in tests/distributed/test_mesh_and_harness.py holds the list to the packages' tables).
_ENGINE = ("ndparallel.models.builtin", "ndparallel.models.transformer.model", "ndparallel.parallel.parallelize")
_ENGINE += tuple(f"ndparallel.checkpoint.{m}" for m in ("format", "loading", "safetensors_io", "saving", "storage"))
_ENGINE += ("ndparallel.train.data", "ndparallel.train.job_config", "ndparallel.train.loop")
_ENGINE += tuple(f"ndparallel.parallel.pipeline.{m}" for m in ("build", "placement", "runtime", "split"))
_ENGINE += ("ndparallel.accelerator", "ndparallel.launch.notebook")


# torch's own: FSDP2's fully_shard calls a function wrapped by torch._disable_dynamo, whose first call imports
# torch._dynamo (~0.45 s of CPU in every rank that shards, though nothing is compiled).
_TORCH = ("torch", "torch.distributed", "torch._dynamo")


def _preload() -> list[str]:
    """What the forkserver imports once, before it forks any rank."""
    extra = [m for lib, mods in _PRELOAD_WHEN_IMPORTED.items() if lib in sys.modules for m in mods]
    return [*_TORCH, "ndparallel", *_ENGINE, *extra]


def spawn_context() -> mp.context.BaseContext:
    # forkserver: torch and ndparallel (DTensor, FSDP, DCP: ~2 s of CPU per process) are imported once in the
    # server, then every rank is a cheap fork of it. Plain fork is unsafe once the parent has started
    # OpenMP/gloo threads; spawn re-imports everything in every rank.
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_preload())
        return ctx
    return mp.get_context("spawn")


_UNPICKLE_HINT = (
    "the rank process could not load the function and its arguments (they are sent by pickle, and a new "
    "process imports what they refer to): define them in a module, or from a notebook use "
    "ndparallel.notebook_launcher, which forks"
)


def defined_interactively(fn: Callable[..., Any]) -> bool:
    """True for a function defined in an interactive ``__main__`` (a notebook, the REPL, ``python -c``):
    no other process can import it."""
    main = sys.modules.get("__main__")
    return getattr(fn, "__module__", None) == "__main__" and getattr(main, "__file__", None) is None


def _unloadable_main() -> str | None:
    """The main module's path when multiprocessing would re-run it in each rank and cannot (``python -``)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if getattr(getattr(main, "__spec__", None), "name", None) is None and path and not os.path.isfile(path):
        return path
    return None


def pickled_call(fn: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any]) -> bytes:
    """``(fn, args, kwargs)`` pickled for the rank processes; a TypeError naming the cause when it cannot be."""
    main_path = _unloadable_main()
    if main_path is not None:
        raise TypeError(
            f"run_distributed: the rank processes re-run the main module, and {main_path!r} is not a file "
            "(a script read from stdin?): run the script from a file"
        )
    if defined_interactively(fn):
        raise TypeError(
            f"run_distributed cannot send {getattr(fn, '__qualname__', fn)!r}: it is defined in an interactive "
            "__main__ (a notebook, the REPL or python -c) that the rank processes cannot import. Use "
            "ndparallel.notebook_launcher(fn, args, num_processes=N) (it forks), or define fn in a module"
        )
    try:
        return pickle.dumps((fn, tuple(args), dict(kwargs)))
    except Exception as err:
        raise TypeError(
            f"run_distributed cannot pickle {getattr(fn, '__qualname__', fn)!r} and its arguments for the rank "
            f"processes ({type(err).__name__}: {err}); use a module-level function and picklable arguments"
        ) from None


def _fault_log(store_path: str, rank: int) -> str:
    return f"{store_path}.rank{rank}.fault"


def _worker(
    call: bytes | tuple,
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    threads: int,
    results: Any,
    timeout: float,
    env: Mapping[str, str],
) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.update(
        env,
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        NDP_STORE_PATH=store_path,
    )
    torch.set_num_threads(threads)
    # A native crash (SIGSEGV, SIGABRT in a C++ library) leaves no Python traceback to report: faulthandler
    # writes the Python stack it happened under to a file the parent adds to "exited with code -11".
    faulthandler.enable(open(_fault_log(store_path, rank), "w"))  # noqa: SIM115  (open until the process ends)
    try:
        fn, args, kwargs = pickle.loads(call) if isinstance(call, bytes) else call
    except BaseException:
        results.put(("error", rank, (time.time(), f"{_UNPICKLE_HINT}\n{traceback.format_exc()}")))
        return
    try:
        dist.init_process_group(
            backend=backend,
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        # Gloo's handshake is not symmetric: a rank can finish connecting, run a short ``fn`` and close its
        # sockets while a peer still reads its half, which then fails "connectFullMesh ... closed by peer"
        # (2% of 3-rank runs of a function that returns at once). Nobody starts before everybody is connected.
        dist.barrier()
        value = fn(*args, **kwargs)
        # Pickled here, not by the queue: torch would share tensors through file descriptors
        # that vanish when this process exits before the parent reads them.
        results.put(("ok", rank, pickle.dumps(value)))
        # The same asymmetry for the groups ``fn`` made (a DeviceMesh's flattened views): a rank whose ``fn``
        # returns first must not close their sockets while a peer still reads its half of the last handshake
        # (seen once in a full run: "connectFullMesh failed ... Connection closed by peer" in a mesh test).
        with contextlib.suppress(Exception):  # a peer that failed: the parent reports it, not this barrier
            dist.barrier()
    except BaseException:  # report everything, including SystemExit from the function
        results.put(("error", rank, (time.time(), traceback.format_exc())))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 300.0,
    threads_per_rank: int | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the per-rank results, rank order.

    ``fn`` and its arguments and results must be picklable (a module-level function; a TypeError
    names the cause otherwise, and a rank that cannot load them reports why). Inside ``fn`` the
    default process group is initialised and ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` are set as
    torchrun would, so ``ndparallel.init_distributed`` works unchanged.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // world_size)
    call = pickled_call(fn, args, kwargs)
    return run_ranks(call, world_size, spawn_context(), backend=backend, timeout=timeout, threads=threads_per_rank)


def run_ranks(
    call: bytes | tuple,
    world_size: int,
    ctx: mp.context.BaseContext,
    *,
    backend: str = "gloo",
    timeout: float = 300.0,
    threads: int = 1,
    env: Mapping[str, str] | None = None,
    explain_timeout: Callable[[str, int], str] | None = None,
) -> list[Any]:
    """Start ``world_size`` ranks from ``ctx`` running ``call`` (pickled ``(fn, args, kwargs)``, or the tuple
    itself under fork); collect their results in rank order (see :func:`run_distributed`).
    ``explain_timeout(store_path, world_size)``, when time runs out: who kept the others waiting, read from
    the job's file store while the ranks still run (``DistributedTimeout.behind``)."""
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ndp-store-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(call, r, world_size, backend, store_path, threads, results, timeout, dict(env or {})),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            explain = functools.partial(explain_timeout, store_path, world_size) if explain_timeout else None
            return _collect(procs, results, world_size, timeout, explain, store_path)
        finally:
            _kill_all(procs)


def _collect(
    procs: list,
    results: Any,
    world_size: int,
    timeout: float,
    explain: Callable[[], str] | None,
    store_path: str,
) -> list[Any]:
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    while len(values) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            unfinished = sorted(set(range(world_size)) - set(values))
            raise DistributedTimeout(timeout, unfinished, explain() if explain else "")
        try:
            status, rank, payload = results.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            dead = _dead_without_report(procs, values)
            if dead:
                raise DistributedError(dead[0], _exit_message(procs, dead[0], store_path)) from None
            continue
        if status == "error":
            raise _root_cause(procs, results, values, {rank: payload}, store_path)
        values[rank] = payload
    return [pickle.loads(values[r]) for r in range(world_size)]


def _dead_without_report(procs: list, reported: dict) -> list[int]:
    return [r for r, p in enumerate(procs) if r not in reported and p.exitcode not in (None, 0)]


def _exit_message(procs: list, rank: int, store_path: str) -> str:
    """How a rank ended without reporting, with the Python stack of a native crash when faulthandler wrote one."""
    message = f"process exited with code {procs[rank].exitcode} without reporting (killed, crashed or os._exit)"
    try:
        with open(_fault_log(store_path, rank)) as f:
            stack = f.read().strip()
    except OSError:
        stack = ""
    return f"{message}\n{stack}" if stack else message


def _root_cause(procs: list, results: Any, values: dict, errors: dict, store_path: str) -> DistributedError:
    """One rank's failure makes its peers fail too ("connection closed by peer"): gather what else
    arrives within a second and blame the rank that died silently, else the earliest error."""
    grace = time.monotonic() + 1.0
    while time.monotonic() < grace:
        try:
            status, rank, payload = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if status == "error":
            errors[rank] = payload
        else:
            values[rank] = payload
    dead = _dead_without_report(procs, {**values, **errors})
    if dead:
        return DistributedError(dead[0], _exit_message(procs, dead[0], store_path))
    rank = min(errors, key=lambda r: errors[r][0])
    others = sorted(set(errors) - {rank})
    note = f"\n(ranks {others} failed afterwards, most likely as a consequence)" if others else ""
    return DistributedError(rank, errors[rank][1] + note)


def _kill_all(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.join(timeout=0.05)
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)
