"""FSDP2 / HSDP: ``fully_shard`` per transformer block, on the embedding, on [final norm + output], on the root.

Each ``fully_shard`` call makes one communication group: its parameters are all-gathered
just before that module's forward (and again in backward when ``reshard_after_forward``),
and its gradients reduce-scattered right after its backward, so communication of block
``i`` overlaps compute of its neighbours. A 1-D mesh shards (FSDP); a 2-D
``(replicate, shard)`` mesh shards inside each replica and all-reduces across replicas (HSDP).

FSDP2 flattens a unit's parameters into one buffer, so a unit must hold one parameter dtype. A model that
keeps some parameters in another dtype (DeepSeek-V3's fp32 router in a bf16 or float64 model) gets, inside
each unit, one extra unit per largest submodule whose parameters all have a dtype other than the unit's
most common one (:func:`dtype_units`); those compute and reduce in their stored dtype under mixed precision
(a model keeps them apart on purpose). Odd-dtype parameters that are not a whole submodule are refused by name.
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
from ndparallel.errors import ConfigError

__all__ = ["apply_fully_shard", "default_shard_groups", "dtype_units", "fsdp_mesh", "mixed_precision_policy"]


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


def _unit_params(unit: nn.Module, inner: set[nn.Module]) -> list[tuple[str, nn.Module, nn.Parameter]]:
    """(fqn, owner, parameter) of ``unit``'s own parameters: not inside a module of ``inner`` (its own units)."""
    found, seen = [], set()

    def walk(module: nn.Module, prefix: str) -> None:
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                found.append((f"{prefix}{name}", module, param))
        for name, child in module.named_children():
            if child not in inner:
                walk(child, f"{prefix}{name}.")

    walk(unit, "")
    return found


def _majority_dtype(params: Sequence[nn.Parameter]) -> torch.dtype | None:
    counts: dict[torch.dtype, int] = {}
    for param in params:
        counts[param.dtype] = counts.get(param.dtype, 0) + param.numel()
    return max(counts, key=counts.get) if counts else None


def dtype_units(unit: nn.Module, inner: Sequence[nn.Module] = ()) -> list[nn.Module]:
    """The submodules of ``unit`` that need their own FSDP unit because their parameters all have a dtype
    other than the unit's most common one (largest such submodules first found; ``inner`` are units already).
    ConfigError naming the parameter when an odd-dtype parameter shares its module with other dtypes."""
    own = _unit_params(unit, set(inner))
    main = _majority_dtype([p for _, _, p in own])
    odd = {id(p) for _, _, p in own if p.dtype != main}
    if not odd:
        return []
    units: list[nn.Module] = []

    def pick(module: nn.Module) -> None:
        params = [p for _, _, p in _unit_params(module, set(inner))]
        if module is not unit and params and all(id(p) in odd for p in params):
            units.append(module)
            return
        for child in module.children():
            if child not in inner:
                pick(child)

    pick(unit)
    covered = {id(p) for module in units for _, _, p in _unit_params(module, set(inner))}
    for fqn, owner, param in own:
        if id(param) in odd and id(param) not in covered:
            raise ConfigError(
                f"FSDP needs one parameter dtype per unit, but {fqn!r} ({type(owner).__name__}) is {param.dtype} "
                f"beside {main} parameters of the same module: give the model one dtype (model.to(dtype)), or "
                "move such parameters into a submodule of their own (it then becomes its own FSDP unit)"
            )
    return units


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
    experts: Sequence[nn.Module] = (),
    experts_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Shard ``model`` over ``dp_mesh`` (1-D: FSDP, 2-D: HSDP): each block, each group of child FQNs, the root.

    ``groups`` default: :func:`default_shard_groups`. ``experts`` (expert parallel): the modules whose weights are
    already sharded over ``ep``; each is its own unit first, sharded over ``experts_mesh`` (``mesh["ep_fsdp"]``,
    the rest of dp_shard x cp), so no block unit holds them. The last block keeps its parameters
    gathered after forward: backward needs them at once, so freeing them would only add an all-gather.
    """
    policy = mixed_precision_policy(cfg.mixed_precision, _widest_float_dtype(model))
    kwargs = dict(mesh=dp_mesh, mp_policy=policy)
    if cfg.cpu_offload:
        # Pinned host memory speeds host<->device copies; it needs an accelerator (CPU-only ranks: no pinning).
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=dp_mesh.device_type != "cpu")
    reshard = cfg.reshard_after_forward
    grouped = [
        [model.get_submodule(fqn) for fqn in group]
        for group in (default_shard_groups(model) if groups is None else groups)
    ]
    odd = _odd_dtype_units(model, list(blocks), grouped)  # refusals first: nothing is sharded yet
    for module in experts:
        fully_shard(module, reshard_after_forward=reshard, **{**kwargs, "mesh": experts_mesh})
    for module in odd:  # its own dtype for compute and reduction: the model keeps it apart on purpose
        fully_shard(module, reshard_after_forward=reshard, **{**kwargs, "mp_policy": mixed_precision_policy("no")})
    for index, block in enumerate(blocks):
        block.register_forward_hook(_unview_output)
        fully_shard(block, reshard_after_forward=reshard and index < len(blocks) - 1, **kwargs)
    for modules in grouped:
        for module in modules:
            module.register_forward_hook(_unview_output)
        fully_shard(modules if len(modules) > 1 else modules[0], reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=reshard, **kwargs)
    return model


def _odd_dtype_units(model: nn.Module, blocks: list[nn.Module], groups: list[list[nn.Module]]) -> list[nn.Module]:
    """The extra units :func:`dtype_units` finds in every block, group and the root (innermost units first)."""
    units = [*blocks, *(m for group in groups for m in group)]
    odd: list[nn.Module] = []
    for unit in blocks:
        odd += dtype_units(unit)
    for group in groups:  # a multi-module group is one unit: its modules' parameters together
        holder = nn.ModuleList(group) if len(group) > 1 else group[0]
        odd += dtype_units(holder)
    return odd + dtype_units(model, units + odd)
