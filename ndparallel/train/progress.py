"""Rank-0 progress line and the end-of-run summary."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

__all__ = ["Progress", "format_duration", "format_rate", "format_router_health", "router_health"]


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def format_rate(tokens_per_s: float) -> str:
    if tokens_per_s >= 1e6:
        return f"{tokens_per_s / 1e6:.2f}M"
    if tokens_per_s >= 1e3:
        return f"{tokens_per_s / 1e3:.1f}k"
    return f"{tokens_per_s:.0f}"


def router_health(loads: list[torch.Tensor]) -> dict[str, Any] | None:
    """An MoE step's router health from each router's global tokens per expert: ``per_router``, each router's max
    / mean tokens per expert in model order (1.0: perfectly balanced); ``imbalance``, the worst of them; and
    ``dropped`` tokens (the reference MoE is dropless: 0). None without routers."""
    if not loads:
        return None
    per_router = [float(load.max() / load.mean()) if load.sum() > 0 else 1.0 for load in loads]
    return {"imbalance": max(per_router), "per_router": per_router, "dropped": 0}


def format_router_health(health: dict[str, Any]) -> str:
    """``1.23 max/mean, 0 dropped``: the progress line's ``experts`` field."""
    return f"{health['imbalance']:.2f} max/mean, {health['dropped']} dropped"


class Progress:
    """``step 40/200 [#####.....] loss 2.31 | 14.2k tok/s | lr 2.9e-03 | eta 0m41s`` on rank 0 only (an MoE
    model adds ``experts 1.23 max/mean, 0 dropped``: :func:`router_health`).

    On a terminal the line redraws in place; otherwise one line is printed every ``every`` steps.
    """

    def __init__(self, total: int, enabled: bool, every: int = 10, width: int = 24, stream=None, start_step: int = 0):
        self.total = total
        self.start_step = start_step
        self.enabled = enabled
        self.every = max(1, every)
        self.width = width
        self.stream = stream or sys.stdout
        self.tty = self.enabled and self.stream.isatty()
        self.start = time.perf_counter()

    def update(self, step: int, **fields: float | str) -> None:
        if not self.enabled or not (self.tty or step % self.every == 0 or step == self.total):
            return
        done = int(self.width * step / self.total)
        elapsed = time.perf_counter() - self.start
        eta = elapsed / max(step - self.start_step, 1) * (self.total - step)
        parts = [f"step {step:>{len(str(self.total))}}/{self.total} [{'#' * done}{'.' * (self.width - done)}]"]
        parts += [f"{name} {value}" for name, value in fields.items()]
        parts.append(f"eta {format_duration(eta)}")
        line = " | ".join(parts)
        if self.tty:
            self.stream.write("\r" + line + ("\n" if step == self.total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
