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

from ndparallel.verify.api import verify
from ndparallel.verify.compare import Row, Tolerance, VerifyTable
from ndparallel.verify.layouts import Layout, auto_layouts, fold, parse_layouts, parse_reshards

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
