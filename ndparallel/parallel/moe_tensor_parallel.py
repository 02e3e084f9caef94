"""Tensor parallel inside a mixture-of-experts block: the experts' hidden width split over tp, as Megatron does.

The dense feed-forward's table (``ColwiseParallel`` w1/w3, ``RowwiseParallel`` w2) cannot describe an MoE block:
its top-k, sort by expert and all-to-all run on plain tensors. So the block runs on local tensors between two
boundaries, and its family says which weight splits how (:class:`MoETensorParallel`):

- **in**: the sequence-sharded input (``Shard(1)`` from the SequenceParallel norm) is all-gathered, so every tp
  rank routes the same tokens (and its ep group, inside one tp index, exchanges the same rows);
- **inside**: every stacked expert weight is split over tp on its hidden width (``w1``/``w3`` rows, ``w2``
  columns: :func:`ndparallel.parallel.expert_parallel.apply_expert_parallel`), the shared experts' Linear layers
  column- and row-wise, so each rank holds a partial sum of every output; the router runs whole on every rank;
- **out**: the partial outputs are summed and scattered back to sequence shards (one reduce-scatter).

Gradients follow one convention: inside the block every local gradient is a partial sum over tp, which the
input's all-gather turns into a reduce-scatter on the way back. The router's weight is replicated and its
gradient declared ``Partial``, so the tp ranks' parts are summed. Its own losses (balancing, z-loss) are
computed identically on every tp rank from the same tokens, so their gradient is scaled by ``1 / tp`` here: the
sum over tp is then the one-process gradient. Measured against one process in docs/expert-parallel.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from ndparallel.parallel.expert_parallel import expert_weight_names, scale_grad

__all__ = ["MoETensorParallel", "apply_moe_tensor_parallel", "moe_tp_problem"]


@dataclass(frozen=True)
class MoETensorParallel:
    """How tp splits one kind of MoE module (a family's :meth:`~ndparallel.parallel.family.ModelFamily.
    moe_tensor_parallel`): submodule paths relative to the MoE module.

    ``expert_hidden_dims``: each stacked expert weight's hidden (FFN) dim, which tp splits.
    ``replicated``: ``nn.Linear`` layers every tp rank runs whole (the router); gradients summed over tp.
    ``colwise`` / ``rowwise``: ``nn.Linear`` layers split on their output / input features (the shared experts).
    """

    expert_hidden_dims: dict[str, int]
    replicated: tuple[str, ...] = ()
    colwise: tuple[str, ...] = ()
    rowwise: tuple[str, ...] = ()


def _linear(layer: nn.Module, path: str) -> nn.Linear | str:
    try:
        module = layer.get_submodule(path)
    except AttributeError:
        return f"{type(layer).__name__} has no submodule {path!r}"
    if not isinstance(module, nn.Linear):
        return f"{type(layer).__name__}.{path} is a {type(module).__name__}, not an nn.Linear"
    return module


def moe_tp_problem(moe_layers: Sequence[nn.Module], spec: MoETensorParallel | None, tp: int, family: str) -> str | None:
    """Why ``tp`` cannot split these MoE modules with ``spec`` (none given, a width tp does not divide, a
    row-wise bias that every rank would add), or None."""
    if tp == 1 or not moe_layers:
        return None
    if spec is None:
        return (
            f"tp_size={tp} on a mixture of experts: model family {family!r} has no tensor-parallel plan for its MoE "
            "blocks; use tp_size=1 and spread the experts with ep_size (docs/expert-parallel.md)"
        )
    layer = moe_layers[0]
    experts = layer.experts
    for name in expert_weight_names(experts):
        if name not in spec.expert_hidden_dims:
            return f"tp_size={tp}: the MoE plan of family {family!r} does not say how to split experts.{name}"
        size = getattr(experts, name).shape[spec.expert_hidden_dims[name]]
        if size % tp:
            return f"tp_size={tp} does not divide the experts' hidden width {size}; choose a tp_size that divides it"
    for path, dim in [(p, 0) for p in spec.colwise] + [(p, 1) for p in spec.rowwise]:
        module = _linear(layer, path)
        if isinstance(module, str):
            return f"tp_size={tp}: {module}"
        if module.weight.shape[dim] % tp:
            return f"tp_size={tp} does not divide {path}'s width {module.weight.shape[dim]}; choose one that divides it"
        if dim == 1 and module.bias is not None:
            return f"tp_size={tp}: the row-wise {path} has a bias, which every tp rank would add; not supported"
    for path in spec.replicated:
        module = _linear(layer, path)
        if isinstance(module, str):
            return f"tp_size={tp}: {module}"
    return None


def _distribute(module: nn.Linear, tp_mesh: DeviceMesh, placements: dict[str, Placement]) -> None:
    """Replace the Linear's parameters by DTensors holding this rank's block (identical full values on every rank,
    or meta: the values come later)."""
    rank, size = tp_mesh.get_local_rank(), tp_mesh.size()
    for name, param in list(module.named_parameters(recurse=False)):
        placement = placements[name]
        local = param.detach()
        if isinstance(placement, Shard):
            local = local.chunk(size, dim=placement.dim)[rank]
        dtensor = DTensor.from_local(
            local.clone(memory_format=torch.contiguous_format), tp_mesh, [placement], run_check=False
        )
        setattr(module, name, nn.Parameter(dtensor, requires_grad=param.requires_grad))


def _run_on_local_shards(module: nn.Linear, grad_placements: Sequence[Placement] | None) -> None:
    """Make the Linear compute on its parameters' local blocks (inputs and outputs plain tensors). Its forward is
    replaced on the instance (FQNs, parameters and FSDP's hooks stay); ``grad_placements``: how the local
    gradient is read back (``Partial()``: a per-rank share, summed over tp), None: like the parameter."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = module.weight.to_local(grad_placements=grad_placements)
        bias = None if module.bias is None else module.bias.to_local(grad_placements=grad_placements)
        return F.linear(x, weight, bias)

    module.forward = forward


class _Boundary:
    """The MoE module's entry and exit under tp: gather the tokens in, reduce-scatter the partial outputs out."""

    def __init__(self, tp_mesh: DeviceMesh):
        self.tp_mesh = tp_mesh
        self.layout: Placement = Shard(1)

    def enter(self, module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        if not isinstance(x, DTensor):  # a plain tensor reaching the block holds this rank's sequence shard
            x = DTensor.from_local(x, self.tp_mesh, [Shard(1)], run_check=False)
        self.layout = x.placements[0]
        full = x.redistribute(self.tp_mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        return (full, *rest)

    def leave(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        if getattr(module, "aux_loss", None) is not None:  # the same value on every tp rank: 1/tp of its gradient
            module.aux_loss = scale_grad(module.aux_loss, 1.0 / self.tp_mesh.size())
        partial = DTensor.from_local(out, self.tp_mesh, [Partial()], run_check=False)
        return partial.redistribute(self.tp_mesh, [self.layout]).to_local()


def apply_moe_tensor_parallel(moe_layers: Sequence[nn.Module], tp_mesh: DeviceMesh, spec: MoETensorParallel) -> None:
    """Split the router, shared experts and entry/exit of every MoE module over ``tp_mesh`` following ``spec``
    (the experts' own weights are split by :func:`~ndparallel.parallel.expert_parallel.apply_expert_parallel`)."""
    for layer in moe_layers:
        for path in spec.replicated:
            module = layer.get_submodule(path)
            _distribute(module, tp_mesh, {"weight": Replicate(), "bias": Replicate()})
            _run_on_local_shards(module, [Partial()])
        for paths, placements in (
            (spec.colwise, {"weight": Shard(0), "bias": Shard(0)}),
            (spec.rowwise, {"weight": Shard(1)}),
        ):
            for path in paths:
                module = layer.get_submodule(path)
                _distribute(module, tp_mesh, placements)
                _run_on_local_shards(module, None)
        boundary = _Boundary(tp_mesh)
        layer.register_forward_pre_hook(boundary.enter)
        layer.register_forward_hook(boundary.leave)
