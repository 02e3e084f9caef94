"""``get_logger``: Accelerate's multi-process logger. A record is emitted on the main process only, unless
``main_process_only=False`` (every process), or ``in_order=True`` (every process, one after the other)."""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch.distributed as dist

__all__ = ["MultiProcessAdapter", "get_logger"]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class MultiProcessAdapter(logging.LoggerAdapter):
    """A LoggerAdapter whose ``log`` takes ``main_process_only`` (default True) and ``in_order``."""

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        if not in_order:
            if not main_process_only or _rank() == 0:
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
            return
        world = dist.get_world_size() if dist.is_initialized() else 1
        for rank in range(world):
            if rank == _rank():
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
            if world > 1:
                dist.barrier()

    @functools.lru_cache(None)  # noqa: B019 - once per message, as Accelerate's
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """The logger ``name`` behind a :class:`MultiProcessAdapter` (level: ``log_level`` or ACCELERATE_LOG_LEVEL)."""
    log_level = log_level or os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper())
        logger.root.setLevel(log_level.upper())
    return MultiProcessAdapter(logger, {})
