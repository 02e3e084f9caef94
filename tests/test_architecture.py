"""The package's floors hold (tests/floors.py): no import points up or sideways, every package has a floor,
the root holds only the modules the floor table names, ``parallel/__init__`` names every module of its package,
and docs/architecture.md shows the table the guard uses. No module is over 450 lines, ``distributed/``'s
modules import one way (no circle, lazy imports included), and the jobs know no particular model family."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.floors import (
    FLOORS,
    ROOT_MODULES,
    Import,
    documented_table,
    floor_of,
    imports_of,
    judge,
    module_name,
    render_table,
    units_on_disk,
    violations,
)


def test_no_import_points_up_or_sideways():
    assert violations() == []


def test_every_package_and_root_module_has_a_floor():
    on_floors = {unit for _, units, _ in FLOORS for unit in units}
    assert units_on_disk() == on_floors


def test_the_root_holds_only_the_modules_on_the_floor_table():
    from tests.floors import PACKAGE

    assert {p.stem for p in PACKAGE.glob("*.py")} == set(ROOT_MODULES)


def test_every_test_package_mirrors_a_package_of_ndparallel():
    from tests.floors import PACKAGE, ROOT

    tools = {"stress"}  # `make stress`'s driver: it runs other tests and launches, it tests no package of its own
    test_packages = {p.parent.name for p in (ROOT / "tests").glob("*/__init__.py")} - tools
    assert {name for name in test_packages if not (PACKAGE / name / "__init__.py").exists()} == set()


def test_the_parallel_package_docstring_names_each_of_its_modules():
    import ndparallel.parallel
    from tests.floors import PACKAGE

    modules = {p.stem for p in (PACKAGE / "parallel").glob("*.py")} - {"__init__"} | {"pipeline"}
    documented = set(re.findall(r"``(\w+)/?``", ndparallel.parallel.__doc__))
    assert modules - documented == set(), "name the new module in ndparallel/parallel/__init__.py's docstring"
    assert documented - modules == set(), "a module named in ndparallel/parallel/__init__.py's docstring is gone"


def test_the_documented_floor_table_is_the_guards():
    assert documented_table() == render_table(), "run: python -m tests.floors --write"


def test_the_guard_flags_up_sideways_and_lazy_imports(tmp_path):
    assert floor_of("config") < floor_of("distributed") < floor_of("parallel") < floor_of("models")
    assert judge(Import("ndparallel.models.hf.loss", "ndparallel.parallel.loss", 1)) is None  # down: fine
    assert judge(Import("ndparallel.parallel.fqn", "ndparallel.parallel.family", 1)) is None  # own package
    up = judge(Import("ndparallel.parallel.context_parallel", "ndparallel.models.transformer.model", 3))
    assert up == (
        "ndparallel.parallel.context_parallel (floor parallel) imports ndparallel.models.transformer.model "
        "(floor models): up"
    )
    assert judge(Import("ndparallel.checkpoint.saving", "ndparallel.estimate.model", 1)).endswith("sideways")
    # a lazy import inside a function, one under TYPE_CHECKING, and `from ndparallel import models` all count
    module = tmp_path / "ndparallel" / "parallel" / "planner.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ndparallel.train import loop\n"
        "def f():\n    from ndparallel import models\n    from . import fqn\n"
    )
    found = imports_of(module, root=tmp_path)
    assert [(i.imported, i.line) for i in found] == [
        ("ndparallel.train", 3),
        ("ndparallel.models", 5),
        ("ndparallel.parallel", 6),
    ]
    assert [judge(i) is not None for i in found] == [True, True, False]


MAX_LINES = 450


def test_no_module_is_over_450_lines():
    from tests.floors import PACKAGE, ROOT

    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    too_long = {path: n for path, n in lengths.items() if n > MAX_LINES}
    assert too_long == {}, f"split these along their concepts (at most {MAX_LINES} lines a module)"


def _modules_imported(path, modules: set[str]) -> set[str]:
    """The modules among ``modules`` (dotted names) that one file imports, lazy imports included;
    ``from package import module`` counts as that module."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found & modules


def test_the_distributed_modules_import_one_way():
    """No import circle inside ``distributed/`` (``process`` and ``watchdog`` once imported each other, lazily):
    ``store`` and ``timeouts`` are what both need."""
    from tests.floors import PACKAGE, module_name

    paths = {module_name(p): p for p in (PACKAGE / "distributed").glob("*.py") if p.name != "__init__.py"}
    graph = {m: _modules_imported(p, set(paths)) - {m} for m, p in paths.items()}
    order: list[str] = []
    while graph:
        leaves = sorted(m for m, deps in graph.items() if deps <= set(order))
        assert leaves, f"an import circle among {sorted(graph)}"
        order += leaves
        graph = {m: deps for m, deps in graph.items() if m not in leaves}


