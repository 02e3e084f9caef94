"""Errors ndparallel raises for bad user input."""

__all__ = ["CheckpointError", "ConfigError", "DivergenceError"]


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field and how to fix it."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model; nothing was loaded."""


class DivergenceError(RuntimeError):
    """Training stopped because the loss or the gradient norm became NaN or inf."""
