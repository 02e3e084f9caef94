"""Gradient-norm clipping that is correct whatever mix of meshes and tensor kinds the parameters have.

``torch.nn.utils.clip_grad_norm_`` needs every gradient on one mesh and of one kind: after TP
and FSDP a model may hold DTensors on a 2-D (dp, tp) mesh, DTensors on a 1-D mesh and plain
tensors. Here gradients are grouped by mesh, each group's norm is computed with the DTensor
reduction its placements imply (Shard: sum over the mesh; Replicate: local; Partial: reduced),
the group norms are combined into the true global norm, and every group is scaled by one
coefficient.

Numerics: each group's norm keeps its gradients' dtype and the groups are combined in the widest
of them (at least fp32), so float64 gradients give a float64 norm. Every rank must hold gradients for
the same parameters: under DTensor the norm is a collective, and a rank without a gradient that
another rank has would compute something no single process computes (a Replicate gradient's norm
would differ between ranks, a Shard's would miss a piece). That is checked with one small
all-reduce and refused with the same error on every rank.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ndparallel.distributed.agree import failed_ranks

__all__ = ["clip_grad_norm_", "mark_counted_elsewhere", "total_grad_norm"]

# Set on a parameter that is a second copy of a weight whose gradient another copy already holds (a weight tied
# across pipeline stages): the norm skips it, clipping scales it.
_COUNTED_ELSEWHERE = "_ndparallel_norm_counted_elsewhere"


def mark_counted_elsewhere(param: torch.Tensor) -> None:
    """Leave ``param`` out of every gradient norm (still clipped): its gradient is another parameter's, which
    the norm counts (ndparallel/parallel/pipeline/tied.py)."""
    setattr(param, _COUNTED_ELSEWHERE, True)


def _counted(parameters: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p for p in parameters if not getattr(p, _COUNTED_ELSEWHERE, False)]


def _grads_by_mesh(parameters: Iterable[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    groups: dict[object, list[torch.Tensor]] = {}
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        key = grad.device_mesh if isinstance(grad, DTensor) else ("local", grad.device)
        groups.setdefault(key, []).append(grad)
    return groups


# Reducing a scalar norm that is Partial over a 2-D/3-D mesh makes DTensor log a warning, on every
# rank, that it runs one all-reduce per mesh dim (torch 2.13 logs it once per mesh and dims). For
# one scalar that costs nothing measurable, and the message would flood the training output.
_REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"


class _QuietInScope(logging.Filter):
    """Drops the records below ERROR that a thread logs while it is inside :func:`_quiet_sequential_reduce_warning`.

    Scoped and thread-safe: the logger's level is never changed (that would silence every thread
    and clear every logger's cache), the filter is attached only while some thread is inside the
    block, and it drops only the records of the threads that are.
    """

    def __init__(self) -> None:
        super().__init__()
        self._inside = threading.local()
        self._lock = threading.Lock()
        self._threads_inside = 0

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or getattr(self._inside, "depth", 0) == 0

    @contextlib.contextmanager
    def scope(self, logger: logging.Logger) -> Iterator[None]:
        depth = getattr(self._inside, "depth", 0)
        if depth == 0:
            with self._lock:
                if self._threads_inside == 0:
                    logger.addFilter(self)
                self._threads_inside += 1
        self._inside.depth = depth + 1
        try:
            yield
        finally:
            self._inside.depth = depth
            if depth == 0:
                with self._lock:
                    self._threads_inside -= 1
                    if self._threads_inside == 0:
                        logger.removeFilter(self)


_QUIET = _QuietInScope()


def _quiet_sequential_reduce_warning() -> contextlib.AbstractContextManager[None]:
    return _QUIET.scope(logging.getLogger(_REDISTRIBUTE_LOGGER))


def _combine(norms: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """One norm from the groups' norms, in the widest of their dtypes (at least fp32): never below a gradient's."""
    dtype = torch.float32
    for norm in norms:
        dtype = torch.promote_types(dtype, norm.dtype)
    stacked = torch.stack([n.to(norms[0].device, dtype) for n in norms])
    if math.isinf(norm_type):
        return stacked.max()
    return stacked.pow(norm_type).sum().pow(1.0 / norm_type)


def _agreement_device(mesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _check_same_grads_on_every_rank(parameters: list[torch.Tensor], pp_group: dist.ProcessGroup | None) -> None:
    """Raise the same error on every rank unless all ranks that hold the same parameters hold gradients for
    the same ones.

    Without pipeline parallelism every rank holds the same parameters; under pp (``pp_group``) the ranks of
    one pp coordinate do, and each coordinate writes its flags into its own slot of one vector. One
    all-reduce (MAX of ``[has_grad, 1 - has_grad]`` per parameter and slot) over the world (under pp after
    one that agrees on the longest parameter list), when the parameters hold DTensors whose meshes span the
    world (or one pp slice of it: every ndparallel mesh does); with plain tensors only (pure data parallel, pp
    alone, pp x pure replicate) there is no collective and nothing to check. On disagreement,
    :func:`ndparallel.distributed.agree.failed_ranks` names the ranks (the same list on every rank).
    """
    meshes = {p.device_mesh: None for p in parameters if isinstance(p, DTensor)}
    if not meshes or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    ranks = set()
    for mesh in meshes:
        ranks.update(mesh.mesh.flatten().tolist())
    slots = dist.get_world_size(pp_group) if pp_group is not None else 1
    slot = dist.get_rank(pp_group) if pp_group is not None else 0
    if len(ranks) * slots != dist.get_world_size():
        return  # a sub-world job: no group spans exactly its ranks without a collective new_group
    device = _agreement_device(next(iter(meshes)))
    has = torch.tensor([p.grad is not None for p in parameters], dtype=torch.int32)
    length = torch.tensor([len(parameters)], device=device)
    if slots > 1:  # the pp slots hold different parameter lists: agree on the longest
        dist.all_reduce(length, op=dist.ReduceOp.MAX)
    flags = torch.zeros(slots, 2, int(length.item()), dtype=torch.int32)
    flags[slot, 0, : len(parameters)] = has
    flags[slot, 1, : len(parameters)] = 1 - has
    flags = flags.to(device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    flags = flags.cpu()
    disputed = (flags[:, 0] * flags[:, 1]).nonzero().tolist()  # [slot, parameter] pairs, the same on every rank
    if not disputed:
        return
    bad_slot, first = disputed[0]
    mine = slot == bad_slot
    holds = mine and first < len(parameters) and bool(has[first])
    lacking = failed_ranks(mine and not holds)  # one all-reduce of a one-hot vector each: no pickles
    having = failed_ranks(holds)
    where = f" of pipeline rank {bad_slot}" if slots > 1 else ""
    raise RuntimeError(
        f"clip_grad_norm_: parameter {first}{where} has a gradient on rank(s) {having} but not on rank(s) "
        f"{lacking} ({len(disputed)} parameter(s) disagree): the global norm would differ from one process's. "
        "Run the same forward/backward on every rank before clipping (a rank that skipped backward or set "
        ".grad = None alone)"
    )


def _across_stages(norm: torch.Tensor, norm_type: float, pp_group: dist.ProcessGroup) -> torch.Tensor:
    """Pipeline parallel: each rank's ``norm`` covers its stages; combine over the pp group (sum of p-th powers,
    or the max for inf) into the norm of the whole model."""
    value = norm.reshape(1).to(torch.float64)  # on the gradients' device
    if math.isinf(norm_type):
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=pp_group)
        return value[0]
    value = value.pow(norm_type)
    dist.all_reduce(value, group=pp_group)
    return value.pow(1.0 / norm_type)[0]


def total_grad_norm(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    norm_type: float = 2.0,
    foreach: bool | None = None,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The norm of all gradients together, as one process holding the full model would compute it.

    Returned in the widest gradient dtype (at least fp32). Raises ``RuntimeError`` on every rank when
    ranks hold gradients for different parameters (see the module docstring). ``pp_group``: under pipeline
    parallelism, the group of ranks holding the other stages; their norms are combined into one. A parameter
    marked :func:`mark_counted_elsewhere` is left out (its gradient is counted in another's).
    """
    parameters = _counted([parameters] if isinstance(parameters, torch.Tensor) else list(parameters))
    norm_type = float(norm_type)
    _check_same_grads_on_every_rank(parameters, pp_group)
    norms = []
    for grads in _grads_by_mesh(parameters).values():
        with _quiet_sequential_reduce_warning():
            norm = torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()  # reduces Partial placements over the mesh
        norms.append(norm)
    total = _combine(norms, norm_type) if norms else torch.tensor(0.0)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        total = _across_stages(total, norm_type, pp_group)
    return total


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; return the norm before clipping.

    Same contract as ``torch.nn.utils.clip_grad_norm_`` (``norm_type`` may be ``inf``), but
    parameters may live on different device meshes and mix DTensors with plain tensors. The
    returned norm is a plain tensor, equal on every rank to the single-process norm. ``pp_group``: see
    :func:`total_grad_norm` (one coefficient for every stage).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    if not max_norm >= 0:
        raise ValueError(f"max_norm={max_norm} must be >= 0 (a negative value would flip the gradients' sign)")
    parameters = list(parameters)
    total = total_grad_norm(parameters, norm_type, foreach=foreach, pp_group=pp_group)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite; "
            "set error_if_nonfinite=False to clip anyway"
        )
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # same formula as torch.nn.utils
    for grads in _grads_by_mesh(parameters).values():
        for grad in grads:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            local.mul_(coef.to(local.device, local.dtype))
    return total
