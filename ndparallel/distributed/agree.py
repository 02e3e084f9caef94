"""Cross-rank agreement: one rank's failure becomes the same error on every rank; text over tensors.

The one home of the rule "a rank-local failure must fail every rank". Code that does rank-local
checks between collectives (a file one node cannot see, one rank's bad input, a bad argument on
one rank) calls :func:`agree`, which turns a failure on any rank into the same error on every
rank before anyone reaches the next collective, instead of a hang until the process-group
timeout. Strings travel as UTF-8 bytes in
tensors (:func:`broadcast_text`, :func:`gather_text`), numbers as tensors (:func:`gather_vectors`): nothing is
pickled. Without a process
group every function is its single-process identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ndparallel.errors import CheckpointError, ConfigError

__all__ = [
    "agree",
    "broadcast_text",
    "distributed",
    "failed_ranks",
    "gather_text",
    "gather_vectors",
    "rank",
    "world_size",
]


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def _device() -> torch.device:
    # NCCL moves only CUDA tensors; gloo (and the rest) take CPU tensors.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_text(text: str, src: int = 0) -> str:
    """Rank ``src``'s ``text`` on every rank, sent as UTF-8 bytes in a tensor (nothing is pickled)."""
    if not distributed() or dist.get_world_size() == 1:
        return text
    data = text.encode() if dist.get_rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=_device())
    dist.broadcast(size, src=src)
    n = int(size.item())
    if n == 0:
        return ""
    if dist.get_rank() == src:
        buf = torch.tensor(list(data), dtype=torch.uint8, device=_device())
    else:
        buf = torch.empty(n, dtype=torch.uint8, device=_device())
    dist.broadcast(buf, src=src)
    return bytes(buf.cpu().tolist()).decode()


def gather_text(text: str, group: dist.ProcessGroup | None = None) -> list[str]:
    """Every rank's ``text`` (of ``group``, default the world), on every rank of it, in group-rank order, as
    UTF-8 bytes in tensors (nothing is pickled)."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8)
    return [bytes(part.tolist()).decode() for part in gather_vectors(data, group)]


def gather_vectors(vector: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Every rank's 1-D ``vector`` (of ``group``, default the world; lengths may differ), on every rank of it, in
    group-rank order, as CPU tensors: two all-gathers (the lengths, then the vectors padded to the longest)."""
    vector = vector.detach().reshape(-1).cpu()
    if not distributed() or dist.get_world_size(group) == 1:
        return [vector]
    sizes = [torch.zeros(1, dtype=torch.int64, device=_device()) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([vector.numel()], dtype=torch.int64, device=_device()), group=group)
    lengths = [int(size.item()) for size in sizes]
    buf = torch.zeros(max(max(lengths), 1), dtype=vector.dtype, device=_device())
    buf[: vector.numel()] = vector
    bufs = [torch.empty_like(buf) for _ in lengths]
    dist.all_gather(bufs, buf, group=group)
    return [b[:n].cpu() for b, n in zip(bufs, lengths, strict=True)]


def failed_ranks(failed: bool) -> list[int]:
    """Collective: the ranks on which ``failed`` is true (one all_reduce of a one-hot vector)."""
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=_device())
    flags[dist.get_rank()] = int(failed)
    dist.all_reduce(flags)
    return [r for r, flag in enumerate(flags.tolist()) if flag]


def _reason(error: BaseException | str) -> str:
    if isinstance(error, str):
        text = error
    else:
        text = str(error) if isinstance(error, (CheckpointError, ConfigError)) else f"{type(error).__name__}: {error}"
    return text if len(text) <= 4000 else text[:4000] + "..."


def agree(error: BaseException | str | None, what: str, error_type: type[Exception] = CheckpointError) -> None:
    """Collective: if any rank has an ``error``, every rank raises, before any rank reaches the next collective.

    ``error`` is this rank's problem: an exception, a message, or None. A rank-local failure (a
    file one node cannot see, one reader's corrupt view, a bad argument on one rank) must not leave
    the other ranks waiting in a collective until the process-group timeout. Every rank raises the
    same ``error_type``, naming the first failing rank and its reason (on that rank chained from
    ``error``). Costs one all-reduce of a flag vector when nothing failed; nothing is pickled.
    Without a process group, ``error`` itself is raised (a message as ``error_type``).
    """
    if not distributed() or dist.get_world_size() == 1:
        if isinstance(error, str):
            raise error_type(f"{what}: {error}" if what else error)
        if error is not None:
            raise error
        return
    failed = failed_ranks(error is not None)
    if not failed:
        return
    src = failed[0]
    reason = broadcast_text(_reason(error) if dist.get_rank() == src else "", src)
    others = f" (ranks {failed[1:]} failed too)" if len(failed) > 1 else ""
    prefix = f"{what}: " if what else ""
    cause = error if isinstance(error, BaseException) else None
    raise error_type(f"{prefix}rank {src} of {dist.get_world_size()}: {reason}{others}") from cause
