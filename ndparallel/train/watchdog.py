"""The hang watchdog moved to :mod:`ndparallel.distributed.watchdog` (``init_distributed`` starts it, so any
script under ``ndparallel launch`` gets it); this name stays for code that imports it from here."""

from ndparallel.distributed.watchdog import (  # noqa: F401
    Beat,
    Watchdog,
    describe,
    heartbeat_interval,
    judge,
    process_group_timeout,
)
