"""Moved to :mod:`ndparallel.estimate.search`; this name keeps old imports working."""

from ndparallel.estimate.search import Estimate, Plan, estimate, mesh_shapes, plan, shape_problems

__all__ = ["Estimate", "Plan", "estimate", "mesh_shapes", "plan", "shape_problems"]
