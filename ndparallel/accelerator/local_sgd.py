"""``LocalSGD``: Accelerate's local SGD on ndparallel's data parallel. Inside the context the ranks train without
syncing gradients; every ``local_sgd_steps`` optimizer steps (and on leaving) their parameters are averaged."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from ndparallel.errors import ConfigError

__all__ = ["LocalSGD"]


class LocalSGD:
    """``with LocalSGD(accelerator, model, local_sgd_steps=8) as local_sgd: ... local_sgd.step()`` after each
    optimizer step. Plain data parallel only (one process: nothing to average)."""

    def __init__(self, accelerator: Any, model: nn.Module, local_sgd_steps: int, enabled: bool = True):
        if enabled and accelerator.mesh.size("dp_replicate") != accelerator.num_processes:
            raise ConfigError(
                "LocalSGD averages whole models: it needs plain data parallel (dp_replicate over every rank); "
                "under FSDP, tp or cp train without it"
            )
        self.accelerator, self.model = accelerator, model
        self.local_sgd_steps, self.enabled = local_sgd_steps, enabled and accelerator.num_processes > 1
        self.num_steps = 0
        self._no_sync = contextlib.ExitStack()

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync.enter_context(self.accelerator.no_sync(self.model))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self._average()
        self._no_sync.close()

    def step(self) -> None:
        """Count one optimizer step; average the parameters every ``local_sgd_steps``."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average()

    @torch.no_grad()
    def _average(self) -> None:
        self.accelerator.wait_for_everyone()
        for param in self.model.parameters():
            param.data = self.accelerator.reduce(param.data, reduction="mean")