# The jobs (train/, accelerator/) ask the model's family (ndparallel.parallel.protocol.family_for) for what differs by
# model: router statistics and bias updates, loss_in_forward, what prepare adds (save_pretrained), the folder format.
# The only names they may import from ndparallel.models build the reference Transformer from a job's YAML
# (`ndparallel train`'s model: section): constructing a model is not knowing a family's behaviour.
JOB_PACKAGES = ("train", "accelerator")
MODEL_CONSTRUCTION = {
    ("ndparallel.train.loop", "ndparallel.models", "Transformer"),
    ("ndparallel.train.job_config", "ndparallel.models", "TransformerConfig"),
}


def model_imports(package_root: Path, root: Path) -> set[tuple[str, str, str]]:
    """``(importer, module, name)`` for every name a job module imports from ``ndparallel.models`` or below
    (lazy imports included; ``from ndparallel import models`` counts as the name ``models``)."""
    found = set()
    for package in JOB_PACKAGES:
        for path in sorted((package_root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            names = {
                n.lineno: [a.name for a in n.names]
                for n in ast.walk(tree)
                if isinstance(n, ast.Import | ast.ImportFrom)
            }
            for imp in imports_of(path, root):
                if imp.imported == "ndparallel.models" or imp.imported.startswith("ndparallel.models."):
                    found |= {(module_name(path, root), imp.imported, name) for name in names[imp.line]}
    return found


def test_jobs_import_no_model_family_only_the_reference_transformer_to_build():
    from tests.floors import PACKAGE, ROOT

    assert model_imports(PACKAGE, ROOT) - MODEL_CONSTRUCTION == set(), "ask family_for(model) instead"


def test_the_job_guard_flags_what_the_jobs_imported_before_issue_47(tmp_path):
    package = tmp_path / "ndparallel"
    for folder in JOB_PACKAGES:
        (package / folder).mkdir(parents=True)
    (package / "train" / "loop.py").write_text("from ndparallel.models import Transformer\n")
    (package / "train" / "step.py").write_text("from ndparallel.models.transformer.moe import router_loads\n")
    (package / "accelerator" / "trainer.py").write_text(
        "def _save():\n    from ndparallel.models.hf.pretrained import save_pretrained\nfrom ndparallel import models\n"
    )
    assert model_imports(package, tmp_path) - MODEL_CONSTRUCTION == {
        ("ndparallel.train.step", "ndparallel.models.transformer.moe", "router_loads"),
        ("ndparallel.accelerator.trainer", "ndparallel.models.hf.pretrained", "save_pretrained"),
        ("ndparallel.accelerator.trainer", "ndparallel.models", "models"),
    }


LAYOUT_SUFFIXES = ("_pp", "_ep", "_moe")  # a twin of a concept's tests for one layout (issue 47)
TWINS_BEING_REGROUPED = {  # being regrouped on branch i47c
    "tests/estimate/test_pipeline.py",
    "tests/estimate/test_experts.py",
}


def test_test_folders_mirror_ndparallel_and_test_names_carry_no_layout_suffix():
    """A folder of tests below ``tests/<x>/`` (``tests/parallel/pipeline/``) is a package mirroring ndparallel's
    folder of the same path; a test module is named by its concept, its layouts (dense, pp, ep, moe-pp) being
    its parametrisation: no ``test_<concept>_pp.py``. A name ending so is fine where it names a module (the
    words as folders, e.g. tests/models/test_hf_moe.py for ndparallel/models/hf/moe.py)."""
    from tests.floors import PACKAGE, ROOT

    tests = ROOT / "tests"
    test_files = sorted(tests.glob("*/**/test_*.py"))
    folders = {f.parent.relative_to(tests) for f in test_files if len(f.parent.relative_to(tests).parts) > 1}
    assert {
        str(folder)
        for folder in folders
        if not ((tests / folder / "__init__.py").exists() and (PACKAGE / folder / "__init__.py").exists())
    } == set(), "a folder of tests mirrors a package of ndparallel (with an __init__.py in both)"

    def names_a_module(path) -> bool:
        words = path.stem.removeprefix("test_").split("_")
        package = PACKAGE / path.relative_to(tests).parts[0]
        return (package.joinpath(*words[:-1]) / f"{words[-1]}.py").exists()

    twins = {
        str(f.relative_to(ROOT))
        for f in test_files
        if f.stem.removeprefix("test_").endswith(LAYOUT_SUFFIXES) and not names_a_module(f)
    }
    assert twins == set(), "name the test module by its concept; parametrise the layouts"


def test_the_lazy_top_level_names_are_one_list():
    """``ndparallel/__init__``'s names load on first use: its table, its static imports and ``__all__`` name the
    same names, and every one resolves."""
    import ndparallel
    from tests.floors import PACKAGE

    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))
    static = {alias.asname or alias.name for node in guarded.body for alias in node.names}
    lazy = {*ndparallel._EXPORTS, *ndparallel._SUBPACKAGES}
    assert static == lazy
    assert set(ndparallel.__all__) == lazy | {"is_rich_available"}
    assert all(getattr(ndparallel, name) is not None for name in ndparallel.__all__)


