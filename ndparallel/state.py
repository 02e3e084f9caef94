"""``ndparallel.state``: ``accelerate.state`` under ndparallel's name (``PartialState``, ``AcceleratorState``,
``GradientState``), so its import changes only its package name."""

from ndparallel.accelerator.processes import PartialState
from ndparallel.accelerator.state import AcceleratorState, GradientState

__all__ = ["AcceleratorState", "GradientState", "PartialState"]
