"""The predicted-vs-measured markdown tables of docs/planning.md: one heading and one row format for them all."""

from __future__ import annotations

from collections.abc import Sequence


def table_header(*columns: str) -> list[str]:
    """A table's heading rows: the run's describing ``columns``, then quantity, measured, predicted, error."""
    names = [*columns, "quantity", "measured bytes", "predicted", "error"]
    return ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]


def comparison_row(cells: Sequence[object], quantity: str, measured: float, predicted: float) -> str:
    """One quantity of one run: what was measured, what the planner said, and its relative error."""
    error = (predicted - measured) / measured if measured else float("nan")
    described = "".join(f"{cell} | " for cell in cells)
    return f"| {described}{quantity} | {measured:,.0f} | {predicted:,.0f} | {error:+.2%} |"
