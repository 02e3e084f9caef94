"""The floors of the ndparallel package: the one definition the guard test holds the imports to, and that
docs/architecture.md's floor table is rendered from (``python -m tests.floors --write`` rewrites it).

A module may import from its own top-level package or from a package on a lower floor; never up, never
sideways (two packages on one floor do not import each other). Lazy imports (inside functions, under
``TYPE_CHECKING``) count like any other.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ndparallel"
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- floors:begin (python -m tests.floors --write) -->", "<!-- floors:end -->"

# Bottom up: (floor name, top-level packages or root modules, what lives there).
FLOORS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("errors", ("errors", "lazy"), "the exceptions every floor raises; names imported on first use (PEP 562)"),
    ("config", ("config",), "what a user declares, and every rule checkable on it alone: no ranks, no model"),
    ("distributed", ("distributed",), "ranks and collectives, knowing no module tree; the gloo rank harness"),
    ("parallel", ("parallel",), "the family protocol, the planners and their order, pipeline runtime, clip, loss"),
    ("models", ("models",), "one folder per model family, each handing the planners what they need"),
    ("state", ("checkpoint", "estimate"), "checkpoints on disk; the cost model and mesh search"),
    ("train", ("train",), "the training job: one step, the loop, data"),
    ("jobs", ("accelerator", "bench", "verify"), "the Accelerate-compatible API; the scaling benchmark; verify"),
    ("rehearsal", ("dryrun",), "the dry run: the real job on fake ranks, one process (models as verify reads them)"),
    ("launch", ("launch",), "the ndparallel command, torchrun underneath, worker guard, notebook launcher"),
    (
        "api",
        (
            "__init__",
            "__main__",
            "hf",
            "local_sgd",
            "logging",
            "parallelism_config",
            "state",
            "testing",
            "tracking",
            "utils",
        ),
        "the public face: ndp.X, python -m, ndparallel.hf, ndparallel.testing; Accelerate's import paths",
    ),
)
ROOT_MODULES = (
    "__init__",
    "__main__",
    "errors",
    "lazy",
    "local_sgd",
    "logging",
    "parallelism_config",
    "state",
    "testing",
    "tracking",
)


def floor_of(unit: str) -> int:
    """The floor index of a top-level package or root module (``config``, ``__init__``, ...)."""
    for index, (_, units, _) in enumerate(FLOORS):
        if unit in units:
            return index
    raise KeyError(f"ndparallel/{unit} is on no floor: add it to tests/floors.py FLOORS")


def unit_of(module: str) -> str:
    """``ndparallel.parallel.fqn`` -> ``parallel``; ``ndparallel`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module
    imported: str  # dotted module (``from ndparallel import models`` counts as ``ndparallel.models``)
    line: int


def _root_name(name: str) -> str:
    """``models`` -> ``ndparallel.models`` (a package or root module); ``ConfigError`` -> ``ndparallel``."""
    is_unit = (PACKAGE / name / "__init__.py").exists() or (PACKAGE / f"{name}.py").exists()
    return f"ndparallel.{name}" if is_unit else "ndparallel"


def imports_of(path: Path, root: Path = ROOT) -> list[Import]:
    """Every ndparallel import in one file, wherever it sits (top level, function, TYPE_CHECKING)."""
    importer = module_name(path, root)
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [Import(importer, a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "ndparallel"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = importer.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target.split(".")[0] != "ndparallel":
                continue
            if target == "ndparallel":  # from ndparallel import models: a unit; from ndparallel import X: the root
                found += [Import(importer, _root_name(a.name), node.lineno) for a in node.names]
            else:
                found.append(Import(importer, target, node.lineno))
    return found


def judge(imp: Import) -> str | None:
    """Why ``imp`` breaks the floors (it points up, or sideways to another package of its floor), or None."""
    a, b = unit_of(imp.importer), unit_of(imp.imported)
    if a == b:
        return None
    fa, fb = floor_of(a), floor_of(b)
    if fb < fa:
        return None
    kind = "up" if fb > fa else "sideways"
    return f"{imp.importer} (floor {FLOORS[fa][0]}) imports {imp.imported} (floor {FLOORS[fb][0]}): {kind}"


def violations() -> list[str]:
    """Each import in the package that breaks the floors, as ``file:line: why``."""
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for imp in imports_of(path):
            why = judge(imp)
            if why:
                problems.append(f"{path.relative_to(ROOT)}:{imp.line}: {why}")
    return problems


def units_on_disk() -> set[str]:
    """The top-level packages and root modules that exist."""
    units = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return units | {p.stem for p in PACKAGE.glob("*.py")}


def render_table() -> str:
    """The floor table of docs/architecture.md, top floor first."""
    rows = ["| floor | packages | what lives there |", "|---|---|---|"]
    for name, units, what in reversed(FLOORS):
        shown = ", ".join(f"`{u}.py`" if u in ROOT_MODULES else f"`{u}/`" for u in units)
        rows.append(f"| {name} | {shown} | {what} |")
    return "\n".join(rows)


def documented_table() -> str:
    text = DOC.read_text()
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()


def write_table() -> None:
    text = DOC.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    DOC.write_text(f"{text[:start]}\n{render_table()}\n{text[end:]}")


if __name__ == "__main__":
    if "--write" in sys.argv:
        write_table()
    print(render_table())
    for problem in violations():
        print(problem)
