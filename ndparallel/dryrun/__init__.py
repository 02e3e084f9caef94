"""The dry run: the real engine at the real world size, in one CPU process (``ndparallel dry-run``,
``ndparallel plan --dry-run``; docs/planning.md, "Dry run")."""

from ndparallel.dryrun.report import DryRunReport, RankReport

__all__ = ["DryRunReport", "RankReport"]
