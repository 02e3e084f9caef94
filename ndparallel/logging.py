"""``ndparallel.logging``: ``accelerate.logging`` under ndparallel's name (``get_logger``)."""

from ndparallel.accelerator.logs import MultiProcessAdapter, get_logger

__all__ = ["MultiProcessAdapter", "get_logger"]
