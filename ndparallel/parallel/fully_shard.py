"""FSDP2 / HSDP: ``fully_shard`` per transformer block, on the embedding, on [final norm + output], on the root.

Each ``fully_shard`` call makes one communication group: its parameters are all-gathered
just before that module's forward (and again in backward when ``reshard_after_forward``),
and its gradients reduce-scattered right after its backward, so communication of block
``i`` overlaps compute of its neighbours. A 1-D mesh shards (FSDP); a 2-D
``(replicate, shard)`` mesh shards inside each replica and all-reduces across replicas (HSDP).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.config.precision import DTYPES

__all__ = ["apply_fully_shard", "default_shard_groups", "fsdp_mesh", "mixed_precision_policy"]


def mixed_precision_policy(mixed_precision: str, param_dtype: torch.dtype = torch.float32) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``cfg.mixed_precision`` on parameters stored in ``param_dtype``.

    ``no``: compute and gradient reduction in the parameters' own dtype (float64 stays float64).
    ``bf16``/``fp16``: parameters (and so compute) in that dtype during forward/backward, gradients
    reduced in the wider of fp32 and ``param_dtype``. A reduction never runs below the stored dtype.
    """
    low = DTYPES[mixed_precision]
    if low is None:
        return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None)
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.promote_types(torch.float32, param_dtype))


def _widest_float_dtype(model: nn.Module) -> torch.dtype:
    dtype = torch.float32
    for param in model.parameters():
        if param.is_floating_point():
            dtype = torch.promote_types(dtype, param.dtype)
    return dtype


def fsdp_mesh(mesh) -> DeviceMesh | None:
    """The data-parallel mesh FSDP shards over, from an :class:`ndparallel.distributed.mesh.Mesh` (which builds it:
    :attr:`ndparallel.distributed.mesh.Mesh.fsdp`).

    ``mesh["dp_shard_cp"]`` (1-D) when only sharding; a 2-D ``(dp_replicate, dp_shard_cp)`` mesh
    for HSDP; ``None`` when ``dp_shard x cp == 1`` (no FSDP: pure replicate or no data parallel).
    """
    return mesh.fsdp


class _Unviewed(torch.autograd.Function):
    """Identity whose output shares its input's storage without being an autograd view of it."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _unview_output(module: nn.Module, args: tuple, output: object) -> object:
    """Forward hook, run before FSDP2's: an output that is a view (TP's ``DTensor.to_local()`` on the embedding
    or final norm) becomes a plain alias, so an in-place op on it cannot drop FSDP2's pre-backward hook (what
    FSDP2's "returned a view tensor" warning is about) and FSDP2 has nothing to warn of. No copy."""
    if isinstance(output, torch.Tensor) and not isinstance(output, DTensor):
        if output._base is not None and output.requires_grad and torch.is_grad_enabled():
            return _Unviewed.apply(output)
    return output


def default_shard_groups(model: nn.Module) -> list[list[str]]:
    """Extra FSDP groups besides the blocks: ``[[tok_embeddings], [norm, output]]`` when the model has them."""
    names = dict(model.named_children())
    groups = []
    if "tok_embeddings" in names:
        groups.append(["tok_embeddings"])
    head = [n for n in ("norm", "output") if n in names]
    if head:
        groups.append(head)
    return groups


def apply_fully_shard(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    cfg: ParallelismConfig,
    blocks: Sequence[nn.Module],
    groups: Sequence[Sequence[str]] | None = None,
) -> nn.Module:
    """Shard ``model`` over ``dp_mesh`` (1-D: FSDP, 2-D: HSDP): each block, each group of child FQNs, the root.

    ``groups`` default: :func:`default_shard_groups`. The last block keeps its parameters
    gathered after forward: backward needs them at once, so freeing them would only add an all-gather.
    """
    policy = mixed_precision_policy(cfg.mixed_precision, _widest_float_dtype(model))
    kwargs = dict(mesh=dp_mesh, mp_policy=policy)
    if cfg.cpu_offload:
        # Pinned host memory speeds host<->device copies; it needs an accelerator (CPU-only ranks: no pinning).
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=dp_mesh.device_type != "cpu")
    reshard = cfg.reshard_after_forward
    for index, block in enumerate(blocks):
        block.register_forward_hook(_unview_output)
        fully_shard(block, reshard_after_forward=reshard and index < len(blocks) - 1, **kwargs)
    for group in default_shard_groups(model) if groups is None else groups:
        modules = [model.get_submodule(fqn) for fqn in group]
        for module in modules:
            module.register_forward_hook(_unview_output)
        fully_shard(modules if len(modules) > 1 else modules[0], reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=reshard, **kwargs)
    return model
