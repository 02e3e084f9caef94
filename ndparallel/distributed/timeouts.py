"""The hang timeout and the clocks derived from it: how long a rank waits for its peers, how often it posts a
heartbeat, and the process group's own (later) timeout.

Shared by ``process`` (the group's timeout at ``init_distributed``), ``watchdog`` (when to judge) and the
launchers (``ndparallel launch --timeout``, ``notebook_launcher``); pure arithmetic on seconds.
"""

from __future__ import annotations

import math
import os

from ndparallel.errors import ConfigError

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "SILENT_AFTER",
    "TIMEOUT_ENV",
    "heartbeat_interval",
    "job_timeout",
    "parse_timeout",
    "process_group_timeout",
    "silent_after",
]

DEFAULT_TIMEOUT_S = 600.0
"""How long a rank waits for its peers before the watchdog ends the job (``train.timeout_s``' default too)."""
TIMEOUT_ENV = "NDP_TIMEOUT_S"
"""Set by ``ndparallel launch --timeout S``: the ranks' hang timeout when the script names none."""
SILENT_AFTER = 3
"""Heartbeat intervals without a new heartbeat before a rank counts as silent (at least ``SILENT_FLOOR_S``)."""
SILENT_FLOOR_S = 3.0
"""The shortest silence that counts, whatever the interval: a loaded machine starves a live rank's heartbeat
thread for a second or so (docs/troubleshooting.md, "Silence needs 3 s")."""


def job_timeout(timeout_s: float | None = None) -> float:
    """The hang timeout: ``timeout_s`` when given, else ``NDP_TIMEOUT_S`` (``ndparallel launch --timeout``),
    else :data:`DEFAULT_TIMEOUT_S`."""
    if timeout_s is not None:
        return parse_timeout(timeout_s, "timeout_s")
    if os.environ.get(TIMEOUT_ENV):
        return parse_timeout(os.environ[TIMEOUT_ENV], TIMEOUT_ENV)
    return DEFAULT_TIMEOUT_S


def parse_timeout(value: float | str, source: str) -> float:
    """``value`` as a number of seconds > 0, or a ConfigError naming ``source``."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"{source}={value!r} must be a number of seconds > 0 (how long a rank waits for its peers)")
    return seconds


def heartbeat_interval(timeout_s: float) -> float:
    """Seconds between two heartbeats: a twentieth of the timeout, within [0.2, 2]."""
    return min(2.0, max(0.2, timeout_s / 20))


def silent_after(timeout_s: float) -> float:
    """Seconds without a new heartbeat before a peer counts as silent: ``SILENT_AFTER`` heartbeat intervals,
    at least ``SILENT_FLOOR_S``."""
    return max(SILENT_FLOOR_S, SILENT_AFTER * heartbeat_interval(timeout_s))


def process_group_timeout(timeout_s: float) -> float:
    """The process group's own collective timeout: after the watchdog's verdict (``timeout_s`` plus
    the silence and few intervals it takes to be sure), so that the rank named is the one behind."""
    return timeout_s + silent_after(timeout_s) + 3 * heartbeat_interval(timeout_s) + 10
