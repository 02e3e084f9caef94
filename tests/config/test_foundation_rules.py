"""The one sequence-length rule and the one cross-rank agreement helper (tests/config/test_foundation_rules.py)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from ndparallel.config.sequence import check_sequence_length, sequence_multiple, sequence_problem
from ndparallel.distributed.agree import agree
from ndparallel.errors import CheckpointError, ConfigError
from ndparallel.testing import run_distributed


@pytest.mark.parametrize(
    ("seq", "cp", "tp", "lb", "ok"),
    [
        (128, 1, 1, True, True),
        (128, 2, 2, True, True),  # 4 chunks of 32, 64 tokens per rank split over tp 2
        (10, 2, 1, True, False),  # 10 % 4
        (10, 2, 1, False, True),
        (20, 2, 4, False, False),  # 10 tokens per rank, not divisible by tp 4
        (6, 3, 2, True, True),  # 6 chunks of 1; 2 tokens per rank split over tp 2
        (6, 1, 4, True, False),  # sequence parallel alone
        (16, 4, 2, True, True),  # 8 chunks of 2; 4 tokens per rank split over tp 2
    ],
)
def test_sequence_rule(seq: int, cp: int, tp: int, lb: bool, ok: bool) -> None:
    assert (sequence_problem(seq, cp, tp, lb) is None) == ok
    if not ok:
        with pytest.raises(ConfigError, match="data.seq_len"):
            check_sequence_length(seq, cp, tp, lb, what="data.seq_len")


def test_sequence_multiple_is_the_smallest_valid_length() -> None:
    for cp in (1, 2, 3, 4):
        for tp in (1, 2, 4):
            for lb in (True, False):
                m = sequence_multiple(cp, tp, lb)
                assert sequence_problem(m, cp, tp, lb) is None
                assert all(sequence_problem(s, cp, tp, lb) is not None for s in range(1, m))


def _agree_on_rank() -> list[str]:
    rank = dist.get_rank()
    seen = []
    agree(None, "nothing failed")  # every rank passes
    for error_type, problem in ((ConfigError, "bad input on rank 1"), (CheckpointError, OSError("disk gone"))):
        try:
            agree(problem if rank == 1 else None, "step 3", error_type=error_type)
        except error_type as err:
            seen.append(f"{type(err).__name__}: {err}")
    return seen


def test_agree_raises_the_same_error_on_every_rank() -> None:
    results = run_distributed(_agree_on_rank, world_size=3)
    for seen in results:
        assert seen == [
            "ConfigError: step 3: rank 1 of 3: bad input on rank 1",
            "CheckpointError: step 3: rank 1 of 3: OSError: disk gone",
        ]


def test_agree_without_a_process_group_raises_the_problem_itself() -> None:
    with pytest.raises(ConfigError, match="^what: bad$"):
        agree("bad", "what", error_type=ConfigError)
    agree(None, "what")
