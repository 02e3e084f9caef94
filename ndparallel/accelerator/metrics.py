"""Collectives of the Accelerator for metrics and everyday exchange: ``gather``, ``gather_for_metrics`` (which
drops the samples ``even_batches`` repeated at the end of an evaluation loader), ``reduce``,
``pad_across_processes``, and the breakpoint trigger (``set_trigger`` / ``check_trigger``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ndparallel.accelerator import operations
from ndparallel.errors import ConfigError

__all__ = ["MetricNames"]


def _all_gather(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts)


def _only_tensors(data: Any) -> bool:
    try:
        operations.recursively_apply(lambda t: t, data, error_on_other_type=True)
    except TypeError:
        return False
    return True


class MetricNames:
    """Needs ``self.mesh`` and ``self.gradient_state``."""

    def gather(self, tensor: Any) -> Any:
        """Every process's tensors (nested) concatenated along dim 0, in process order."""
        return operations.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Tensors (nested: tuples, dicts...) of every data rank concatenated in rank order; at the last batch of
        a prepared loader, cut to the samples the dataset really has (``even_batches`` repeated some to fill the
        last round). Ranks of one tensor/context-parallel group hold the same batch: gathered once (over ``dp``).
        Anything else than tensors is gathered as objects (a list per rank, concatenated)."""
        use_gather_object = use_gather_object or not _only_tensors(input_data)
        dp = self.mesh.size("dp")
        if use_gather_object:
            data = input_data
            if dp > 1:
                parts: list[Any] = [None] * dp
                dist.all_gather_object(parts, input_data, group=self.mesh["dp"].get_group())
                data = [item for part in parts for item in part]
        elif dp == 1:
            data = input_data
        else:
            group = self.mesh["dp"].get_group()
            data = operations.recursively_apply(_all_gather, input_data, group, error_on_other_type=True)
        remainder = self.gradient_state.remainder
        if self.gradient_state.end_of_dataloader and remainder > 0:
            if use_gather_object:
                return data[:remainder]
            return operations.recursively_apply(lambda t: t[:remainder], data)
        return data

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Sum or mean of ``tensor`` (nested) over ``dp_cp``: every rank that saw different tokens (all of them
        in data parallel). ``scale`` is Accelerate's XLA-only knob: only 1.0."""
        if scale != 1.0:
            raise ConfigError(
                f"reduce(scale={scale}): Accelerate applies scale on TPUs only; multiply the reduced value yourself"
            )
        if reduction not in ("mean", "sum", "none"):
            raise ConfigError(f"reduction={reduction!r} must be 'mean', 'sum' or 'none'")
        group = self.mesh["dp_cp"].get_group()

        def one(t: torch.Tensor) -> torch.Tensor:
            result = t.detach().clone()
            if reduction != "none":
                dist.all_reduce(result, group=group)
            return result / dist.get_world_size(group) if reduction == "mean" else result

        return operations.recursively_apply(one, tensor, error_on_other_type=True)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """``tensor`` (nested) padded along ``dim`` to the longest over all processes, to gather it."""
        return operations.pad_across_processes(tensor, dim, pad_index, pad_first)

    def set_trigger(self) -> None:
        """Raise this process's flag; ``check_trigger()`` on every process then returns True (once)."""
        self.flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """True on every process if any process called ``set_trigger()`` since the last check (a collective)."""
        flag = getattr(self, "flag_tensor", None)
        flag = torch.tensor(0, device=self.device) if flag is None else flag.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag)
        if flag.item() >= 1:
            self.flag_tensor = torch.tensor(0, device=self.device)
            return True
        return False
