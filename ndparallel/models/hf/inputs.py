"""Forward inputs of a Hugging Face model under tp/cp: refused alike on every rank, masks reduced, positions filled in.

:func:`apply_hf_attention <ndparallel.models.hf.attention.apply_hf_attention>` installs :func:`input_hook` as a
forward pre-hook on the model. It refuses what the sharded attention cannot honour (a KV cache, ``inputs_embeds``,
a sequence the mesh cannot split, labels or positions not sharded like the tokens, an arbitrary mask), turns the
KV cache off, and fills ``position_ids`` with this rank's global positions (the rank's shard under cp; under
sequence parallel the local sequence would otherwise number tokens ``0..seq/tp``).

Masks: a padding ``attention_mask``, ``position_ids`` restarting per document and flash-attention's
``cu_seq_lens`` reduce to one :class:`~ndparallel.distributed.documents.DocumentMask` over the whole rows
(:func:`ndparallel.parallel.masks.hf_document_mask`, transformers' one-process semantics). Under cp the rank's
shards are all-gathered over the cp group first (a few int64 per token). The mask travels down the model to
ndparallel's attention functions as the ``ndparallel_documents`` keyword, and ``attention_mask`` becomes None.

Refusals are collective (:func:`ndparallel.distributed.agree.agree`: one all-reduce of a flag vector per
forward, two when the batch carries a mask): a rank that sees bad input and one that does not raise the same
ConfigError, instead of one rank raising while the others block in FSDP's next collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ndparallel.config.sequence import sequence_problem
from ndparallel.distributed.agree import agree
from ndparallel.distributed.documents import DocumentMask
from ndparallel.errors import ConfigError
from ndparallel.models.hf.loss import labels_problem
from ndparallel.parallel.context_parallel import gather_sequence, sequence_indices
from ndparallel.parallel.masks import DOCUMENTS_KWARG, hf_document_mask, mask_shape_problem

__all__ = ["InputLayout", "input_hook", "input_problem"]


@dataclass(frozen=True)
class InputLayout:
    """How this rank's inputs are cut: tp splits each rank's tokens (sequence parallel), cp the sequence."""

    tp_size: int
    cp_size: int
    cp_rank: int
    load_balance: bool
    cp_group: dist.ProcessGroup | None = None  # gathers the rank's mask inputs into whole rows (cp > 1)
    ignores_packing: str | None = None  # the model_type, when it builds its masks without position_ids (packing.py)


def input_problem(layout: InputLayout, args: tuple, kwargs: dict[str, Any]) -> str | None:
    """Why this rank's forward inputs cannot run under tp/cp, or None."""
    if len(args) > 1:
        return "pass attention_mask / position_ids as keywords to a model parallelised by ndparallel"
    tokens = args[0] if args else kwargs.get("input_ids")
    if tokens is None:
        return "tp/cp need input_ids (inputs_embeds bypass the sharded embedding); pass input_ids"
    if kwargs.get("use_cache"):
        return "use_cache=True (KV cache, generation) is not supported on a model with tp/cp > 1"
    local, cp = tokens.shape[1], layout.cp_size
    sequence = sequence_problem(local * cp, cp, layout.tp_size, layout.load_balance)  # the one rule
    if sequence:
        return f"{sequence} (cp_size={cp}: this rank holds {local} tokens)" if cp > 1 else sequence
    mask = kwargs.get("attention_mask")
    if mask is not None:
        problem = mask_shape_problem("attention_mask", mask, tokens.shape[0], tuple(dict.fromkeys((local, local * cp))))
        if problem:
            return problem
    labels = labels_problem(kwargs, local, cp)  # outputs.loss: ndparallel/models/hf/loss.py
    if labels:
        return labels
    return _positions_problem(layout, kwargs.get("position_ids"), local)


def _positions_problem(layout: InputLayout, positions: Any, local: int) -> str | None:
    """``position_ids`` must hold one position per token of this rank (its shard under cp)."""
    if positions is None or positions.shape[-1] == local:
        return None
    return (
        f"position_ids has {positions.shape[-1]} positions but this rank holds {local} tokens "
        f"(cp_size={layout.cp_size}): pass position_ids as a context_parallel buffer with the tokens "
        "(seq dim 1) so they are sharded alike, or omit them (ndparallel fills the rank's global positions)"
    )


