"""The hang watchdog's verdicts, from heartbeats (pure), and its heartbeats on real ranks.

The end-to-end cases (a real hang under ``ndparallel train``, a lost node) are in
tests/train/test_job_faults.py; here each rule of :func:`judge` is pinned down on hand-made heartbeats.
"""

from __future__ import annotations

import time

import pytest

from ndparallel.distributed.heartbeat import Beat
from ndparallel.distributed.timeouts import heartbeat_interval, process_group_timeout, silent_after
from ndparallel.distributed.verdict import describe, judge
from ndparallel.testing import run_distributed


def _beat(rank: int, seq: int, phase: str, age: float, collective: str = "", node: int = 0, where: str = "f (a.py:1)"):
    return Beat(rank, node, f"host{node}", seq, phase, age, 7, where, collective)


def test_nobody_is_blamed_before_the_timeout_or_while_everyone_computes():
    beats = {0: _beat(0, 5, "step 2: forward/backward", 30.0), 1: _beat(1, 5, "step 2: forward/backward", 30.0)}
    assert judge(beats, {}, timeout_s=10) is None, "all busy computing: slow, not hung"
    waiting = {0: _beat(0, 6, "step 2: clip", 9.0, "all_reduce"), 1: _beat(1, 5, "step 2: forward/backward", 9.5)}
    assert judge(waiting, {}, timeout_s=10) is None, "rank 0 has waited less than the timeout"


def test_a_rank_in_an_earlier_phase_is_named_with_where_it_is():
    beats = {
        0: _beat(0, 6, "step 2: gradient clipping", 12.0, "all_reduce"),
        1: _beat(1, 5, "step 2: forward/backward", 13.0, where="sleep (job.py:9)"),
        2: _beat(2, 6, "step 2: gradient clipping", 11.0, "all_reduce"),
    }
    verdict = judge(beats, {}, timeout_s=10)
    assert verdict == (
        "rank 1 did not arrive at 'step 2: gradient clipping' within 10s: rank 1 is at "
        "'step 2: forward/backward' in sleep (job.py:9); ranks 0, 2 wait there"
    )


def test_within_one_phase_the_rank_outside_the_collective_is_named():
    beats = {
        0: _beat(0, 3, "opening train.metrics_file", 12.0, where="_open_metrics_file (train/loop.py:145)"),
        1: _beat(1, 3, "opening train.metrics_file", 12.0, "all_reduce"),
    }
    verdict = judge(beats, {}, timeout_s=10)
    assert verdict.startswith("rank 0 did not reach the collective in 'opening train.metrics_file' within 10s")
    assert verdict.endswith("rank 1 waits in all_reduce")
    everyone = {r: _beat(r, 3, "step 1: checkpoint save", 12.0, "broadcast" if r else "all_reduce") for r in (0, 1)}
    assert "mismatched collectives" in judge(everyone, {}, timeout_s=10)


