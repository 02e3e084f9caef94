"""Weights tied across pipeline stages (a Hugging Face embedding and its ``lm_head``): one weight, two copies.

In one process a tied weight is one tensor whose gradient sums both uses. Under pp the first stage holds the
embedding's copy and the last stage the head's (a stage module lists its copies in ``tied_weights``: local
FQN -> the weight's one-process FQN). The copies start equal (the stage's init), get the summed gradient after
every step (:func:`sum_tied_grads`: the two pp ranks swap their local sums, so both add the same two numbers),
and step alike; the clipping norm counts one of them (the others are marked
:func:`ndparallel.parallel.clip.mark_counted_elsewhere`). docs/pipeline-parallel.md#tied-word-embeddings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ndparallel.distributed.buckets import local_tensor
from ndparallel.errors import ConfigError
from ndparallel.parallel.clip import mark_counted_elsewhere

__all__ = ["TiedCopies", "copy_names", "one_process_parameters", "tied_copies", "sum_tied_grads"]

_MAX_DIMS = 8  # a tied weight's dimensions, at most (the shape check's fixed row)


@dataclass
class TiedCopies:
    """This rank's copies of each weight tied across stages (by one-process FQN), the pp rank holding the
    other copies (``None``: this rank holds them all), every tied weight's name (the same on every pp rank,
    holder or not) and this rank's device."""

    params: dict[str, list[nn.Parameter]] = field(default_factory=dict)
    peer: int | None = None
    names: list[str] = field(default_factory=list)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def _tied_names(stage: nn.Module | None) -> dict[str, str]:
    return dict(getattr(stage, "tied_weights", {}) or {})


def copy_names(module: nn.Module) -> dict[str, str]:
    """``module``'s copies of a tied weight held under another name than the weight's: local FQN -> the
    weight's one-process FQN (a checkpoint stores their optimizer state once, under the weight's name)."""
    return {local: one for local, one in _tied_names(module).items() if local != one}


def one_process_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``module.named_parameters()`` under their one-process names: a tied weight's copy under the weight's
    (what a one-process model's parameters are compared with)."""
    copies = copy_names(module)
    return [(copies.get(name, name), param) for name, param in module.named_parameters()]


def tied_copies(
    first_part: nn.Module,
    last_part: nn.Module,
    stages: Sequence[nn.Module],
    pp_group: dist.ProcessGroup,
    last_rank: int,
) -> TiedCopies:
    """The tied copies of this rank's (parallelised) ``stages``. ``first_part`` / ``last_part``: the first and
    the last stage without blocks (what a stage holds besides its blocks), which say what is tied; only they
    may hold tied copies (the embedding and the head), held by pp ranks 0 and ``last_rank``."""
    first, last = set(_tied_names(first_part).values()), set(_tied_names(last_part).values())
    if first != last:
        raise ConfigError(
            f"weights tied across pipeline stages must have a copy on the first and on the last stage: "
            f"the first holds {sorted(first)}, the last {sorted(last)}; untie them or use pp_size=1"
        )
    copies, pp_rank = TiedCopies(names=sorted(first)), dist.get_rank(pp_group)
    copies.device = next((p.device for stage in stages for p in stage.parameters()), copies.device)
    if first and last_rank != 0 and pp_rank in (0, last_rank):  # loop placement; V placement holds both on pp rank 0
        copies.peer = last_rank if pp_rank == 0 else 0
    for stage in stages:
        for local, one_process in _tied_names(stage).items():
            param = stage.get_parameter(local)
            copies.params.setdefault(one_process, []).append(param)
            if local != one_process:
                mark_counted_elsewhere(param)
    _check_alike(copies, pp_group)
    return copies


def _swap(mine: torch.Tensor, peer: int, pp_group: dist.ProcessGroup) -> torch.Tensor:
    """Send ``mine`` to pp rank ``peer`` and receive its tensor of the same shape."""
    theirs = torch.empty_like(mine)
    ops = [
        dist.P2POp(dist.isend, mine, group=pp_group, group_peer=peer),
        dist.P2POp(dist.irecv, theirs, group=pp_group, group_peer=peer),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return theirs


def _check_alike(copies: TiedCopies, pp_group: dist.ProcessGroup) -> None:
    """Refuse (on both ranks) copies whose local shards differ in shape from the peer's: their gradients
    could not be added region by region."""
    if copies.peer is None:
        return
    shapes = [list(local_tensor(p).shape) for _, params in sorted(copies.params.items()) for p in params[:1]]
    mine = torch.full((len(shapes), _MAX_DIMS), -1, dtype=torch.int64)
    for row, shape in zip(mine, shapes, strict=True):
        row[: len(shape)] = torch.tensor(shape)
    theirs = _swap(mine.to(copies.device), copies.peer, pp_group).cpu()
    if not torch.equal(mine, theirs):
        raise ConfigError(
            f"weights tied across pipeline stages ({sorted(copies.params)}) are split differently on the first and "
            f"the last stage (local shapes {mine.tolist()} vs {theirs.tolist()}): shard both alike, untie them "
            "(config.tie_word_embeddings=False) or use pp_size=1"
        )


@torch.no_grad()
def sum_tied_grads(copies: TiedCopies, pp_group: dist.ProcessGroup) -> None:
    """Give every copy of each tied weight the sum of all copies' gradients (every local copy's on this rank,
    plus the peer's); a frozen weight is left alone. Copies are placed alike (the embedding's and the head's
    weight are both split on the vocabulary), so their local shards are the same region. Copies frozen
    differently (one ``requires_grad=False``) are refused on both ranks: one process has one flag."""
    _check_frozen_alike(copies, pp_group)
    for name, params in sorted(copies.params.items()):
        unique = list({id(p): p for p in params}.values())  # one Parameter held by two stages counts once
        if not unique[0].requires_grad:
            continue
        grads = [p.grad for p in unique]
        if any(g is None for g in grads):
            raise RuntimeError(f"tied weight {name}: a copy has no gradient after the pipeline step")
        total = local_tensor(grads[0]).clone()
        for grad in grads[1:]:
            total += local_tensor(grad)
        if copies.peer is not None:
            total = total + _swap(total, copies.peer, pp_group)  # a + b here, b + a there: the same number
        for grad in grads:
            local_tensor(grad).copy_(total)


def _check_frozen_alike(copies: TiedCopies, pp_group: dist.ProcessGroup) -> None:
    """Refuse (ConfigError, on every pp rank, before any gradient is swapped) a tied weight whose copies do
    not all share one ``requires_grad``: frozen by one of its names, the copies would step apart (or the
    ranks would wait on each other's swap forever). One all-reduce over pp, every rank joining."""
    if not copies.names:
        return
    # per weight: does some copy train, is some copy frozen (a rank holding none adds 0, 0)
    flags = torch.zeros((len(copies.names), 2), dtype=torch.int64)
    for row, name in zip(flags, copies.names, strict=True):
        for param in copies.params.get(name, []):
            row[0 if param.requires_grad else 1] = 1
    flags = flags.to(copies.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=pp_group)
    bad = [name for name, row in zip(copies.names, flags.cpu().tolist(), strict=True) if row == [1, 1]]
    if bad:
        raise ConfigError(
            f"weights tied across pipeline stages {bad} are frozen on one copy only (requires_grad differs "
            "between the embedding's and the head's): one process holds one tensor with one flag; set "
            "requires_grad alike on every copy (the embedding's and the head's) or untie them"
        )
