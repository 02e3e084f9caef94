"""Moved to :mod:`ndparallel.estimate.cli` (``ndparallel plan``); this name keeps old imports and
``python -m ndparallel.plan_cli`` working."""

import sys

from ndparallel.estimate.cli import add_plan_parser, format_plan, main, plan_to_json, run_plan

__all__ = ["add_plan_parser", "format_plan", "main", "plan_to_json", "run_plan"]

if __name__ == "__main__":
    sys.exit(main())
