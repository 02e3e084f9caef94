"""Errors ndparallel raises for bad user input."""

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field and how to fix it."""
