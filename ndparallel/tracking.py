"""``ndparallel.tracking``: ``accelerate.tracking`` under ndparallel's name (``GeneralTracker`` for custom
trackers, and the built-in JSONL and TensorBoard trackers)."""

from ndparallel.accelerator.trackers import GeneralTracker, JSONLTracker, TensorBoardTracker

__all__ = ["GeneralTracker", "JSONLTracker", "TensorBoardTracker"]
