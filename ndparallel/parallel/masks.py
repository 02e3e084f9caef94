"""The one seam from the masks users have to ndparallel's one mask: a :class:`DocumentMask` over the whole row.

Inputs, as Hugging Face's SDPA and eager attention read them in one process (transformers 5), and as the
reference model takes them (docs/context-parallel.md#masks):

* ``attention_mask`` ``[batch, seq]`` of 0/1 (padding, left or right or anywhere): a key mask. transformers
  then ignores packing in ``position_ids`` (they only rotate), and so does this seam;
* ``position_ids`` ``[batch, seq]`` restarting per document (``DataCollatorWithFlattening``, TRL's packing and
  padding-free batches): a new document wherever a position is not its predecessor's + 1 (transformers'
  ``find_packed_sequence_indices``);
* ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (flash-attention's varlen boundaries over the flattened batch): checked
  against the row length and against ``position_ids``, which define the documents in one process;
* ``document_ids`` ``[batch, seq]`` (the reference model): equal ids attend each other; negative ids are padding.

Refused in one line each (:class:`ndparallel.errors.ConfigError`): any other mask (4-D, ``[seq, seq]``, values
other than 0/1: an arbitrary mask is neither padding nor documents), ``cu_seq_lens`` that disagree with the row
length or with ``position_ids``, or come without ``position_ids``.
"""

from __future__ import annotations

import torch

from ndparallel.distributed.documents import DocumentMask
from ndparallel.errors import ConfigError

__all__ = [
    "DOCUMENTS_KWARG",
    "FLASH_VARLEN_KWARGS",
    "document_ids_mask",
    "hf_document_mask",
    "mask_shape_problem",
    "packed_documents",
]

DOCUMENTS_KWARG = "ndparallel_documents"  # the keyword that carries a DocumentMask down an HF model to attention
# transformers' flash-attention varlen keywords: SDPA and eager attention ignore them in one process
FLASH_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")

_ARBITRARY = (
    "an arbitrary attention mask is neither padding nor packed documents: pass a 2-D [batch, seq] attention_mask "
    "of 0/1 (padding), position_ids restarting per document (packing), or document_ids"
)


def mask_shape_problem(name: str, mask: object, batch: int, lengths: tuple[int, ...]) -> str | None:
    """Why ``mask`` (``attention_mask`` or ``document_ids``) is not a ``[batch, seq]`` tensor with ``seq`` in
    ``lengths`` (the rank's tokens, or the whole sequence under cp), or ``attention_mask`` holds values other than
    0/1; None when it is fine."""
    if not isinstance(mask, torch.Tensor):
        return f"{name} must be a tensor, got {type(mask).__name__}"
    if mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] not in lengths:
        seq = " or ".join(map(str, lengths))
        return f"{name} of shape {list(mask.shape)} for {batch} rows of {seq} tokens: {_ARBITRARY}"
    if name == "attention_mask" and bool(((mask != 0) & (mask != 1)).any()):
        return (
            f"attention_mask holds values other than 0 and 1 ({sorted(set(mask.unique().tolist()))[:5]}...): "
            "transformers reads it as a padding mask (nonzero = real token), not as document ids; "
            f"{_ARBITRARY}"
        )
    return None


def packed_documents(position_ids: torch.Tensor) -> torch.Tensor | None:
    """``[batch, seq]`` document index of each token (a new document wherever a position is not its predecessor's
    + 1), or None when no row restarts: transformers' rule for packed sequences."""
    first = position_ids[:, :1] - 1
    starts = torch.diff(position_ids, prepend=first, dim=-1) != 1
    if not bool(starts[:, 1:].any()):
        return None
    return starts.long().cumsum(-1)


def _check_cu_seq_lens(name: str, cu: torch.Tensor, documents: torch.Tensor | None, batch: int, seq: int) -> None:
    """``cu`` must mark the same document starts over the flattened ``[batch * seq]`` tokens as ``documents``."""
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or bool((cu.diff() < 0).any()):
        raise ConfigError(f"{name}={_short(cu)} is not a rising 1-D list of document boundaries starting at 0")
    if int(cu[-1]) != batch * seq:
        raise ConfigError(
            f"{name} ends at {int(cu[-1])} but the batch holds {batch} x {seq} = {batch * seq} tokens: the "
            "boundaries do not describe this batch; rebuild them with its rows (DataCollatorWithFlattening does)"
        )
    starts = torch.zeros(batch * seq, dtype=torch.bool, device=cu.device)
    starts[cu[:-1].long()] = True
    starts.view(batch, seq)[:, 0] = True  # a row always starts a document
    expected = torch.ones(batch, seq, dtype=torch.bool, device=cu.device)
    if documents is not None:
        expected[:, 1:] = documents.diff(dim=-1).to(cu.device) != 0
    else:
        expected[:, 1:] = False
    if not torch.equal(starts.view(batch, seq), expected):
        raise ConfigError(
            f"{name} disagree with position_ids: transformers' SDPA and eager attention (one process) split "
            "documents where position_ids restart and ignore cu_seq_lens; make them mark the same documents, "
            "or drop cu_seq_lens"
        )


def _short(t: torch.Tensor) -> str:
    values = t.flatten()[:8].tolist()
    return f"{values}{'...' if t.numel() > 8 else ''}"


def hf_document_mask(
    batch: int,
    seq: int,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens: dict[str, torch.Tensor] | None = None,
) -> DocumentMask | None:
    """The mask transformers' SDPA / eager attention applies to this batch in one process (every tensor over the
    whole ``[batch, seq]`` rows), as a :class:`DocumentMask`; None: plain causal. ConfigError for bad input."""
    cu_seq_lens = {k: v for k, v in (cu_seq_lens or {}).items() if v is not None}
    if attention_mask is not None:
        problem = mask_shape_problem("attention_mask", attention_mask, batch, (seq,))
        if problem:
            raise ConfigError(problem)
    documents = None
    if position_ids is not None:
        documents = packed_documents(position_ids.expand(batch, seq))
    if cu_seq_lens:
        if position_ids is None:
            raise ConfigError(
                f"{' / '.join(cu_seq_lens)} without position_ids: transformers' SDPA and eager attention ignore "
                "cu_seq_lens and would attend across documents; pass position_ids restarting per document "
                "(DataCollatorWithFlattening does)"
            )
        for name, cu in cu_seq_lens.items():
            _check_cu_seq_lens(name, torch.as_tensor(cu), documents, batch, seq)
    if attention_mask is not None:  # transformers: a 2-D mask is padding, and packing is then not looked for
        return None if bool(attention_mask.all()) else DocumentMask.from_key_padding(attention_mask)
    return None if documents is None else DocumentMask(documents, documents)


def document_ids_mask(document_ids: torch.Tensor, batch: int, seq: int) -> DocumentMask:
    """The reference model's ``document_ids`` ``[batch, seq]`` as a mask; ConfigError if it is not that shape."""
    problem = mask_shape_problem("document_ids", document_ids, batch, (seq,))
    if problem:
        raise ConfigError(problem)
    if document_ids.is_floating_point():
        raise ConfigError(f"document_ids must be integers (one id per document), got {document_ids.dtype}")
    return DocumentMask.from_document_ids(document_ids)