def _lazy_packages() -> list[str]:
    """The packages below the root whose ``__init__`` loads its names on first use (an ``_EXPORTS`` table)."""
    from tests.floors import PACKAGE

    return sorted(
        module_name(p)
        for p in PACKAGE.rglob("__init__.py")
        if p.parent != PACKAGE and re.search(r"^_EXPORTS\b", p.read_text(), re.MULTILINE)
    )


def test_the_lazy_package_names_are_one_list():
    """Each lazy package's table, its static imports and ``__all__`` name the same names, and every one resolves
    to the object its module defines (issue 47: the ``ndparallel train`` front process imports no DTensor)."""
    import importlib

    from tests.floors import ROOT

    packages = _lazy_packages()
    assert {"ndparallel.models", "ndparallel.train", "ndparallel.checkpoint"} <= set(packages)
    for name in packages:
        path = ROOT / Path(*name.split(".")) / "__init__.py"
        tree = ast.parse(path.read_text())
        guarded = next(n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))
        static = {alias.asname or alias.name for node in guarded.body for alias in node.names}
        package = importlib.import_module(name)
        assert static == set(package._EXPORTS) == set(package.__all__), name
        for attr, module in package._EXPORTS.items():
            assert getattr(package, attr) is getattr(importlib.import_module(module), attr), f"{name}.{attr}"


def test_the_train_front_process_imports_no_dtensor():
    """``ndparallel train --cpu-ranks N``'s own process (every parser, the config, the mesh and checkpoint-folder
    checks, the launch up to torchrun's main) never imports ``torch.distributed.tensor`` (~0.45 CPU-s, sympy):
    only the ranks it starts do (docs/architecture.md, "Tests")."""
    import subprocess
    import sys

    from tests.command import REPO, clean_env

    script = (
        "import sys\nimport torch.distributed.run\n"
        "torch.distributed.run.main = lambda args: print('dtensor', 'torch.distributed.tensor' in sys.modules)\n"
        "from ndparallel.launch.cli import main\n"
        "sys.exit(main(['train', '--config', 'configs/demo.yaml', '--cpu-ranks', '2', 'train.steps=1']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, env=clean_env(), timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "dtensor False"


def test_a_plain_pytest_runs_the_suite_on_workers_and_named_tests_in_one_process(monkeypatch):
    """pyproject's ``-n auto`` meets tests/conftest.py's rule: a folder (or the whole suite) on one xdist worker
    per core, at most four; named files or tests, ``-s`` and ``--trace``, in the pytest process itself."""
    import os
    from types import SimpleNamespace

    from tests.conftest import MAX_AUTO_WORKERS, pytest_xdist_auto_num_workers
    from tests.floors import ROOT

    assert "\naddopts = '-n auto --dist loadfile " in (ROOT / "pyproject.toml").read_text()
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.chdir(ROOT)

    def workers(*args: str, capture: str = "fd", trace: bool = False) -> int | None:
        options = SimpleNamespace(capture=capture, trace=trace)
        return pytest_xdist_auto_num_workers(SimpleNamespace(args=list(args), option=options))

    cores = os.cpu_count() or 1
    expected = min(cores, MAX_AUTO_WORKERS) if cores > 1 else 0
    assert workers("tests") == workers("tests/config", "tests/parallel/pipeline") == expected
    assert workers("tests/config/test_config.py") == workers("tests/config", "tests/test_readme.py") == 0
    assert workers("tests/test_readme.py::test_readme_usage_example_runs") == 0
    assert workers("tests", capture="no") == workers("tests", trace=True) == 0
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
    assert workers("tests") is None  # xdist's own hook reads it
