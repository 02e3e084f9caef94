"""Mixture of experts on a mesh: global router statistics over dp/cp, and expert parallelism over ``ep``.

A family declares its MoE modules (``ModelFamily.moe_modules``); each follows the contract of the reference
:class:`ndparallel.models.transformer.moe.MoE` (this planner never imports it):

- a ``reduce_counts`` attribute, the seam for the tokens per expert of the global batch (a family that makes its
  statistics global another way, as the HF family does, has none);
- an ``experts`` submodule whose own parameters are all stacked by expert on dim 0 (the reference's ``w1, w3,
  w2``; an HF model's ``gate_up_proj, down_proj``, adapted by ``ndparallel/models/hf/moe.py``), ``n_experts``,
  ``compute(x, counts, *those parameters in order)`` and a ``dispatcher`` seam.

:func:`apply_router_statistics` (dp x cp > 1): ``reduce_counts`` all-reduces the counts over ``dp_cp``, so the
load-balancing loss uses the token fractions of the global batch, as one process does.

:func:`apply_expert_parallel` (``ep_size > 1``): each expert weight becomes a DTensor sharded on dim 0 over
``mesh["ep"]`` (rank ``r`` owns experts ``[r E/ep, (r+1) E/ep)``; no rank holds another's), and the dispatcher
sends each routed row by all-to-all to the owner of its expert, runs the local experts there and sends the
outputs back, in the router's order. The experts' FSDP (``mesh["ep_fsdp"]``) then shards what each rank owns.

Gradients. An expert's gradient on its owner is the sum of the contributions of all ep ranks (the all-to-all's
backward brings them); one process's gradient is the mean over the dp_shard x cp ranks' local losses. The
local weights' gradient is scaled by ``1 / ep`` here and FSDP averages over ``ep_fsdp``: together ``1 / (dp_shard
x cp)``, the mean every other parameter gets.

Under tp (``hidden_dims``, from the family's :class:`~ndparallel.parallel.moe_tensor_parallel.MoETensorParallel`)
each expert weight is also split over ``tp`` on its hidden width: a DTensor on ``mesh.experts_shard``, ``(ep, tp)``
or ``tp`` alone. The ep ranks of one group share a tp index and the tp ranks route the same tokens, so the
all-to-all and the ``1 / ep`` scaling are unchanged; each rank's expert outputs are then partial sums over tp
(:mod:`ndparallel.parallel.moe_tensor_parallel` reduces them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Shard

from ndparallel.distributed.mesh import Mesh
from ndparallel.errors import ConfigError

__all__ = [
    "ExpertDispatcher",
    "all_to_all",
    "apply_expert_parallel",
    "apply_router_statistics",
    "expert_modules",
    "scale_grad",
]


def expert_weight_names(experts: nn.Module) -> list[str]:
    """The stacked expert weights of an experts module: its own parameters, in registration order."""
    return [name for name, _ in experts.named_parameters(recurse=False)]


def expert_modules(moe_layers: Sequence[nn.Module]) -> list[nn.Module]:
    """The ``experts`` submodule of each MoE module (the experts' own FSDP units under ep)."""
    return [layer.experts for layer in moe_layers]


class _SumOver:
    """``reduce_counts``: the counts summed over a process group (no gradient: counts come from a top-k)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def __call__(self, counts: torch.Tensor) -> torch.Tensor:
        counts = counts.detach().clone()
        dist.all_reduce(counts, group=self.group)
        return counts


def apply_router_statistics(moe_layers: Sequence[nn.Module], mesh: Mesh) -> None:
    """Make every MoE module count its tokens per expert over ``mesh["dp_cp"]`` (the global batch)."""
    if mesh.size("dp_cp") == 1:
        return
    reducer = _SumOver(mesh["dp_cp"].get_group())
    for layer in moe_layers:
        if hasattr(layer, "reduce_counts"):
            layer.reduce_counts = reducer


class _AllToAll(torch.autograd.Function):
    """Rows ``send[i]`` to rank ``i`` and ``recv[i]`` from it; the gradient goes back the inverse way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable uneven all-to-all of the rows of ``x`` (``send[i]`` rows to rank ``i``, ``recv[i]`` from it)."""
    return _AllToAll.apply(x, send, recv, group)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` unchanged, its gradient multiplied by ``scale`` on the way back."""
    return x if scale == 1 else _ScaleGrad.apply(x, scale)


class ExpertDispatcher:
    """The ``dispatcher`` of an experts module whose weights are DTensors: with ep > 1 all-to-all out, the local
    experts, all-to-all back; with ep 1 (tp alone splits the weights) the experts run here on the local shards."""

    def __init__(self, group: dist.ProcessGroup | None, ep: int, n_experts: int):
        self.group, self.ep, self.local = group, ep, n_experts // ep

    def _local_weights(self, experts: nn.Module) -> list[torch.Tensor]:
        """This rank's block of every expert weight; the owner's gradient sums all ep ranks' rows: ``1 / ep``."""
        return [scale_grad(getattr(experts, name).to_local(), 1.0 / self.ep) for name in expert_weight_names(experts)]

    def __call__(self, experts: nn.Module, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ep, local = self.ep, self.local
        if ep == 1:
            return experts.compute(x, counts, *self._local_weights(experts))
        sent = torch.tensor(counts, dtype=torch.int64, device=x.device).view(ep, local)  # [owner, its expert]
        received = torch.empty_like(sent)  # [source rank, my expert]
        dist.all_to_all_single(received, sent, group=self.group)
        send_rows, recv_rows = sent.sum(1).tolist(), received.sum(1).tolist()
        rows = all_to_all(x, send_rows, recv_rows, self.group)  # grouped by source, then by expert
        order, inverse = _expert_major_order(received, sum(recv_rows))
        out = experts.compute(
            permute_rows(rows, order, inverse), received.sum(0).tolist(), *self._local_weights(experts)
        )
        return all_to_all(permute_rows(out, inverse, order), recv_rows, send_rows, self.group)


def _expert_major_order(received: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The row order that regroups ``rows`` rows laid out by source rank, then expert (``received[s, e]`` rows
    each) by expert, then source rank; and its inverse. A few ops on the rows' device, no host sync: one gather
    each way instead of a split and a concatenation of ``ep x local`` pieces (whose autograd nodes cost a dry run
    most of its time)."""
    ep, local = received.shape
    chunk = torch.repeat_interleave(
        torch.arange(ep * local, device=received.device), received.flatten(), output_size=rows
    )
    key = (chunk % local) * ep + chunk.div(local, rounding_mode="floor")
    order = torch.argsort(key, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(rows, device=order.device))
    return order, inverse


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``x[order]``, whose gradient is the gather by ``inverse`` (exact, no accumulation: a permutation)."""
    return _PermuteRows.apply(x, order, inverse)


def _expert_placements(ep: int, tp: int, hidden_dim: int | None) -> list[Placement]:
    """Expert on dim 0 over ep, then (tp > 1) the hidden width over tp: the order of ``Mesh.experts_shard``."""
    placements: list[Placement] = []
    if ep > 1:
        placements.append(Shard(0))
    if tp > 1:
        placements.append(Shard(hidden_dim))
    return placements


def _local_block(full: torch.Tensor, placements: Sequence[Shard], coordinate: Sequence[int], shape) -> torch.Tensor:
    """This rank's block of ``full`` (identical on every rank, or meta) for ``placements`` on a mesh of ``shape``."""
    block = full.detach()
    for placement, index, size in zip(placements, coordinate, shape, strict=True):
        block = block.chunk(size, dim=placement.dim)[index]
    return block.clone(memory_format=torch.contiguous_format)  # a size-1 dim would keep a strided view


def apply_expert_parallel(
    moe_layers: Sequence[nn.Module], mesh: Mesh, hidden_dims: Mapping[str, int] | None = None
) -> None:
    """Shard every MoE module's experts over ``mesh["ep"]`` (dim 0) and route its tokens by all-to-all; under
    tp also split each expert weight on its hidden dim ``hidden_dims[name]`` over ``mesh["tp"]``."""
    ep, tp = mesh.size("ep"), mesh.size("tp")
    if (ep == 1 and tp == 1) or not moe_layers:
        return
    if tp > 1 and hidden_dims is None:
        raise ConfigError(f"tp_size={tp} on a mixture of experts needs the experts' hidden dims (MoETensorParallel)")
    shard_mesh = mesh.experts_shard
    coordinate = [shard_mesh.get_local_rank(d) for d in range(shard_mesh.ndim)]
    group = mesh["ep"].get_group() if ep > 1 else None
    for layer in moe_layers:
        experts = layer.experts
        n_experts = experts.n_experts
        if n_experts % ep:
            raise ConfigError(f"ep_size={ep} does not divide the {n_experts} experts of {type(layer).__name__}")
        for name in expert_weight_names(experts):
            full = getattr(experts, name)  # on meta too: the values come later (init_weights, a loader)
            placements = _expert_placements(ep, tp, hidden_dims[name] if tp > 1 else None)
            shard = _local_block(full, placements, coordinate, shard_mesh.shape)
            dtensor = DTensor.from_local(shard, shard_mesh, placements, run_check=False)
            setattr(experts, name, nn.Parameter(dtensor, requires_grad=full.requires_grad))
        experts.dispatcher = ExpertDispatcher(group, ep, n_experts)
