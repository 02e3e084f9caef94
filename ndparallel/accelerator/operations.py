"""Accelerate's collective helpers (``accelerate.utils.operations``) over every process, on nested data (tensors
inside tuples, lists, namedtuples and dicts, at any depth). In one process (or without a process group) they
return their input, as Accelerate's do."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ndparallel.accelerator.data import to_device
from ndparallel.errors import ConfigError

__all__ = [
    "broadcast",
    "broadcast_object_list",
    "concatenate",
    "convert_to_fp32",
    "find_batch_size",
    "gather",
    "gather_object",
    "is_namedtuple",
    "pad_across_processes",
    "recursively_apply",
    "reduce",
    "send_to_device",
    "slice_tensors",
]


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _rebuilt(sequence: Any, items: list) -> Any:
    return type(sequence)(*items) if is_namedtuple(sequence) else type(sequence)(items)


def recursively_apply(
    func: Callable, data: Any, *args: Any, test_type: Callable = torch.is_tensor, error_on_other_type=False, **kw
) -> Any:
    """``func`` applied to every leaf ``test_type`` accepts inside ``data``; other leaves are kept (or refused)."""

    def again(item: Any) -> Any:
        return recursively_apply(func, item, *args, test_type=test_type, error_on_other_type=error_on_other_type, **kw)

    if isinstance(data, (tuple, list)):
        return _rebuilt(data, [again(d) for d in data])
    if isinstance(data, Mapping):
        return type(data)({k: again(v) for k, v in data.items()})
    if test_type(data):
        return func(data, *args, **kw)
    if error_on_other_type:
        raise TypeError(
            f"Unsupported types ({type(data)}) passed to `{getattr(func, '__name__', func)}`. Only nested "
            "list/tuple/dicts of objects that are valid for `is_torch_tensor` should be passed."
        )
    return data


def send_to_device(tensor: Any, device: torch.device | str, non_blocking: bool = False, skip_keys=None) -> Any:
    """``tensor`` (nested) on ``device``."""
    return to_device(tensor, torch.device(device), non_blocking)


def _gather_one(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    return torch.cat(parts)


def gather(tensor: Any) -> Any:
    """Every process's tensors concatenated along dim 0, in process order (0-dim tensors: one element each)."""
    if _world() == 1:
        return tensor
    return recursively_apply(_gather_one, tensor, error_on_other_type=True)


def gather_object(obj: Any) -> Any:
    """Every process's list concatenated, in process order (pickled through the process group)."""
    if _world() == 1:
        return obj
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return [item for part in parts for item in part]


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """``tensor`` (nested) replaced in place by process ``from_process``'s values; returns it."""
    if _world() == 1:
        return tensor

    def one(t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=from_process)
        return t

    return recursively_apply(one, tensor, error_on_other_type=True)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """``object_list`` replaced in place by process ``from_process``'s objects; returns it."""
    if _world() > 1:
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """``tensor`` (nested) padded with ``pad_index`` along ``dim`` to the longest over all processes."""

    def one(t: torch.Tensor) -> torch.Tensor:
        if dim >= t.dim() or dim < -t.dim():
            return t
        size = torch.tensor([t.shape[dim]], device=t.device)
        if _world() > 1:
            dist.all_reduce(size, op=dist.ReduceOp.MAX)
        longest = int(size.item())
        if longest == t.shape[dim]:
            return t
        shape = list(t.shape)
        shape[dim] = longest
        out = t.new_zeros(shape) + pad_index
        index = [slice(None)] * t.dim()
        index[dim] = slice(longest - t.shape[dim], longest) if pad_first else slice(0, t.shape[dim])
        out[tuple(index)] = t
        return out

    return recursively_apply(one, tensor, error_on_other_type=True)


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Sum (``"sum"``), mean (``"mean"``) or nothing (``"none"``) of ``tensor * scale`` over every process."""
    if reduction not in ("mean", "sum", "none"):
        raise ConfigError(f"reduce(reduction={reduction!r}) must be 'mean', 'sum' or 'none'")

    def one(t: torch.Tensor) -> torch.Tensor:
        result = t.clone() * scale
        if _world() > 1 and reduction != "none":
            dist.all_reduce(result)
        return result / _world() if reduction == "mean" else result

    return recursively_apply(one, tensor, error_on_other_type=True)


def concatenate(data: list[Any], dim: int = 0) -> Any:
    """A list of (nested) structures of tensors concatenated leaf by leaf."""
    first = data[0]
    if isinstance(first, (tuple, list)):
        return _rebuilt(first, [concatenate([d[i] for d in data], dim) for i in range(len(first))])
    if isinstance(first, Mapping):
        return type(first)({k: concatenate([d[k] for d in data], dim) for k in first})
    if not torch.is_tensor(first):
        raise TypeError(f"Can only concatenate tensors but got {type(first)}")
    return torch.cat(data, dim=dim)


def slice_tensors(data: Any, tensor_slice: slice, process_index=None, num_processes=None) -> Any:
    return recursively_apply(lambda t: t[tensor_slice], data)


def find_batch_size(data: Any) -> int:
    """The size of dim 0 of the first tensor inside ``data``."""
    if isinstance(data, (tuple, list)) and data:
        return find_batch_size(data[0])
    if isinstance(data, Mapping) and data:
        return find_batch_size(next(iter(data.values())))
    if torch.is_tensor(data):
        return data.shape[0]
    raise TypeError(f"Can only find the batch size of tensors but got {type(data)}.")


def convert_to_fp32(tensor: Any) -> Any:
    """Half-precision floating tensors inside ``tensor`` as fp32."""
    return recursively_apply(
        lambda t: t.float(),
        tensor,
        test_type=lambda t: torch.is_tensor(t) and t.dtype in (torch.float16, torch.bfloat16),
    )
