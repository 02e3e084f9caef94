"""``ndparallel verify``: prove on a laptop that a model trains the same on any mesh as in one process.

One module per concept::

    model.py     --model: a preset, a Hugging Face config (random weights) or a user's nn.Module factory
    layouts.py   --layouts: parsed, generated (auto), or a real job's sizes folded down to the CPU ranks
    run.py       the one-process reference and the layouts on gloo ranks (one spawned group per world size)
    compare.py   measured tolerances, the per-layout row, the table and its verdict
    localize.py  the first module that differs (--localize), the first that is not deterministic
    api.py       verify(model, layouts, ...) -> VerifyTable
    cli.py       the ndparallel verify subcommand

See docs/verify.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ndparallel.lazy import lazy_names

# Public name -> its module, imported on first use (PEP 562): the ``ndparallel`` command builds the verify parser
# (``cli``) without the runs' DTensor imports.
_EXPORTS: dict[str, str] = {
    "verify": "ndparallel.verify.api",
    "Row": "ndparallel.verify.compare",
    "Tolerance": "ndparallel.verify.compare",
    "VerifyTable": "ndparallel.verify.compare",
    "Layout": "ndparallel.verify.layouts",
    "auto_layouts": "ndparallel.verify.layouts",
    "fold": "ndparallel.verify.layouts",
    "parse_layouts": "ndparallel.verify.layouts",
    "parse_reshards": "ndparallel.verify.layouts",
}

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ imports each on first use
    from ndparallel.verify.api import verify
    from ndparallel.verify.compare import Row, Tolerance, VerifyTable
    from ndparallel.verify.layouts import Layout, auto_layouts, fold, parse_layouts, parse_reshards


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)


__all__ = [
    "Layout",
    "Row",
    "Tolerance",
    "VerifyTable",
    "auto_layouts",
    "fold",
    "parse_layouts",
    "parse_reshards",
    "verify",
]
