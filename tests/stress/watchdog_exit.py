"""ndparallel's own case of the exit-time abort (tests/stress/daemon_thread_exit.py): a rank whose script destroyed
the process group itself (``torch.distributed.destroy_process_group()``) while the hang watchdog still posts
heartbeats, its next heartbeat caught in a store call as the interpreter finalizes. A second process holds the
job store's file lock across this one's exit, so the heartbeat is inside C++ when finalization starts.

``python tests/stress/watchdog_exit.py STORE_FILE``: exits 0 when the exit teardown stops the watchdog first
(ndparallel/distributed/process.py ``_destroy_at_exit``); aborted (-6) in 2 of 2 runs before that fix.
"""

import atexit
import datetime
import subprocess
import sys
import time

import torch.distributed as dist

from ndparallel.distributed import process
from ndparallel.distributed.watchdog import Watchdog

path = sys.argv[1]
store = dist.FileStore(path, -1)
store.set_timeout(datetime.timedelta(seconds=20))
# as init_distributed does on a torchrun rank: the watchdog (heartbeats every 0.2 s at a 4 s timeout), then the
# exit teardown; the group itself is already gone, as after torch.distributed.destroy_process_group()
Watchdog._current = Watchdog(dist.PrefixStore("ndparallel/watchdog", store), 0, 2, timeout_s=4.0)
atexit.register(process._destroy_at_exit)
HOLD = "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); print(1, flush=True); "
holder = subprocess.Popen([sys.executable, "-c", HOLD + "time.sleep(3)", path], stdout=subprocess.PIPE)
holder.stdout.readline()
time.sleep(0.6)  # the next heartbeat now waits for the store's file lock, inside C++


class SlowTeardown:
    def __del__(self, sleep=time.sleep):
        sleep(4)


keep = SlowTeardown()
print("DONE", flush=True)
