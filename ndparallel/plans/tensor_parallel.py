"""Tensor + sequence parallelism as declarative tables: module FQN pattern -> torch ``ParallelStyle``.

A table (:data:`TPTable`, the ``plan=`` of :func:`ndparallel.parallelize`) maps FQN patterns (``*``
matches inside one path atom: :mod:`ndparallel.plans.fqn`) to torch's styles; each model family supplies
its own (the reference Transformer's is in ``ndparallel/models/family.py``, Hugging Face's in
``ndparallel/hf/plan.py``). :func:`apply_tensor_parallel` checks the table against the model (every entry
must match a module, every sharded dimension must divide by tp) and applies it with torch's
``parallelize_module``.

Every parameter is a DTensor on the tp mesh afterwards, so foreach optimizers and
:func:`ndparallel.clip.clip_grad_norm_` see one kind of tensor. The logits stay vocab-sharded:
compute the loss with :func:`ndparallel.loss.cross_entropy_loss`, which never gathers the full vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from ndparallel.errors import ConfigError
from ndparallel.loss import cross_entropy_loss  # re-exported: its home is ndparallel/loss.py
from ndparallel.models.family import transformer_tp_plan  # re-exported, and apply_tensor_parallel's default
from ndparallel.plans.fqn import first_match, matching_modules

__all__ = [
    "TPPlan",
    "TPTable",
    "apply_tensor_parallel",
    "check_tp_divisibility",
    "cross_entropy_loss",
    "transformer_tp_plan",
]

TPTable = Mapping[str, ParallelStyle]  # {fqn_pattern: ParallelStyle}: the ``plan=`` of parallelize
TPPlan = TPTable  # the earlier name, kept for imports


# Without a family's split_fields: the config fields TP splits, in the reference model's names and in Hugging
# Face's (callers that check a model outside parallelize, such as the bench, rely on it).
_SPLIT_FIELDS = (
    ("n_heads", "num_attention_heads"),
    ("n_kv_heads", "num_key_value_heads"),
    ("ffn_dim", "intermediate_size"),
    ("vocab_size", "vocab_size"),
)


def check_tp_divisibility(
    model: nn.Module, tp_size: int, plan: TPTable | None = None, fields: Sequence[str] | None = None
) -> None:
    """Raise :class:`ConfigError` when ``tp_size`` cannot split the model evenly.

    Checks the ``model.config`` fields in ``fields`` (a family's ``split_fields``: head counts, FFN width,
    vocabulary; default: the first present of each pair in ``_SPLIT_FIELDS``), then every
    Linear/Embedding the plan shards.
    """
    if tp_size <= 1:
        return
    config = getattr(model, "config", None)
    groups = [(name,) for name in fields] if fields is not None else _SPLIT_FIELDS
    for names in groups:
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                if value % tp_size:
                    raise ConfigError(
                        f"tp_size={tp_size} does not divide {name}={value}; choose a tp_size that divides it"
                    )
                break
    if plan is None:
        return
    for fqn, module in model.named_modules():
        style = first_match(fqn, plan)
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


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: TPTable | None = None) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` following ``plan`` (default: the Transformer table)."""
    plan = dict(transformer_tp_plan() if plan is None else plan)
    check_tp_divisibility(model, tp_mesh.size(), plan)
    unmatched = [pattern for pattern in plan if next(matching_modules(model, pattern), None) is None]
    if unmatched:
        raise ConfigError(
            f"tensor-parallel plan entries {unmatched} match no module of {type(model).__name__}; "
            "pass plan= with FQN patterns of this model (see docs/parallelize.md)"
        )
    parallelize_module(model, tp_mesh, plan)
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
