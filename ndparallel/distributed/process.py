"""Process start and stop: the process group from torchrun's env (or one process), its watchdog, device rules.

``init_distributed(cfg)`` starts (or reuses) the default process group and builds the named
:class:`~ndparallel.distributed.mesh.Mesh` on it; ``destroy_distributed()`` tears it down.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ndparallel.config.dims import MESH_DIMS
from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.distributed.mesh import INNER_DIMS, VIEWS, Mesh, flatten
from ndparallel.distributed.store import launcher_store
from ndparallel.distributed.timeouts import job_timeout, process_group_timeout
from ndparallel.distributed.watchdog import Watchdog
from ndparallel.errors import ConfigError

__all__ = ["DEVICE_TYPES", "check_device_type", "destroy_distributed", "init_distributed"]

DEVICE_TYPES = ("cpu", "cuda")


def check_device_type(device_type: str, source: str = "device_type") -> str:
    """``device_type`` if it is one ndparallel runs on and this machine has; else a ConfigError naming ``source``."""
    if device_type not in DEVICE_TYPES:
        raise ConfigError(f"{source}={device_type!r} must be cpu or cuda")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{source}=cuda but CUDA is not available here (torch {torch.__version__}, "
            f"{'no GPU visible' if torch.version.cuda else 'a CPU-only build'}); use cpu"
        )
    return device_type


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(
    cfg: ParallelismConfig | None = None,
    device_type: str | None = None,
    timeout_s: float | None = None,
) -> Mesh:
    """Initialise the process group (torchrun's env, or one process when there is none) and build the mesh.

    Backend: nccl for CUDA (plus gloo for CPU tensors), gloo for CPU. An already initialised
    process group (e.g. inside ``ndparallel.testing.run_distributed``) is reused. ``timeout_s``
    (default: ``ndparallel launch --timeout``, else 600): how long a rank waits for a peer. A
    multi-rank group started here runs the hang watchdog (:mod:`ndparallel.distributed.watchdog`):
    a rank that waits that long in a collective ends the job, naming the rank behind and the
    collective the others wait in; the process group's own timeout comes a little later, as a backstop.
    """
    cfg = cfg or ParallelismConfig()
    device_type = check_device_type(device_type or _default_device_type())
    hang_timeout = job_timeout(timeout_s)
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            if device_type == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            timeout = datetime.timedelta(seconds=process_group_timeout(hang_timeout))
            dist.init_process_group(
                backend=backend, timeout=timeout, store=launcher_store(timeout), rank=rank, world_size=world
            )
            Watchdog.for_job(hang_timeout)
            atexit.register(_destroy_at_exit)  # a script that ends without destroy_distributed()
        else:
            timeout = datetime.timedelta(seconds=hang_timeout)
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    elif device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    resolved = cfg.resolve(dist.get_world_size())
    device_mesh = init_device_mesh(device_type, tuple(resolved.sizes.values()), mesh_dim_names=MESH_DIMS)
    inner_mesh = device_mesh[INNER_DIMS]  # this rank's pp slice: every view is built on it
    views = {name: flatten(inner_mesh[dims], name) for name, dims in VIEWS.items()}
    inner = None
    if resolved.pp_size > 1:
        inner = Mesh(inner_mesh, dataclasses.replace(resolved, pp_size=1), views)
    return Mesh(device_mesh, resolved, views, inner)


# process_group_timeout(h) - h - process_group_timeout(0) is at most this (6 heartbeats of at most 2 s, less the
# 6 x 0.2 s already in process_group_timeout(0)): a watchdog that judges at T - 10 - 10.8 comes before T
_LONGEST_BACKSTOP_S = 10.8


def script_group_timeout() -> datetime.timedelta:
    """The timeout of a group a script under ``ndparallel launch`` starts with torch's own call and no timeout: the
    watchdog's backstop, after its verdict (``--timeout``, default 600 s)."""
    return datetime.timedelta(seconds=process_group_timeout(job_timeout()))


def watch_script_group(group_timeout_s: float | None) -> None:
    """The hang watchdog and the exit teardown of :func:`init_distributed`, for a default group a script under
    ``ndparallel launch`` started itself (``ndparallel/launch/script_runner.py``). It judges at ``--timeout``, or
    early enough to come before ``group_timeout_s``, the group's own timeout when the script set one."""
    if not dist.is_initialized() or dist.get_world_size() < 2 or "RANK" not in os.environ:
        return
    hang = job_timeout()
    if group_timeout_s is not None and process_group_timeout(hang) > group_timeout_s:
        hang = max(1.0, group_timeout_s - process_group_timeout(0.0) - _LONGEST_BACKSTOP_S)
    Watchdog.for_job(hang)
    atexit.register(_destroy_at_exit)


def destroy_distributed() -> None:
    """Tear down the default process group (safe to call twice).

    A barrier first: a rank that destroys its gloo group while a peer is still finishing the last
    collective can make that peer abort at exit ("terminate called without an active exception").
    """
    if dist.is_initialized():
        dist.barrier()
        _teardown()


def _teardown() -> None:
    """Stop the hang watchdog, destroy the default group, forget what DTensor cached about its meshes."""
    Watchdog.stop_current()
    dist.destroy_process_group()
    _clear_sharding_cache()


# How long a rank that ends normally waits at exit for its peers to end too (then it tears down regardless).
EXIT_BARRIER_S = 10.0
_exit_waits_for_peers = True


def exit_without_barrier() -> None:
    """Say that this rank ends on an error it reported (a command's one-line error): at exit it tears its group
    down without waiting for peers, which may never get there."""
    global _exit_waits_for_peers
    _exit_waits_for_peers = False


def _destroy_at_exit() -> bool | None:
    """``destroy_distributed`` for a script that did not call it, run by ``atexit`` on a rank ending normally.

    Why: the hang watchdog's daemon thread must be gone before the interpreter finalizes. Caught inside a C++
    store call (a heartbeat) by the finalization, it aborts the process as the call returns ("terminate called
    without an active exception", SIGABRT, or SIGSEGV in static destructors, after the script's last line:
    1 in 12 launches of the README example under load before this hook; docs/troubleshooting.md#exit-time-aborts).
    So the watchdog is stopped in every case, also when the script destroyed the group itself with
    ``torch.distributed.destroy_process_group()``. A rank ending normally first waits for its peers (a monitored
    barrier of at most ``EXIT_BARRIER_S``), so that none tears its group down under a peer's last collective; a
    rank ending on an uncaught exception (``sys.last_value``) or a reported error (:func:`exit_without_barrier`)
    does not wait: its peers may never come, and the launcher stops them anyway.

    Returns whether the peers met at the barrier (None: no barrier)."""
    if not dist.is_initialized():
        Watchdog.stop_current()
        return None
    met = None
    if _exit_waits_for_peers and getattr(sys, "last_value", None) is None:
        try:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=EXIT_BARRIER_S))
            else:
                dist.barrier()
            met = True
        except Exception:  # noqa: BLE001 - a peer gone at exit: tear down anyway, the job's outcome is decided
            met = False
    _teardown()
    return met


def _clear_sharding_cache() -> None:
    """Forget DTensor's cached sharding propagation (Python and C++ fast path) and redistribute plans. Their keys
    compare DeviceMeshes by layout, not by process group, so after a new group a cached result hands a later
    model of the same layout a mesh whose groups were destroyed: "Could not resolve the process group", or
    under a reused group name the wrong group. Private torch API (torch 2.13): the propagation caches through
    torch's own debug helper, the redistribute caches by name, each skipped if absent."""
    if "torch.distributed.tensor" not in sys.modules:  # never imported: nothing cached (and no 0.4 s import)
        return
    from torch.distributed.tensor import _redistribute, debug

    clears = [getattr(debug, "_clear_sharding_prop_cache", None)]
    clears.append(getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None))
    clears.append(getattr(getattr(_redistribute, "_planner_cache", None), "clear", None))
    for clear in clears:
        if callable(clear):
            clear()
