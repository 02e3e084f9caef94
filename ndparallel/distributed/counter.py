"""Count the bytes real collectives move: ``CommCounter``, what the
comm estimate (``ndparallel.estimate``) is checked against and what ``ndparallel bench`` reports.

    with CommCounter() as counter:
        loss = model(tokens).sum(); loss.backward()
    counter.bytes_by("kind")          # {"all_gather": ..., "reduce_scatter": ...}
    counter.bytes_by(("ranks", "kind"))   # keyed by the group's global ranks: a mesh dim's group

It sees both kinds of collectives torch issues: the ``c10d`` ops FSDP2 calls (``_allgather_base_``,
``_reduce_scatter_base_``, ``allreduce_``, ``send``/``recv_`` ...) and the ``_c10d_functional`` ops
DTensor redistributes with. Payload conventions match ``comm.Collective``: an all-gather's output,
a reduce-scatter's input, an all-reduce's tensor, a send's tensor (receives are not counted).

It is a plain dispatch mode, not torch's ``CommDebugMode``: that one's module tracker raises an IndexError
when a region holds several forward/backward passes (a pipeline schedule) or a module whose full backward
hooks fire on outputs only (an FSDP-wrapped Hugging Face model under transformers 5.25, torch 2.13).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ndparallel.distributed.local_ops import LocalOpMode

__all__ = ["CommCounter", "CountedCall"]


@dataclass(frozen=True)
class CountedCall:
    op: str
    kind: str
    group: str
    """Process-group name (``ProcessGroup.group_name``)."""
    group_size: int
    ranks: tuple[int, ...]
    """Global ranks of the group: two groups over the same ranks (e.g. a mesh dim and the same dim of
    a 2-D submesh FSDP builds) are one mesh dimension."""
    payload_bytes: int


def _bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


def _group_by_name(name: str) -> dist.ProcessGroup | None:
    # Functional collectives pass their group by name; torch has no public name -> group lookup.
    # Only the reported size and ranks depend on it (-1 / () if this private helper moves).
    try:
        return dist.distributed_c10d._resolve_process_group(name)
    except Exception:
        return None


def _group(value: Any) -> tuple[str, int, tuple[int, ...]]:
    """(name, size, global ranks) of a ProcessGroup argument, or of a functional collective's group name."""
    if isinstance(value, str):
        name, group = value, _group_by_name(value)
    else:
        if isinstance(value, torch.ScriptObject):  # c10d ops receive the group boxed as a TorchBind object
            value = dist.ProcessGroup.unbox(value)
        name, group = str(value.group_name), value
    if group is None:
        return name, -1, ()
    return name, int(group.size()), tuple(dist.get_process_group_ranks(group))


# op name (without namespace / overload) -> (kind, index of the payload argument, index of the group argument)
_C10D = {
    "_allgather_base_": ("all_gather", 0, 2),
    "allgather_": ("all_gather", 0, 2),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, 2),
    "_reduce_scatter_base_": ("reduce_scatter", 1, 2),
    "reduce_scatter_": ("reduce_scatter", 1, 2),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 2),
    "allreduce_": ("all_reduce", 0, 1),
    "allreduce_coalesced_": ("all_reduce", 0, 1),
    "broadcast_": ("broadcast", 0, 1),
    "send": ("send_recv", 0, 1),
    "alltoall_base_": ("all_to_all", 1, 2),
}
# functional ops: (kind, payload arg, group arg, multiply the payload by the group size)
_FUNCTIONAL = {
    "all_gather_into_tensor": ("all_gather", 0, 2, True),
    "all_gather_into_tensor_coalesced": ("all_gather", 0, 2, True),
    "reduce_scatter_tensor": ("reduce_scatter", 0, 3, False),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, 3, False),
    "all_reduce": ("all_reduce", 0, 2, False),
    "all_reduce_coalesced": ("all_reduce", 0, 2, False),
    "broadcast": ("broadcast", 0, 2, False),
    "all_to_all_single": ("all_to_all", 0, 3, False),
}


class CommCounter(LocalOpMode):
    """Records each collective's kind, payload bytes and process group while it is entered."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[CountedCall] = []

    def local_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        self.record(func, args)  # DTensor's collectives come here on local tensors (LocalOpMode)
        return func(*args, **kwargs)

    def record(self, func: Any, args: tuple) -> None:
        """Count ``func(*args)`` if it is a collective (another mode that sees every local op may call this
        instead of entering the counter: the dry run's tracker, one dispatch layer fewer)."""
        namespace = getattr(func, "namespace", "")
        name = func._schema.name.split("::")[-1] if hasattr(func, "_schema") else str(func)
        if namespace == "c10d" and name in _C10D:
            kind, payload_at, group_at = _C10D[name]
            group, size, ranks = _group(args[group_at])
            payload = _bytes(args[payload_at])
        elif namespace == "_c10d_functional" and name in _FUNCTIONAL:
            kind, payload_at, group_at, gathered = _FUNCTIONAL[name]
            group, size, ranks = _group(args[group_at])
            payload = _bytes(args[payload_at]) * (int(args[1]) if gathered else 1)
        else:
            return
        self.calls.append(CountedCall(name, kind, group, size, ranks, payload))

    def bytes_by(self, key: str = "kind") -> dict[Any, int]:
        """Total payload bytes grouped by ``kind``, ``group``, ``ranks``, ``op`` or a tuple of them."""
        totals: dict[Any, int] = defaultdict(int)
        for call in self.calls:
            label = tuple(getattr(call, k) for k in key) if isinstance(key, tuple) else getattr(call, key)
            totals[label] += call.payload_bytes
        return dict(totals)

    def calls_by(self, key: str = "kind") -> dict[Any, int]:
        """Number of calls grouped like ``bytes_by``."""
        totals: dict[Any, int] = defaultdict(int)
        for call in self.calls:
            label = tuple(getattr(call, k) for k in key) if isinstance(key, tuple) else getattr(call, key)
            totals[label] += 1
        return dict(totals)
