"""notebook_launcher from a real Jupyter kernel: examples/notebook_launcher.ipynb, executed with nbclient, trains
the tiny model on 2 forked CPU ranks (equal to one process within 1e-5) and shows run_distributed's
pickling error; run_distributed names the pickling cause outside notebooks too."""

from __future__ import annotations

import sys
import types

import pytest

from ndparallel.testing import DistributedError, run_distributed
from tests.command import REPO

pytestmark = pytest.mark.jobs  # real launchers, torchrun, CLI processes or signals: not in make test-fast

NOTEBOOK = REPO / "examples" / "notebook_launcher.ipynb"


def test_notebook_trains_on_two_forked_ranks(tmp_path):
    nbformat = pytest.importorskip("nbformat", reason="needs the notebook extra: pip install 'ndparallel[notebook]'")
    nbclient = pytest.importorskip("nbclient", reason="needs the notebook extra: pip install 'ndparallel[notebook]'")
    from jupyter_client.manager import KernelManager

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    resources = {"metadata": {"path": REPO}}  # the kernel starts in the repository root
    # IPC sockets, not TCP: jupyter_client picks free TCP ports and releases them before the kernel binds, so a
    # gloo store of a parallel test could take one in between (a CI run lost the kernel that way).
    manager = KernelManager(kernel_name="python3", transport="ipc", ip=str(tmp_path / "kernel"))
    client = nbclient.NotebookClient(notebook, timeout=300, km=manager, resources=resources)
    client.execute()  # a failing assertion in a cell raises CellExecutionError
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    shown = "".join(o.get("data", {}).get("text/plain", "") for o in outputs)
    assert "notebook_launcher(fn, args, num_processes=N)" in shown, shown


def test_run_distributed_names_the_pickling_cause(monkeypatch):
    # A function of an interactive __main__ (python -c, the REPL: a main module without a file) is refused
    # before any rank starts, naming notebook_launcher; a main module that is not a file (python -) too.
    def f():
        return 1

    f.__module__ = "__main__"
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    with pytest.raises(TypeError, match=r"interactive __main__.*notebook_launcher"):
        run_distributed(f, 2)
    stdin_main = types.ModuleType("__main__")
    stdin_main.__file__ = "<stdin>"
    monkeypatch.setitem(sys.modules, "__main__", stdin_main)
    with pytest.raises(TypeError, match="'<stdin>' is not a file"):
        run_distributed(_one, 2)
    monkeypatch.undo()
    with pytest.raises(TypeError, match="cannot pickle"):
        run_distributed(lambda: 1, 1)
    # A module the ranks cannot import: pickles here, fails to load there, and the rank says why.
    module = types.ModuleType("ndp_only_in_this_process")
    exec("def f():\n    return 1\n", module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.raises(DistributedError, match="could not load the function") as info:
        run_distributed(module.f, 1)
    assert "No module named 'ndp_only_in_this_process'" in info.value.remote_traceback


def _one():
    return 1
