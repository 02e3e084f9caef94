"""Will it fit in this machine's memory: the one rule every "too big to build here" refusal applies.

Each caller counts its own elements (a ``TransformerConfig``, a meta-device model, a Hugging Face
config.json); :func:`check_fits_in_memory` turns the count into bytes, compares them with
:func:`physical_memory` and words the refusal, so the need, the availability and the message live here once.
"""

from __future__ import annotations

import os

from ndparallel.config.parallelism import CPU_RANKS_ENV
from ndparallel.errors import ConfigError

__all__ = ["check_fits_in_memory", "format_gib", "physical_memory", "ranks_on_this_machine"]


def physical_memory() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say): the bound a model or corpus
    every rank builds on the host must fit."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def ranks_on_this_machine() -> int:
    """The ranks of this job on this machine: torchrun's (and the rank harness's) ``LOCAL_WORLD_SIZE``, else
    ``--cpu-ranks`` (set for the launcher itself, before its ranks start), else 1. Each holds its own copy of
    what every rank builds or reads, so a fits-in-memory check counts them all."""
    for name in ("LOCAL_WORLD_SIZE", CPU_RANKS_ENV):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def format_gib(size: float) -> str:
    """``size`` bytes in GiB to one decimal, a whole number without its ``.0`` (``0``, ``1.5``, ``1,024``)."""
    return f"{size / 2**30:,.1f}".removesuffix(".0")


def check_fits_in_memory(
    count: int,
    itemsize: int,
    *,
    what: str,
    held: str,
    fix: str,
    factor: float = 1.0,
    holders: int = 1,
    memory: int | None = None,
) -> None:
    """Refuse, before anything is built, ``count`` elements of ``itemsize`` bytes, times ``factor`` (copies per
    process: gradients and optimizer state, or ``1 / ranks`` for an even spread), held by ``holders`` processes
    on this machine, when that is more than its memory (``memory`` bytes; default :func:`physical_memory`;
    unknown or 0: not checked).

    The ConfigError is one line: ``{what} {need} GiB {held}, more than this machine's {memory} GiB of memory;
    {fix}``; ``what`` ends in its verb (``the model (7.0B parameters) needs``), ``held`` says where the bytes
    sit, ``fix`` what to change.
    """
    memory = physical_memory() if memory is None else memory
    need = count * itemsize * factor * holders
    if memory and need > memory:
        raise ConfigError(
            f"{what} {format_gib(need)} GiB {held}, more than this machine's {format_gib(memory)} GiB of memory; {fix}"
        )
