"""The watchdog's verdicts, pure: from every rank's last heartbeat, who kept the others waiting, as one line.

:func:`judge` names a rank whose heartbeat stopped (dead, frozen, or its node lost), a rank still in an
earlier phase, or - all in one phase - a rank that is not in the collective its peers wait in;
:func:`lost_peers` names the ranks (or whole nodes) that went silent under a failed collective. No store, no
thread, no clock of their own: the watchdog (``ndparallel/distributed/watchdog.py``) and ``notebook_launcher``
feed them :class:`~ndparallel.distributed.heartbeat.Beat` s and seconds.
"""

from __future__ import annotations

import torch.distributed as dist

from ndparallel.distributed.heartbeat import Beat

__all__ = [
    "describe",
    "in_phase",
    "judge",
    "judge_at_deadline",
    "lost_peer_symptom",
    "lost_peers",
    "position_phrase",
    "ranks_phrase",
    "silence",
]


def ranks_phrase(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 2, 3``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))


def describe(ranks: list[int], beats: dict[int, Beat]) -> str:
    """``node 1 (ranks 2, 3)`` when the ranks are whole nodes of a multi-node job, else ``ranks 2, 3``."""
    nodes: dict[int, set[int]] = {}
    for beat in beats.values():
        nodes.setdefault(beat.node, set()).add(beat.rank)
    chosen = set(ranks)
    whole = sorted(n for n, members in nodes.items() if members <= chosen)
    if len(nodes) < 2 or not whole:
        return ranks_phrase(ranks)
    covered = set().union(*(nodes[n] for n in whole))
    parts = [f"node {n} ({ranks_phrase(sorted(nodes[n]))}, host {beats[min(nodes[n])].host})" for n in whole]
    rest = sorted(chosen - covered)
    return " and ".join(parts + ([ranks_phrase(rest)] if rest else []))


def position_phrase(beat: Beat) -> str:
    """Where ``beat``'s rank is: ``'phase' in where``, or only where for a script that marks no phases."""
    if not beat.phase:  # a script that marks no phases
        return beat.where or "?"
    return f"'{beat.phase}'" + (f" in {beat.where}" if beat.where else "")


def in_phase(phase: str) -> str:
    """`` in 'phase'``, or nothing when no phase is marked."""
    return f" in '{phase}'" if phase else ""


def judge(beats: dict[int, Beat], silent: dict[int, float], timeout_s: float) -> str | None:
    """Who is behind, from every rank's last heartbeat and how long each has been ``silent``
    (seconds without a new heartbeat); None when nobody is (e.g. every rank is busy computing)."""
    if silent:
        ranks = sorted(silent)
        last = beats.get(ranks[0])
        return f"{describe(ranks, beats)} stopped responding: no heartbeat for {max(silent.values()):.0f}s" + (
            f", last seen at {position_phrase(last)}" if last else ""
        )
    if not beats:
        return None
    front = max(b.seq for b in beats.values())
    ahead = [b for b in beats.values() if b.seq == front]
    behind = [b for b in beats.values() if b.seq < front]
    if min(b.age for b in ahead) < timeout_s:
        return None
    phase = ahead[0].phase
    if behind:
        positions = "; ".join(
            f"{ranks_phrase([b.rank])} is at {position_phrase(b)}" for b in sorted(behind, key=lambda b: b.rank)
        )
        waiting = [b.rank for b in ahead]
        return (
            f"{describe([b.rank for b in behind], beats)} did not arrive at '{phase}' within {timeout_s:.0f}s: "
            f"{positions}; {ranks_phrase(waiting)} {'waits' if len(waiting) == 1 else 'wait'} there"
        )
    waiting = [b for b in ahead if b.collective]
    busy = [b for b in ahead if not b.collective]
    if waiting and busy:
        positions = "; ".join(
            f"{ranks_phrase([b.rank])} is in {b.where or '?'}" for b in sorted(busy, key=lambda b: b.rank)
        )
        ranks = [b.rank for b in waiting]
        calls = sorted({b.collective for b in waiting})
        return (
            f"{describe([b.rank for b in busy], beats)} did not reach the collective{in_phase(phase)} within "
            f"{timeout_s:.0f}s: {positions}; {ranks_phrase(ranks)} {'waits' if len(ranks) == 1 else 'wait'} in "
            f"{', '.join(calls)}"
        )
    if waiting:
        calls = "; ".join(f"{ranks_phrase([b.rank])} in {b.collective} at {b.where or '?'}" for b in waiting)
        return (
            f"every rank has waited {timeout_s:.0f}s in a collective{in_phase(phase)} that no rank completes "
            f"(mismatched collectives?): {calls}"
        )
    return None


def judge_at_deadline(beats: dict[int, Beat], at_least_s: float) -> str | None:
    """:func:`judge` for a launcher whose own time limit ran out: who is behind now, provided the ranks in
    front have been where they are for at least ``at_least_s`` (else they may just be slow)."""
    if not beats:
        return None
    front = max(b.seq for b in beats.values())
    waited = min(b.age for b in beats.values() if b.seq == front)
    return judge(beats, {}, waited) if waited >= at_least_s else None


def silence(
    beats: dict[int, Beat], seen: dict[int, tuple[int, float]], now: float, after: float, me: int
) -> dict[int, float]:
    """Ranks (other than ``me``) whose heartbeat count has not moved for ``after`` seconds of this
    rank's clock; ``seen`` (rank -> (count, when first seen)) carries the history between calls."""
    silent = {}
    for rank, beat in beats.items():
        count, first_seen = seen.get(rank, (None, now))
        if count != beat.count:
            seen[rank] = (beat.count, now)
        elif rank != me and now - first_seen >= after:
            silent[rank] = now - first_seen
    return silent


def lost_peers(silent: dict[int, float], beats: dict[int, Beat], phase: str, first_line: str) -> str:
    """The one line for a collective that failed because the ``silent`` ranks went away: who was lost, where
    they were last seen, and the collective's own first line."""
    last = beats.get(min(silent))  # posted when it entered its last phase: where it was lost
    return (
        f"lost {describe(sorted(silent), beats)}: no heartbeat for {max(silent.values()):.0f}s"
        + (f" (last at {position_phrase(last)})" if last else "")
        + f"; this rank's collective{in_phase(phase)} failed as a consequence: {first_line}"
    )


def lost_peer_symptom(err: BaseException) -> bool:
    """Whether ``err`` may come from a peer that died: a DistError (NCCL, the store), or gloo's plain
    RuntimeError about its connection. Other errors are this rank's own story, told at once."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    return type(err) is RuntimeError and any(s in text for s in ("gloo", "onnection", "ocket", "peer", "imed out"))
