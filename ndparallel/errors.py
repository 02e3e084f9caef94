"""Errors ndparallel raises for bad user input and for distributed jobs that cannot go on."""

import reprlib

__all__ = [
    "EXIT_HUNG",
    "EXIT_INTERRUPTED",
    "CheckpointError",
    "ConfigError",
    "DivergenceError",
    "JobError",
    "brief_repr",
]

EXIT_INTERRUPTED = 130
"""Exit status of a job stopped by SIGINT/SIGTERM (after saving, when checkpointing is on)."""
EXIT_HUNG = 124
"""Exit status of a rank (and of ``ndparallel launch``) ended by the hang watchdog."""


_BRIEF = reprlib.Repr()  # its limits, set as attributes (keyword arguments need Python 3.12)
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxlong, _BRIEF.maxother = 3, 60, 40, 60
_BRIEF.maxlist = _BRIEF.maxtuple = _BRIEF.maxdict = _BRIEF.maxset = 6
BRIEF_LIMIT = 200


def brief_repr(value: object) -> str:
    """``repr(value)`` cut short (at most ``BRIEF_LIMIT`` characters, 6 items per level, 3 levels deep), for error
    messages: the work is bounded however large the value (a YAML alias bomb, a 1 GB string)."""
    text = _BRIEF.repr(value)
    return text if len(text) <= BRIEF_LIMIT else text[: BRIEF_LIMIT - 3] + "..."


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field and how to fix it."""


class JobError(RuntimeError):
    """The distributed job cannot go on: a rank died, hung, or its node was lost. The message
    names the rank(s), their node, and where they were."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model; nothing was loaded."""


class DivergenceError(RuntimeError):
    """Training stopped because the loss or the gradient norm became NaN or inf."""
