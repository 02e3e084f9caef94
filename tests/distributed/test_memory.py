"""The one "will it fit in this machine's memory" rule (ndparallel.distributed.memory): the arithmetic of the
need, the boundary, an unknown memory, and the one-line message the three callers share."""

from __future__ import annotations

import pytest

from ndparallel.distributed.memory import check_fits_in_memory, format_gib, physical_memory
from ndparallel.errors import ConfigError

GIB = 2**30


def test_need_is_count_times_itemsize_times_factor_times_holders():
    args = dict(what="x needs", held="here", fix="shrink it")
    check_fits_in_memory(GIB, 4, factor=0.5, holders=3, memory=6 * GIB, **args)  # exactly fits
    with pytest.raises(ConfigError) as raised:
        check_fits_in_memory(GIB, 4, factor=0.5, holders=3, memory=6 * GIB - 1, **args)
    assert str(raised.value) == "x needs 6 GiB here, more than this machine's 6 GiB of memory; shrink it"
    check_fits_in_memory(10**30, 8, memory=0, **args)  # the OS did not say: not checked
    with pytest.raises(ConfigError, match=r"^x needs 1.5 GiB here, more than this machine's 1 GiB of memory; "):
        check_fits_in_memory(3 * GIB // 2, 1, memory=GIB, **args)


def test_the_default_is_this_machines_physical_memory():
    memory = physical_memory()
    assert memory is None or memory > 0
    if memory:
        check_fits_in_memory(memory, 1, what="x needs", held="here", fix="f")
        with pytest.raises(ConfigError, match="x needs"):
            check_fits_in_memory(memory + 1, 1, what="x needs", held="here", fix="f")
    assert format_gib(0) == "0" and format_gib(1024 * GIB) == "1,024" and format_gib(GIB * 5 // 4) == "1.2"
