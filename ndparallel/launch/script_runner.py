"""How ``ndparallel launch`` runs a Python script on each rank: ``python -m ndparallel.launch.script_runner SCRIPT
ARGS...`` gives a process group the script starts with torch's own ``torch.distributed.init_process_group`` the
hang watchdog that ``ndparallel.init_distributed`` starts, then runs the script as ``__main__``.

Why: a plain script's rank that never reaches a collective used to keep its peers waiting for the group's own
timeout (gloo's default: 30 minutes; 600 s where the script passed it) and ended with no word on who was behind.
Now the watchdog judges at ``--timeout`` (default 600 s), or earlier when the script's own timeout is shorter,
so that its verdict comes first: ``the job hung: rank 1 did not reach the collective within ...``. The script is
run as ``python SCRIPT`` would (``sys.argv``, ``sys.path[0]`` its folder). docs/launch.md#hangs.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
from typing import Any

__all__ = ["main"]


def _watch_script_groups() -> None:
    """Wrap ``torch.distributed.init_process_group`` (the public name scripts call) so that a multi-rank default
    group it starts gets the watchdog; the group's timeout, when the script gives none, is the watchdog's
    backstop (a little after the verdict)."""
    import torch.distributed as dist

    original = dist.init_process_group

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        from ndparallel.distributed.process import script_group_timeout, watch_script_group

        given = kwargs.get("timeout")
        if given is None:
            kwargs["timeout"] = script_group_timeout()
        result = original(*args, **kwargs)
        watch_script_group(None if given is None else given.total_seconds())
        return result

    dist.init_process_group = init_process_group


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m ndparallel.launch.script_runner SCRIPT [ARGS...]")
    script = argv[0]
    _watch_script_groups()
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it (-m put the cwd there)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
