"""Tensor + sequence parallelism as declarative tables: module FQN pattern -> torch ``ParallelStyle``.

The table for the reference Transformer (``*`` matches one path atom, as in ``parallelize_module``)::

    tok_embeddings              RowwiseParallel, output Shard(1)       (vocab split; output sequence-sharded)
    layers.*.attention_norm     SequenceParallel                        (norm runs on seq/tp tokens)
    layers.*.attention          PrepareModuleInput Shard(1) -> Replicate (all-gather the sequence)
    layers.*.attention.wq/wk/wv ColwiseParallel                         (heads split)
    layers.*.attention.wo       RowwiseParallel, output Shard(1)        (reduce-scatter back to seq shards)
    layers.*.ffn_norm           SequenceParallel
    layers.*.feed_forward       PrepareModuleInput Shard(1) -> Replicate
    layers.*.feed_forward.w1/w3 ColwiseParallel
    layers.*.feed_forward.w2    RowwiseParallel, output Shard(1)
    norm                        SequenceParallel
    output                      ColwiseParallel, input Shard(1), output Shard(-1) as a DTensor (loss parallel)

Every parameter is a DTensor on the tp mesh afterwards, so foreach optimizers and
:func:`ndparallel.clip.clip_grad_norm_` see one kind of tensor. The logits stay vocab-sharded:
compute the loss with :func:`ndparallel.loss.cross_entropy_loss`, which never gathers the full vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ndparallel.errors import ConfigError
from ndparallel.loss import cross_entropy_loss  # re-exported: its home is ndparallel/loss.py

__all__ = [
    "apply_tensor_parallel",
    "check_tp_divisibility",
    "cross_entropy_loss",
    "transformer_tp_plan",
]

TPPlan = Mapping[str, ParallelStyle]


def transformer_tp_plan() -> dict[str, ParallelStyle]:
    """The TP + SP plan for :class:`ndparallel.models.Transformer` (and Llama-shaped models named alike)."""
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
        ),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
        ),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }


# Model config fields that tensor parallelism splits, in our names and in Hugging Face's.
_SPLIT_FIELDS = (
    ("n_heads", "num_attention_heads"),
    ("n_kv_heads", "num_key_value_heads"),
    ("ffn_dim", "intermediate_size"),
    ("vocab_size", "vocab_size"),
)


def check_tp_divisibility(model: nn.Module, tp_size: int, plan: TPPlan | None = None) -> None:
    """Raise :class:`ConfigError` when ``tp_size`` cannot split the model evenly.

    Checks the model config's head counts, FFN width and vocabulary (if the model has a
    ``config`` with those fields), then every Linear/Embedding the plan shards.
    """
    if tp_size <= 1:
        return
    config = getattr(model, "config", None)
    for names in _SPLIT_FIELDS:
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
        style = _style_for(fqn, plan)
        dim = _sharded_size(module, style)
        if dim is not None and dim[1] % tp_size:
            raise ConfigError(
                f"tp_size={tp_size} does not divide {fqn}.{dim[0]}={dim[1]} (sharded by {type(style).__name__}); "
                "choose a tp_size that divides it"
            )


def _style_for(fqn: str, plan: TPPlan) -> ParallelStyle | None:
    from fnmatch import fnmatch

    atoms = fqn.split(".")
    for pattern, style in plan.items():
        parts = pattern.split(".")
        if len(parts) == len(atoms) and all(fnmatch(a, p) for a, p in zip(atoms, parts, strict=True)):
            return style
    return None


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


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan | None = None) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` following ``plan`` (default: the Transformer table)."""
    plan = dict(transformer_tp_plan() if plan is None else plan)
    check_tp_divisibility(model, tp_mesh.size(), plan)
    unmatched = [p for p in plan if not any(_style_for(fqn, {p: plan[p]}) for fqn, _ in model.named_modules())]
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