def test_silent_ranks_are_named_first_and_whole_nodes_by_node():
    beats = {r: _beat(r, 9, "step 4: forward/backward", 20.0, "all_gather", node=r // 2) for r in range(4)}
    verdict = judge(beats, {2: 6.1, 3: 6.0}, timeout_s=10)
    assert verdict.startswith("node 1 (ranks 2, 3, host host1) stopped responding: no heartbeat for 6s")
    assert describe([1], beats) == "rank 1"
    assert describe([1, 2, 3], beats) == "node 1 (ranks 2, 3, host host1) and rank 1"
    one_node = {r: _beat(r, 1, "x", 1.0) for r in range(2)}
    assert describe([0, 1], one_node) == "ranks 0, 1", "a single-node job has no node to name"


def test_timeouts_leave_the_watchdog_time_to_speak_first():
    assert heartbeat_interval(600) == 2.0 and heartbeat_interval(1) == 0.2
    assert silent_after(4) == 3.0 and silent_after(600) == 6.0  # 3 intervals, never under the floor of 3 s
    for timeout in (1, 4, 20, 600, 3600):
        assert process_group_timeout(timeout) >= timeout + silent_after(timeout) + 3 * heartbeat_interval(timeout) + 10


def _heartbeats_on_two_ranks() -> list:
    import time

    import torch.distributed as dist

    from ndparallel.distributed.watchdog import Watchdog

    watchdog = Watchdog.for_job(timeout_s=4)  # a heartbeat every 0.2 s
    watchdog.phase("step 1: forward/backward")
    beats = None
    if dist.get_rank() == 0:
        time.sleep(1.5)  # meanwhile rank 1 blocks in the barrier, and says so in its heartbeats
        beats = watchdog._read_beats()  # noqa: SLF001
    dist.barrier()
    watchdog.stop()
    return beats and [vars(beats[r]) for r in sorted(beats)]


def test_heartbeats_travel_through_the_job_store_on_real_ranks():
    beats = run_distributed(_heartbeats_on_two_ranks, 2, timeout=120)[0]
    assert [b["rank"] for b in beats] == [0, 1]
    assert all(b["phase"] == "step 1: forward/backward" and b["seq"] == 1 and b["count"] >= 3 for b in beats)
    assert beats[0]["collective"] == "" and "_heartbeats_on_two_ranks" in beats[0]["where"]
    assert beats[1]["collective"] == "barrier" and "_heartbeats_on_two_ranks" in beats[1]["where"]


def _a_hung_rank_slow_to_read_the_verdict(folder: str) -> None:
    """Rank 0 waits in a barrier that rank 1 never enters; rank 1's watchdog thread, as on a loaded machine,
    takes 3 s between finding the verdict in the store and printing it. Each rank's stderr goes to
    ``folder/rank-R.err`` (the ranks come from a forkserver that pytest's capture cannot reach)."""
    import os
    import time

    import torch.distributed as dist

    from ndparallel.distributed.watchdog import Watchdog

    with open(f"{folder}/rank-{dist.get_rank()}.err", "w") as err:
        os.dup2(err.fileno(), 2)
    watchdog = Watchdog.for_job(timeout_s=2)
    if dist.get_rank() == 1:
        read_verdict = watchdog._end_if_judged  # noqa: SLF001

        def starved() -> None:
            if watchdog.store.check(["verdict"]):
                time.sleep(3)
            read_verdict()

        watchdog._end_if_judged = starved  # noqa: SLF001
        time.sleep(3600)  # behind: never enters the barrier
    dist.barrier()


def test_the_rank_that_judges_waits_until_every_rank_printed_the_verdict(tmp_path):
    # Without the wait, rank 0 exits at its verdict, the launcher kills rank 1 (as torchrun SIGTERMs it),
    # and the hung rank never says why the job ended.

    from ndparallel.testing import DistributedError

    started = time.monotonic()
    with pytest.raises(DistributedError, match="exited with code 124"):
        run_distributed(_a_hung_rank_slow_to_read_the_verdict, 2, str(tmp_path), timeout=120)
    for rank in (0, 1):
        err = (tmp_path / f"rank-{rank}.err").read_text()
        assert err.startswith("ndparallel: error: the job hung: rank 1 did not reach the collective within 2s"), err
    assert time.monotonic() - started < 90


def _a_rank_behind_whose_heartbeats_stall(folder: str) -> None:
    """Rank 1 stays in step 1 while rank 0 waits in step 2's barrier (timeout 4 s, a heartbeat every 0.2 s);
    rank 1's watchdog thread, as on a loaded machine, posts nothing from 2 s to 4.8 s: across rank 0's verdict."""
    import os
    import time

    import torch.distributed as dist

    from ndparallel.distributed.watchdog import Watchdog

    with open(f"{folder}/rank-{dist.get_rank()}.err", "w") as err:
        os.dup2(err.fileno(), 2)
    watchdog = Watchdog.for_job(timeout_s=4)
    watchdog.phase("step 1: forward/backward")
    if dist.get_rank() == 1:
        post, started, stalled = watchdog._post, time.monotonic(), []  # noqa: SLF001

        def starved() -> None:
            if not stalled and time.monotonic() - started > 2.0:
                stalled.append(True)
                time.sleep(2.8)
            post()

        watchdog._post = starved  # noqa: SLF001
        time.sleep(3600)  # behind: never reaches step 2
    watchdog.phase("step 2: forward/backward")
    dist.barrier()


def test_a_live_rank_whose_heartbeats_stall_is_behind_not_lost(tmp_path):
    # A full-suite run at --timeout 4 (heartbeats 0.2 s apart) blamed a live rank as "stopped responding" after 0.6 s
    # without a heartbeat: its watchdog thread had been starved of CPU. Silence now needs at least 3 s.
    from ndparallel.testing import DistributedError

    with pytest.raises(DistributedError, match="exited with code 124"):
        run_distributed(_a_rank_behind_whose_heartbeats_stall, 2, str(tmp_path), timeout=120)
    err = (tmp_path / "rank-0.err").read_text()
    assert "the job hung: rank 1 did not arrive at 'step 2: forward/backward' within 4s" in err, err
    assert "stopped responding" not in err, err


def test_a_late_launcher_forward_of_the_same_stop_is_not_a_second_stop(monkeypatch):
    """Under torchrun a rank gets one stop twice (its own signal and the launcher's forward, seconds apart on a
    loaded machine): that repeat is absorbed whenever it comes; a third signal stops at once. Alone (no
    launcher), a repeat after the window is a deliberate second Ctrl-C."""
    import signal

    from ndparallel.train import loop

    def stops_at_once(stop) -> bool:  # a KeyboardInterrupt escaping would end the pytest session
        try:
            stop._handle(signal.SIGTERM, None)
        except KeyboardInterrupt:
            return True
        return False

    clock = [100.0]
    monkeypatch.setattr(loop.time, "monotonic", lambda: clock[0])
    for launched in (True, False):
        if launched:
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
        else:
            monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        stop = loop._StopRequest()
        try:
            assert not stops_at_once(stop) and stop.local
            clock[0] += 10 * loop._REPEAT_WINDOW_S  # the forward, late
            if launched:
                assert not stops_at_once(stop), "the launcher's late forward stopped the rank before its save"
                clock[0] += 10 * loop._REPEAT_WINDOW_S
            assert stops_at_once(stop), launched
        finally:
            stop.restore()


def test_a_launcher_forward_arriving_after_train_returns_is_swallowed_once(monkeypatch):
    """train() stopped by a signal can return before the launcher's forward of it arrives (a loaded machine): the
    previous handler would then raise KeyboardInterrupt in the interpreter's shutdown (seen: a traceback in a
    SIGINT-to-every-process run). restore() swallows that one forward, then puts the previous handlers back."""
    import signal

    from ndparallel.train import loop

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    previous = signal.getsignal(signal.SIGINT)
    stop = loop._StopRequest()
    stop._handle(signal.SIGINT, None)  # the rank's own signal: the stop
    stop.restore()  # train() returns; the forward has not come yet
    late = signal.getsignal(signal.SIGINT)
    assert late is not previous
    late(signal.SIGINT, None)  # the forward: no KeyboardInterrupt
    assert signal.getsignal(signal.SIGINT) is previous and signal.getsignal(signal.SIGTERM) is not late
    # a forward that never came: a signal long after is the user's again, delivered to the previous handler
    stop = loop._StopRequest()
    stop._handle(signal.SIGINT, None)
    stop.restore()
    stop._first -= 2 * loop._FORWARD_WAIT_S
    delivered = []
    monkeypatch.setattr(loop.signal, "raise_signal", delivered.append)  # no real signal inside a pytest worker
    signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
    assert delivered == [signal.SIGINT] and signal.getsignal(signal.SIGINT) is previous


def test_the_verdict_is_one_write_so_ranks_sharing_stderr_never_glue_lines(monkeypatch):
    """Every rank of a hung job prints its verdict into one shared stderr pipe: text and newline in one write,
    or two ranks' verdicts come out as one line (seen in a loaded full run: 2 verdict lines of 3)."""
    import sys

    from ndparallel.distributed import watchdog

    writes: list[str] = []

    class Recorder:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    class Exited(Exception):
        pass

    def no_exit(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(sys, "stderr", Recorder())
    monkeypatch.setattr(watchdog.os, "_exit", no_exit)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    try:
        watchdog.Watchdog._exit(124, "the job hung: rank 1 did not reach the collective within 4s")
    except Exited:
        pass
    assert writes == ["ndparallel: error: the job hung: rank 1 did not reach the collective within 4s\n"], writes
