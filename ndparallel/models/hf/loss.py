"""``outputs.loss`` of a Hugging Face causal LM under tensor / context parallel, exactly as in one process.

Transformers' ``ForCausalLMLoss`` shifts ``labels`` by one inside the tensor it gets and calls
``F.cross_entropy`` on full-vocabulary logits. Under ndparallel both assumptions break: with cp each rank
holds a shard of the sequence (head-tail chunks under load balancing), so the label after a shard's last
token lives on another rank; with tp the logits are a DTensor split over the vocabulary. The replacement
installed on the model (``model.loss_function``) keeps the same arguments and meaning:

- ``shift_labels`` (already shifted) are used as given: this rank's shard (sharded with the tokens by
  ``context_parallel``) or the full sequence (this rank's positions are picked).
- ``labels`` alone are shifted over the whole sequence: a shard is all-gathered over ``mesh["cp"]`` (integers,
  one all-gather per forward), shifted, and this rank's positions picked; the last position is ignored.
- The cross entropy is vocabulary-parallel under tp (:func:`ndparallel.cross_entropy_loss`), in fp32 for
  half-precision logits (as transformers upcasts) and fp64 for fp64 logits.
- The reduction is transformers': the sum over valid tokens divided by ``num_items_in_batch`` when given,
  else by the number of valid tokens. Under cp the valid tokens of one sequence are spread over the cp ranks
  (the rank holding the last position has fewer), so each rank returns ``cp x its sum / the cp group's
  count``: the mean over ``dp_cp`` that FSDP's gradient averaging takes is the one-process loss, exactly.
  Inside :func:`scaled_by_caller` (the transformers ``Trainer``, which multiplies every rank's loss by the ranks
  holding different tokens, ``dp x cp``, itself) a loss with ``num_items_in_batch`` is the plain ``sum /
  num_items_in_batch``, as transformers' own and TRL's fused LM head compute it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ndparallel.parallel.context_parallel import gather_sequence, sequence_indices
from ndparallel.parallel.loss import caller_scales, cross_entropy_loss, scaled_by_caller, token_loss_sum

# scaled_by_caller and token_loss_sum live in ndparallel/parallel/loss.py (the Trainer and the pipeline use them for
# any model); still importable from here.
__all__ = ["install_causal_lm_loss", "labels_problem", "scaled_by_caller", "token_loss_sum"]


def labels_problem(kwargs: dict[str, Any], local: int, cp_size: int) -> str | None:
    """Why the ``labels`` / ``shift_labels`` of this forward cannot be used under tp/cp, or None."""
    shapes = {"labels": (local, local * cp_size), "shift_labels": (local, local * cp_size)}
    for name, lengths in shapes.items():
        value = kwargs.get(name)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or value.dim() != 2:
            return f"{name} must be a [batch, seq] tensor under tp/cp"
        if value.shape[-1] not in lengths:
            return (
                f"{name} has {value.shape[-1]} positions but this rank holds {local} tokens (cp_size={cp_size}): "
                f"pass {name} as a context_parallel buffer with the tokens (seq dim 1), or the whole sequence"
            )
    has_labels = kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None
    if has_labels and kwargs.get("logits_to_keep") not in (None, 0):
        return "logits_to_keep with labels is not supported under tp/cp; drop logits_to_keep"
    return None


def _shifted_labels(
    labels: torch.Tensor, local: int, ignore_index: int, cp: tuple[dist.ProcessGroup | None, int, int, bool]
) -> torch.Tensor:
    """Next-token labels for this rank's positions, from ``labels`` (this rank's shard or the full sequence)."""
    group, cp_size, cp_rank, load_balance = cp
    full = gather_sequence(labels, 1, group, load_balance) if cp_size > 1 and labels.shape[1] == local else labels
    shifted = F.pad(full[:, 1:], (0, 1), value=ignore_index)
    return _local_positions(shifted, local, cp)


def _local_positions(full: torch.Tensor, local: int, cp: tuple) -> torch.Tensor:
    _group, cp_size, cp_rank, load_balance = cp
    if full.shape[1] == local:
        return full
    return full.index_select(1, sequence_indices(full.shape[1], cp_size, cp_rank, load_balance, device=full.device))


def _causal_lm_loss(cp: tuple[dist.ProcessGroup | None, int, int, bool]):
    group, cp_size = cp[0], cp[1]

    def loss_function(
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        vocab_size: int | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        local = logits.shape[1]
        if shift_labels is not None:
            targets = _local_positions(shift_labels, local, cp)
        else:
            targets = _shifted_labels(labels, local, ignore_index, cp)
        targets = targets.to(logits.device)
        if cp_size == 1 and num_items_in_batch is None:
            return cross_entropy_loss(logits, targets, ignore_index=ignore_index)  # transformers' mean
        total = token_loss_sum(logits, targets, ignore_index)
        if num_items_in_batch is None:
            denominator = (targets != ignore_index).sum()
            dist.all_reduce(denominator, group=group)  # the valid tokens of these sequences, over the cp ranks
        else:
            denominator = torch.as_tensor(num_items_in_batch, device=total.device)
        share = 1 if num_items_in_batch is not None and caller_scales() else cp_size
        return total * share / denominator.clamp(min=1).to(total.dtype)

    return loss_function


def install_causal_lm_loss(
    model: nn.Module, cp_group: dist.ProcessGroup | None, cp_size: int, cp_rank: int, load_balance: bool
) -> None:
    """Replace ``model.loss_function`` (what HF causal LMs call with ``labels=``) by the sharding-aware one."""
    loss = _causal_lm_loss((cp_group, cp_size, cp_rank, load_balance))
    try:
        model.loss_function = loss
    except AttributeError:  # transformers without the setter: its property reads this attribute first
        model._loss_function = loss
