"""The job store: the rendezvous key-value store every rank of a job shares, and which node hosts it.

The process group is built on it (:func:`launcher_store`); the hang watchdog posts heartbeats and verdicts
through a connection of its own (:func:`job_store`), or through the file store of ``ndparallel.testing``'s
ranks (:func:`file_job_store`). Its own module so that ``process`` and ``watchdog`` both import it, neither
the other's way round.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

__all__ = ["file_job_store", "hosts_the_store", "job_store", "launcher_store"]


def launcher_store(timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store torchrun's env describes, keyed by restart attempt.

    After ``--max-restarts`` restarts a job, the store still holds the dead attempt's gloo
    addresses under the same keys, and the new ranks can connect to them ("connectFullMesh
    failed ... connection refused"; measured on torch 2.13). A prefix per attempt keeps them apart.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "False") == "True"
    store = dist.TCPStore(
        os.environ.get("MASTER_ADDR", "127.0.0.1"),
        int(os.environ.get("MASTER_PORT", "29500")),
        world,
        is_master=rank == 0 and not agent_hosts_store,
        timeout=timeout,
    )
    return dist.PrefixStore(_attempt_prefix(), store)


def _attempt_prefix() -> str:
    return f"ndparallel/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def job_store(timeout_s: float) -> dist.Store | None:
    """A connection of its own to the job's rendezvous store (None for one process), for a thread
    that must not queue behind the process group's store calls: the watchdog's heartbeats.

    torchrun's store (``MASTER_ADDR:MASTER_PORT``, keyed by restart attempt as the process group's
    is), or the file store of ``ndparallel.testing.run_distributed`` (``NDP_STORE_PATH``).
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if "NDP_STORE_PATH" in os.environ:
        return file_job_store(os.environ["NDP_STORE_PATH"])
    if "MASTER_PORT" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        store = dist.TCPStore(
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timeout,
            wait_for_workers=False,
        )
        return dist.PrefixStore(_attempt_prefix() + "/watchdog", store)
    return None


def file_job_store(path: str) -> dist.Store:
    """The job store of ``ndparallel.testing.run_ranks``' file ``path`` (the watchdog's keys), for its ranks
    and for the parent that started them."""
    # num_workers=-1: this handle never counts towards deleting the file.
    return dist.PrefixStore("ndparallel/watchdog", dist.FileStore(path, -1))


def _listens_on(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a listening TCP socket on ``port`` (Linux /proc; False elsewhere)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = [line.split() for line in f.read().splitlines()[1:]]
        except OSError:
            continue
        inodes |= {r[9] for r in rows if len(r) > 9 and r[3] == "0A" and int(r[1].rsplit(":", 1)[1], 16) == port}
    if not inodes:
        return False
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}")[len("socket:[") : -1] in inodes:
                return True
        except OSError:
            continue
    return False


def hosts_the_store() -> bool:
    """Whether this rank's node hosts the job's rendezvous store: its launcher (torchrun's agent
    store), or rank 0 itself when the ranks keep their own store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_PORT" in os.environ:
        return _listens_on(os.getppid(), int(os.environ["MASTER_PORT"]))
    return os.environ.get("RANK") == "0"
