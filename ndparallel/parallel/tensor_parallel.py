"""Tensor + sequence parallelism as declarative tables: module FQN pattern -> torch ``ParallelStyle``.

A table (:data:`TPTable`, the ``tp_plan=`` of :func:`ndparallel.parallelize`) maps FQN patterns (``*``
matches inside one path atom: :mod:`ndparallel.parallel.fqn`) to torch's styles; each model family supplies
its own (the reference Transformer's is in ``ndparallel/models/transformer/family.py``, Hugging Face's in
``ndparallel/models/hf/tp_plan.py``). :func:`apply_tensor_parallel` checks the table against the model (every entry
must match a module, every sharded dimension must divide by tp) and applies it with torch's
``parallelize_module``.

Every parameter is a DTensor on the tp mesh afterwards, so foreach optimizers and
:func:`ndparallel.parallel.clip.clip_grad_norm_` see one kind of tensor. The logits stay vocab-sharded:
compute the loss with :func:`ndparallel.parallel.loss.cross_entropy_loss`, which never gathers the full vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from ndparallel.config.preflight import check_tp_fields
from ndparallel.errors import ConfigError
from ndparallel.parallel.fqn import first_match, matching_modules
from ndparallel.parallel.protocol import config_sizes

__all__ = ["TPTable", "apply_tensor_parallel", "check_tp_divisibility"]

TPTable = Mapping[str, ParallelStyle]  # {fqn_pattern: ParallelStyle}: the ``tp_plan=`` of parallelize


def check_tp_divisibility(model: nn.Module, tp_size: int, tp_plan: TPTable, fields: Sequence[str] = ()) -> None:
    """Raise :class:`ConfigError` when ``tp_size`` cannot split the model evenly.

    Checks the integer ``model.config`` fields in ``fields`` (a family's ``split_fields``: head counts, FFN
    width, vocabulary) with the one rule of :func:`ndparallel.config.preflight.check_tp_fields`, then every
    Linear/Embedding the table shards.
    """
    if tp_size <= 1:
        return
    check_tp_fields(config_sizes(model, fields), tp_size)
    for fqn, module in model.named_modules():
        style = first_match(fqn, tp_plan)
        dim = _sharded_size(module, style)
        if dim is not None and dim[1] % tp_size:
            raise ConfigError(
                f"tp_size={tp_size} does not divide {fqn}.{dim[0]}={dim[1]} (sharded by {type(style).__name__}); "
                "choose a tp_size that divides it"
            )


def _sharded_size(module: nn.Module, style: ParallelStyle | None) -> tuple[str, int] | None:
    if isinstance(style, ColwiseParallel):
        if isinstance(module, nn.Linear):
            return "out_features", module.out_features
        if isinstance(module, nn.Embedding):
            return "embedding_dim", module.embedding_dim
    if isinstance(style, RowwiseParallel):
        if isinstance(module, nn.Linear):
            return "in_features", module.in_features
        if isinstance(module, nn.Embedding):
            return "num_embeddings", module.num_embeddings
    return None


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, tp_plan: TPTable) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` following ``tp_plan`` (a family's table, or yours)."""
    tp_plan = dict(tp_plan)
    check_tp_divisibility(model, tp_mesh.size(), tp_plan)
    unmatched = [pattern for pattern in tp_plan if next(matching_modules(model, pattern), None) is None]
    if unmatched:
        raise ConfigError(
            f"tensor-parallel plan entries {unmatched} match no module of {type(model).__name__}; "
            "pass tp_plan= with FQN patterns of this model (see docs/parallelize.md)"
        )
    parallelize_module(model, tp_mesh, tp_plan)
    for param in model.parameters():
        if isinstance(param, DTensor):
            param.register_post_accumulate_grad_hook(_grad_like_param)
    return model


def _grad_like_param(param: DTensor) -> None:
    """Give the gradient its parameter's placements once backward has accumulated it.

    Autograd leaves some TP gradients in another layout: the embedding's as a full Replicate
    copy (vocab x dim on every rank), SequenceParallel norms' as Partial sums. Redistributing
    here keeps gradient memory sharded like the parameters and lets the optimizer and clipping
    work on one layout (each Partial norm gradient is all-reduced once, not once per optimizer op).
    Under FSDP the sharded parameters are new objects without this hook: FSDP reduces the grads itself.
    """
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)
