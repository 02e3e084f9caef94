"""The training loss on any mesh: token cross entropy, vocabulary-parallel when the logits are sharded.

Under tensor parallelism the reference plan (and the Hugging Face one) leaves the logits as a DTensor
sharded on the vocabulary. :func:`cross_entropy_loss` then all-reduces the row max, the sum of
exponentials and the target logit over the tp group instead of gathering the vocabulary; forward and
backward need no context manager. Plain logits go to ``F.cross_entropy``. Both compute in fp32 or wider.
Also importable as ``ndparallel.cross_entropy_loss``. Beside it: the auxiliary losses a forward left
(:func:`auxiliary_loss`), a token sum (:func:`token_loss_sum`, the pipeline's per-micro-batch loss) and the
Trainer's convention that the caller scales each rank's loss (:func:`scaled_by_caller`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

__all__ = ["auxiliary_loss", "caller_scales", "cross_entropy_loss", "scaled_by_caller", "token_loss_sum"]

_CALLER_SCALES = ContextVar("ndparallel_loss_caller_scales", default=False)


@contextmanager
def scaled_by_caller() -> Iterator[None]:
    """Inside, a loss given ``num_items_in_batch`` is ``sum / num_items_in_batch`` without the cp factor: the
    caller (transformers' Trainer) multiplies each rank's loss by ``dp x cp`` itself. A convention between the
    caller and whichever loss honours it (Hugging Face's ``outputs.loss``), so the caller asks no model family."""
    token = _CALLER_SCALES.set(True)
    try:
        yield
    finally:
        _CALLER_SCALES.reset(token)


def caller_scales() -> bool:
    """Whether this code runs inside :func:`scaled_by_caller`."""
    return _CALLER_SCALES.get()


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Sum of the token cross entropies (0 when every target is ignored, with zero gradients)."""
    if isinstance(logits, DTensor):  # vocabulary-parallel: its mean divides by the count clamped to >= 1
        return cross_entropy_loss(logits, targets, ignore_index=ignore_index) * (targets != ignore_index).sum()
    flat = logits.flatten(0, -2)
    flat = flat.float() if flat.dtype in (torch.float16, torch.bfloat16) else flat
    return F.cross_entropy(flat, targets.flatten(), ignore_index=ignore_index, reduction="sum")


def auxiliary_loss(model: torch.nn.Module) -> torch.Tensor | None:
    """The sum of the auxiliary losses ``model``'s last forward left (a mixture-of-experts router's load-balancing
    and z-loss: any submodule with a tensor in ``aux_loss``), each taken once (reset to None); None if there are none.

    Add it to the cross entropy before ``backward``: ``loss = cross_entropy_loss(logits, labels) +
    auxiliary_loss(model)`` (what :class:`ndparallel.train.step.TrainStep` does). Each rank's term is built so that
    its mean over the dp/cp ranks is the one-process value on the global batch (docs/expert-parallel.md).
    """
    total = None
    for module in model.modules():
        value = getattr(module, "aux_loss", None)
        if isinstance(value, torch.Tensor):
            total = value if total is None else total + value
            module.aux_loss = None
    return total


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean token cross entropy for ``logits [batch, seq, vocab]`` and ``labels [batch, seq]``.

    Works on every mesh: plain logits use ``F.cross_entropy``; logits that are a DTensor
    sharded on the vocabulary (the TP plan's output) are reduced across the tp group without
    gathering the vocabulary (forward and backward need no context manager). Computed in fp32 or
    wider (float64 logits stay float64). Returns a plain scalar tensor, equal on every rank of the tp group.
    """
    labels = labels.to_local() if isinstance(labels, DTensor) else labels
    if isinstance(logits, DTensor):
        shard_dims = [p.dim % logits.ndim for p in logits.placements if isinstance(p, Shard)]
        if logits.device_mesh.ndim == 1 and shard_dims == [logits.ndim - 1]:
            local = logits.to_local()
            group = logits.device_mesh.get_group()
            return _VocabParallelCrossEntropy.apply(
                _at_least_fp32(local.flatten(0, -2)), labels.flatten(), _vocab_offset(logits), group, ignore_index
            )
        logits = logits.full_tensor()
    return F.cross_entropy(_at_least_fp32(logits.flatten(0, -2)), labels.flatten(), ignore_index=ignore_index)


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 logits upcast to fp32 for the loss; float64 stays float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _vocab_offset(logits: DTensor) -> int:
    """First vocabulary index of this rank's shard (DTensor's Shard splits like ``torch.chunk``)."""
    vocab = logits.shape[-1]
    ranks = logits.device_mesh.size()
    chunk = -(-vocab // ranks)
    return min(chunk * logits.device_mesh.get_local_rank(), vocab)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy over vocabulary shards: max, sum-exp and target logit are all-reduced in the group."""

    @staticmethod
    def forward(ctx, local, labels, start, group, ignore_index):
        local = local.detach()
        row_max = local.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = local - row_max[:, None]
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        in_shard = (labels >= start) & (labels < start + local.shape[-1])
        index = (labels - start).clamp(0, local.shape[-1] - 1)
        target = shifted.gather(1, index[:, None])[:, 0] * in_shard
        dist.all_reduce(target, group=group)
        valid = labels != ignore_index
        count = valid.sum().clamp(min=1)
        loss = ((sum_exp.log() - target) * valid).sum() / count
        ctx.save_for_backward(exp / sum_exp[:, None], index, in_shard, valid, count)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, index, in_shard, valid, count = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, index] -= in_shard.to(grad.dtype)
        grad *= (valid.to(grad.dtype) * grad_loss / count)[:, None]
        return grad, None, None, None, None
