"""``notebook_launcher``: run a training function on N CPU ranks from a Jupyter notebook, as 🤗 Accelerate's.

A function defined in a notebook cell lives in the kernel's interactive ``__main__``, which no new process
can import, so ``run_distributed`` (forkserver, pickle) cannot send it. ``notebook_launcher`` forks the
kernel instead: each rank starts as a copy of it, function and arguments included, and gets a real gloo
process group (``ndparallel.Accelerator()`` and ``init_distributed`` inside it work unchanged). Functions
importable from a module go through ``run_distributed`` as usual. Forked ranks run one intra-op thread
each: OpenMP, once used by the kernel, hangs a forked child that starts more threads (measured, torch 2.13).
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
from collections.abc import Callable
from typing import Any

from ndparallel.distributed.spawn import defined_interactively, pickled_call, run_ranks
from ndparallel.distributed.spawn import spawn_context as forkserver_context  # run_distributed's start method
from ndparallel.errors import ConfigError

__all__ = ["notebook_launcher"]

# Accelerate's notebook_launcher keywords, accepted at their default: keyword -> (default, what instead).
_ACCELERATE_DEFAULTS: dict[str, tuple[Any, str]] = {
    "mixed_precision": ("no", "pass mixed_precision= to the Accelerator inside the function"),
    "use_port": ("29500", "ranks meet over a file store: no port is used"),
    "master_addr": ("127.0.0.1", "notebook_launcher runs on this machine only; use ndparallel launch for nodes"),
    "node_rank": (0, "notebook_launcher runs on this machine only; use ndparallel launch for nodes"),
    "num_nodes": (1, "notebook_launcher runs on this machine only; use ndparallel launch for nodes"),
    "max_restarts": (0, "restart from a checkpoint with ndparallel launch --max-restarts"),
}


def _check_fork() -> None:
    import torch
    import torch.distributed as dist

    if "fork" not in mp.get_all_start_methods():
        raise ConfigError(
            "notebook_launcher needs fork for a function defined in the notebook, which this platform does not "
            "have: put the function in a .py file next to the notebook and import it"
        )
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise ConfigError(
            "CUDA is already initialised in this kernel, and forked ranks cannot use it: restart the kernel and "
            "call notebook_launcher before anything touches CUDA"
        )
    if dist.is_initialized():
        raise ConfigError(
            "this kernel has a process group (init_distributed or Accelerator() ran here): forked ranks would "
            "inherit it; restart the kernel, or call ndparallel.destroy_distributed() first"
        )


def notebook_launcher(
    function: Callable[..., Any],
    args: tuple = (),
    num_processes: int | None = None,
    *,
    timeout: float = 600.0,
    **accelerate_options: Any,
) -> list[Any]:
    """Run ``function(*args)`` on ``num_processes`` simulated CPU ranks (gloo) and return each rank's result.

    Works from a Jupyter kernel (fork) and for importable functions (forkserver). A rank that raises makes
    the call raise :class:`ndparallel.testing.DistributedError` with its traceback; ``timeout`` seconds
    without finishing kill every rank, and the DistributedTimeout names the rank behind (from the ranks'
    heartbeats). Accelerate's other keywords are accepted at their default only.
    """
    for key, value in accelerate_options.items():
        if key not in _ACCELERATE_DEFAULTS:
            raise TypeError(f"notebook_launcher() got an unexpected keyword argument {key!r}")
        default, fix = _ACCELERATE_DEFAULTS[key]
        if str(value) != str(default):
            raise ConfigError(f"notebook_launcher({key}={value!r}) is not supported: {fix}")
    if not isinstance(num_processes, int) or isinstance(num_processes, bool) or num_processes < 1:
        raise ConfigError(f"notebook_launcher needs num_processes=N (CPU ranks to simulate), got {num_processes!r}")
    env = {"NDP_DEVICE": "cpu"}  # gloo ranks on this CPU, also where CUDA exists
    watched = (function, tuple(args), timeout)
    options = dict(timeout=timeout, env=env, explain_timeout=functools.partial(_who_is_behind, timeout=timeout))
    if defined_interactively(function):
        _check_fork()
        return run_ranks((_watched, watched, {}), num_processes, mp.get_context("fork"), threads=1, **options)
    call = pickled_call(_watched, watched, {})
    threads = max(1, (os.cpu_count() or 1) // num_processes)
    return run_ranks(call, num_processes, forkserver_context(), threads=threads, **options)


def _watched(function: Callable[..., Any], args: tuple, timeout: float) -> Any:
    """On a rank: ``function(*args)`` with the hang watchdog's heartbeats, so that a launcher that runs out of
    time can name the rank behind. The launcher's deadline comes first: no rank can wait ``timeout`` before it."""
    from ndparallel.distributed.watchdog import Watchdog

    watchdog = Watchdog.for_job(timeout)
    try:
        return function(*args)
    finally:
        watchdog.stop()


def _who_is_behind(store_path: str, world_size: int, timeout: float) -> str:
    """In the launcher, when time ran out: the ranks' heartbeats' verdict on who kept the others waiting.

    A rank without a heartbeat had not reached the function (its start took ``timeout``: a loaded machine).
    Less than three heartbeats in one place is too short to tell a hang from a slow step: when the ranks beat
    but have not waited that long yet, they get that long, at most four heartbeat intervals more, before they
    are killed (a heartbeat is up to one interval old when read)."""
    import time

    from ndparallel.distributed.heartbeat import read_beats
    from ndparallel.distributed.store import file_job_store
    from ndparallel.distributed.timeouts import heartbeat_interval
    from ndparallel.distributed.verdict import judge_at_deadline

    interval = heartbeat_interval(timeout)
    give_up = time.monotonic() + 4 * interval
    try:
        store = file_job_store(store_path)
        while True:
            beats = read_beats(store, world_size)
            missing = [r for r in range(world_size) if r not in beats]
            if missing:
                ranks = ", ".join(map(str, missing))
                who = "no rank had" if len(missing) == world_size else f"rank(s) {ranks} had not"
                return f"{who} reached the function yet: starting the ranks took the whole timeout; raise timeout"
            verdict = judge_at_deadline(beats, 3 * interval)
            if verdict or time.monotonic() >= give_up:
                return verdict or ""
            time.sleep(interval / 2)
    except Exception:  # the store cannot be read: the plain timeout message
        return ""