def _whole_rows(layout: InputLayout, tensor: torch.Tensor | None, local: int) -> torch.Tensor | None:
    """``tensor`` ``[batch, seq]`` over the whole sequence: a rank's shard (``local`` long) gathered over cp."""
    if tensor is None or layout.cp_size == 1 or tensor.shape[-1] != local:
        return tensor
    return gather_sequence(tensor.contiguous(), -1, layout.cp_group, layout.load_balance)


def _same_in_group(layout: InputLayout, flags: list[bool]) -> bool:
    """Whether every rank of the cp group has the same optional inputs, so that all gather alike (an all-reduce)."""
    if layout.cp_size == 1:
        return True
    mine = torch.tensor([int(f) for f in flags], dtype=torch.int64)
    everyone = mine.clone()
    dist.all_reduce(everyone, group=layout.cp_group)
    return torch.equal(everyone, mine * layout.cp_size)


def document_mask(layout: InputLayout, tokens: torch.Tensor, kwargs: dict[str, Any]) -> DocumentMask | str | None:
    """The whole rows' mask of this batch (None: plain causal), or why it is refused. Collective over cp."""
    mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
    cu = {name: kwargs.get(name) for name in ("cu_seq_lens_q", "cu_seq_lens_k") if kwargs.get(name) is not None}
    has_mask, has_positions = mask is not None, positions is not None
    if not _same_in_group(layout, [has_mask, has_positions]):
        return (
            "the ranks of one cp group got different mask inputs (attention_mask / position_ids on some ranks "
            "only): shard every input of the batch with ndparallel.context_parallel on every rank"
        )
    if not (has_mask or has_positions or cu):
        return None
    batch, local = tokens.shape[0], tokens.shape[1]
    if has_positions:
        positions = _whole_rows(layout, positions.expand(batch, local), local)
    mask = _whole_rows(layout, mask, local) if has_mask else None
    try:
        documents = hf_document_mask(batch, local * layout.cp_size, mask, positions, cu)
    except ConfigError as err:
        return str(err)
    if documents is not None and mask is None and layout.ignores_packing:
        return (
            f"position_ids restart inside a row (packed documents), but model_type={layout.ignores_packing!r} builds "
            "its masks without position_ids, so one process attends across the documents while ndparallel would "
            "mask them apart: pad one document per row (attention_mask), or use tp_size=1 and cp_size=1"
        )
    return documents


def _local_padding(layout: InputLayout, mask: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor | None:
    """The 2-D padding mask of this rank's tokens (None if none was given; kept even without zeros, so that every
    rank of a batch hands the same inputs on). The attention takes the mask from ``ndparallel_documents``
    (transformers builds none for a registered attention); what still reads ``attention_mask`` is a mixture of
    experts' balancing loss, which must skip the padded tokens of its rows (and gathers them over dp x cp)."""
    if mask is None:
        return None
    if layout.cp_size > 1 and mask.shape[-1] != tokens.shape[1]:  # the whole rows: this rank's shard of them
        index = sequence_indices(mask.shape[-1], layout.cp_size, layout.cp_rank, layout.load_balance, mask.device)
        mask = mask.index_select(-1, index)
    return mask


def input_hook(layout: InputLayout):
    """The forward pre-hook (``with_kwargs=True``): refuse on every rank alike, then fill the inputs in."""

    def hook(_module, args, kwargs):
        agree(input_problem(layout, args, kwargs), "forward input refused", error_type=ConfigError)
        tokens = args[0] if args else kwargs["input_ids"]
        documents = document_mask(layout, tokens, kwargs)  # whole rows: gathered over cp, then reduced
        agree(documents if isinstance(documents, str) else None, "forward input refused", error_type=ConfigError)
        kwargs = {
            **kwargs,
            "attention_mask": _local_padding(layout, kwargs.get("attention_mask"), tokens),
            "use_cache": False,
        }
        if documents is not None:
            kwargs[DOCUMENTS_KWARG] = documents
        if kwargs.get("position_ids") is None:
            seq = tokens.shape[1] * layout.cp_size
            positions = sequence_indices(seq, layout.cp_size, layout.cp_rank, layout.load_balance, tokens.device)
            kwargs["position_ids"] = positions.unsqueeze(0)
        return args, kwargs

    return hook
