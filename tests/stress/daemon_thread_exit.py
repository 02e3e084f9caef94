"""The exit-time abort, reduced to torch and Python alone (no ndparallel): a daemon thread inside a C++ call of
torch (a store ``get``, the GIL released) when the interpreter finalizes.

Python 3.11 ends a thread that takes the GIL back during finalization with ``pthread_exit``; its forced unwind
runs through pybind11's GIL guard, a destructor (``noexcept``), so the C++ runtime calls ``std::terminate``:
``terminate called without an active exception``, ``Fatal Python error: Aborted``, exit code -6 (SIGABRT); in
static destructors the same thread can fault instead (SIGSEGV). Measured on torch 2.13.0+cpu, Python 3.11:
it aborted in 6 of 6 runs. ``python tests/stress/daemon_thread_exit.py [call_s] [teardown_s]``. docs/troubleshooting.md.
"""

import datetime
import sys
import threading
import time

import torch.distributed as dist

CALL_S, TEARDOWN_S = (float(a) for a in (sys.argv[1:] + ["1", "3"])[:2])
store = dist.HashStore()
store.set_timeout(datetime.timedelta(seconds=CALL_S))


def blocked() -> None:
    try:
        store.get("never-set")  # C++, GIL released, until the store's timeout
    except Exception:  # noqa: BLE001 - the timeout; the abort comes as the GIL is taken back
        pass


class SlowTeardown:
    """Something slow to free at interpreter exit (a large model): finalization outlasts the store call."""

    def __del__(self, sleep=time.sleep, seconds=TEARDOWN_S):
        sleep(seconds)


threading.Thread(target=blocked, daemon=True).start()
keep = SlowTeardown()
time.sleep(0.2)
print("DONE", flush=True)
