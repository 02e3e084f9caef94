"""The package's floors hold (tests/floors.py): no import points up or sideways, every package has a floor,
the root holds only the modules the floor table names, ``parallel/__init__`` names every module of its package,
and docs/architecture.md shows the table the guard uses."""

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
    assert judge(Import("ndparallel.checkpoint.saving", "ndparallel.estimate.spec", 1)).endswith("sideways")
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


LAYOUT_SUFFIXES = ("_pp", "_ep", "_moe")  # a twin of a concept's tests for one layout (issue 47)
TWINS_BEING_REGROUPED = {  # being regrouped on branch i47c
    "tests/estimate/test_estimate_pp.py",
    "tests/estimate/test_estimate_moe.py",
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
    assert twins - TWINS_BEING_REGROUPED == set(), "name the test module by its concept; parametrise the layouts"
