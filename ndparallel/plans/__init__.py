"""Planners: one module per parallelism dimension."""
