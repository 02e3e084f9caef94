"""Errors ndparallel raises for bad user input."""

__all__ = ["CheckpointError", "ConfigError"]


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field and how to fix it."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model; nothing was loaded."""
