"""The package's floors hold (tests/floors.py): no import points up or sideways, every package has a floor,
the root holds only the modules the floor table names, ``parallel/__init__`` names every module of its package,
and docs/architecture.md shows the table the guard uses. No module is over 450 lines, and ``distributed/``'s
modules import one way (no circle, lazy imports included)."""

from __future__ import annotations

import re

from tests.floors import (
    FLOORS,
    ROOT_MODULES,
    Import,
    documented_table,
    floor_of,
    imports_of,
    judge,
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
