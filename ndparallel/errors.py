"""Errors ndparallel raises for bad user input and for distributed jobs that cannot go on."""

__all__ = ["EXIT_HUNG", "EXIT_INTERRUPTED", "CheckpointError", "ConfigError", "DivergenceError", "JobError"]

EXIT_INTERRUPTED = 130
"""Exit status of a job stopped by SIGINT/SIGTERM (after saving, when checkpointing is on)."""
EXIT_HUNG = 124
"""Exit status of a rank (and of ``ndparallel launch``) ended by the hang watchdog."""


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field and how to fix it."""


class JobError(RuntimeError):
    """The distributed job cannot go on: a rank died, hung, or its node was lost. The message
    names the rank(s), their node, and where they were."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model; nothing was loaded."""


class DivergenceError(RuntimeError):
    """Training stopped because the loss or the gradient norm became NaN or inf."""
