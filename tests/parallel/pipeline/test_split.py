"""Which blocks each stage holds (``ndparallel/parallel/pipeline/split.py``): balanced by size, or given and
checked against the model. No ranks."""

from __future__ import annotations

import pytest

from ndparallel.errors import ConfigError
from ndparallel.parallel.pipeline import balanced_split, stage_ranges


def test_balanced_split_minimises_the_largest_stage():
    assert balanced_split([1] * 8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    # a big embedding on the first stage and head on the last push blocks to the middle stages
    assert balanced_split([10] * 6, 3, first_extra=25, last_extra=25) == [range(0, 1), range(1, 5), range(5, 6)]
    assert balanced_split([5, 1, 1, 1, 1, 5], 2) == [range(0, 3), range(3, 6)]
    with pytest.raises(ConfigError, match="4 pipeline stages .* but the model has 3 blocks"):
        balanced_split([1, 1, 1], 4)


def test_explicit_split_is_checked_against_the_model():
    assert stage_ranges([1] * 4, 2, [[0, 1], [1, 4]]) == [range(0, 1), range(1, 4)]
    with pytest.raises(ConfigError, match="covers blocks 0..2 but the model has 4 blocks"):
        stage_ranges([1] * 4, 2, [[0, 1], [1, 3]])
    with pytest.raises(ConfigError, match="pp_split has 3 ranges but there are 2 stages"):
        stage_ranges([1] * 4, 2, [[0, 1], [1, 2], [2, 4]])
