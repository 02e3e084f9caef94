"""Run one script under ndparallel and then under 🤗 Accelerate, in the same torchrun ranks, for a side-by-side
comparison: ``python -m torch.distributed.run --nproc_per_node N tests/accelerator/twin.py SCRIPT OUT [ARGS...]``.

The script is Accelerate's (``from accelerate import ...``). For the ndparallel run its text is materialised
with the imports renamed (``accelerate`` -> ``ndparallel``) and nothing else changed; both copies run from
``OUT/<package>/`` (their working directory, where they save files) with ``ARGS``. ndparallel runs first and
tears its process group down; Accelerate then starts its own. Sharing the launch halves the start-up cost of
the comparison tests (interpreter, torch, transformers), which is most of their time.

``TWIN_SETUP=module``: ``module.install()`` runs first (the tiny model and data swap of
tests/accelerator/examples/tiny_glue.py). Each run's printed output goes to ``OUT/<package>/stdout_rank<r>.txt``,
and the training losses ``module.LOSSES`` recorded, if any, to ``OUT/<package>/losses_rank<r>.json``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import runpy
import sys
from pathlib import Path
from typing import Any

_IMPORT = re.compile(r"^(\s*)(from|import)\s+accelerate(\b[\w.]*)", re.MULTILINE)


def renamed(text: str) -> str:
    """``text`` with every ``from accelerate... import`` / ``import accelerate...`` line taken from ndparallel."""
    return _IMPORT.sub(lambda m: f"{m.group(1)}{m.group(2)} ndparallel{m.group(3)}", text)


def run(script: Path, folder: Path, args: list[str], setup: Any = None) -> None:
    """Run ``script`` as ``__main__`` from ``folder`` with ``args``; its output and losses land in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    saved_argv, saved_cwd = sys.argv, os.getcwd()
    sys.argv = [str(script), *args]
    os.chdir(folder)
    try:
        with open(f"stdout_rank{rank}.txt", "w") as out, contextlib.redirect_stdout(out):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
    if setup is not None and hasattr(setup, "LOSSES"):
        (folder / f"losses_rank{rank}.json").write_text(json.dumps(setup.LOSSES))
        setup.LOSSES.clear()


def _teardown_at_exit() -> None:
    """Leave the last run's process group alone until every rank has written its results, then end the process
    without tearing gloo down (for both libraries alike). Measured: Accelerate's teardown on 4 gloo CPU ranks hangs
    in ``destroy_process_group`` now and then, or aborts ("terminate called without an active exception"), after
    the run itself finished; ndparallel's ``destroy_distributed`` waits for every rank first and has not."""
    import torch.distributed as dist

    dist.destroy_process_group = lambda group=None: None


def _exit_together() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    script, out, args = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve(), sys.argv[3:]
    packages = os.environ.get("TWIN_PACKAGES", "ndparallel,accelerate").split(",")
    setup = importlib.import_module(os.environ["TWIN_SETUP"]) if os.environ.get("TWIN_SETUP") else None
    if setup is not None:
        setup.install()
    for package in packages:
        folder = out / package
        if package == "ndparallel":
            copy = out / f"{script.stem}_ndparallel.py"
            if int(os.environ.get("RANK", "0")) == 0:
                out.mkdir(parents=True, exist_ok=True)
                partial = copy.with_suffix(".partial")
                partial.write_text(renamed(script.read_text()))
                partial.rename(copy)
            _wait_for(copy)
            run(copy, folder, args, setup)
            _destroy_group()
        else:
            _teardown_at_exit()
            run(script, folder, args, setup)
    _exit_together()


def _wait_for(path: Path) -> None:
    import time

    for _ in range(600):
        if path.exists():
            return
        time.sleep(0.05)
    raise TimeoutError(f"{path} was not written by rank 0")


def _destroy_group() -> None:
    """Leave no process group behind for the next package's run (ndparallel's end_training already does)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    from ndparallel.launch.exit_collections import skip_collections_at_exit

    skip_collections_at_exit()  # a test's own process, as the ndparallel command's
    main()
