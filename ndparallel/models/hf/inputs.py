"""Forward inputs of a Hugging Face model under tp/cp: refused alike on every rank, positions filled in.

:func:`apply_hf_attention <ndparallel.models.hf.attention.apply_hf_attention>` installs :func:`input_hook` as a
forward pre-hook on the model. It refuses what the sharded attention cannot honour (padding masks, a KV
cache, ``inputs_embeds``, a sequence the mesh cannot split, labels or positions not sharded like the
tokens), turns the KV cache off, and fills ``position_ids`` with this rank's global positions (the rank's
shard under cp; under sequence parallel the local sequence would otherwise number tokens ``0..seq/tp``).
Refusals are collective (:func:`ndparallel.distributed.agree.agree`: one all-reduce of a flag vector per
forward): a rank that sees padding and one that does not raise the same ConfigError, instead of one rank
raising while the others block in FSDP's next collective. Two refusals keep the full causal attention exact:
a sequence longer than the model's sliding window, and ``position_ids`` that restart (packed documents).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ndparallel.config.sequence import sequence_problem
from ndparallel.distributed.agree import agree
from ndparallel.errors import ConfigError
from ndparallel.models.hf.loss import labels_problem
from ndparallel.parallel.context_parallel import sequence_indices

__all__ = ["InputLayout", "input_hook", "input_problem"]


@dataclass(frozen=True)
class InputLayout:
    """How this rank's inputs are cut: tp splits each rank's tokens (sequence parallel), cp the sequence."""

    tp_size: int
    cp_size: int
    cp_rank: int
    load_balance: bool
    window: int | None = None  # the model's shortest sliding window: longer sequences are refused


def input_problem(layout: InputLayout, args: tuple, kwargs: dict[str, Any]) -> str | None:
    """Why this rank's forward inputs cannot run under tp/cp, or None."""
    if len(args) > 1:
        return "pass attention_mask / position_ids as keywords to a model parallelised by ndparallel"
    tokens = args[0] if args else kwargs.get("input_ids")
    if tokens is None:
        return "tp/cp need input_ids (inputs_embeds bypass the sharded embedding); pass input_ids"
    mask = kwargs.get("attention_mask")
    if mask is not None and (mask.dim() != 2 or not bool(mask.all())):
        return (
            "attention_mask with padding is not supported under tp/cp (the attention is full causal): "
            "pack sequences without padding and pass attention_mask=None"
        )
    if kwargs.get("use_cache"):
        return "use_cache=True (KV cache, generation) is not supported on a model with tp/cp > 1"
    local, cp = tokens.shape[1], layout.cp_size
    sequence = sequence_problem(local * cp, cp, layout.tp_size, layout.load_balance)  # the one rule
    if sequence:
        return f"{sequence} (cp_size={cp}: this rank holds {local} tokens)" if cp > 1 else sequence
    labels = labels_problem(kwargs, local, cp)  # outputs.loss: ndparallel/models/hf/loss.py
    if labels:
        return labels
    if layout.window is not None and local * cp > layout.window:
        return (
            f"sequence length {local * cp} is longer than the model's sliding_window={layout.window}: "
            "ndparallel's tp/cp attention is full causal, exact only up to the window; use sequences <= "
            f"{layout.window}, or tp_size=1 and cp_size=1"
        )
    return _positions_problem(layout, kwargs.get("position_ids"), local)


def _positions_problem(layout: InputLayout, positions: Any, local: int) -> str | None:
    """``position_ids`` must be this rank's shard of one ``arange`` per row (any offset): positions that restart
    or skip make transformers mask packed documents apart, which the full causal attention would ignore."""
    if positions is None:
        return None
    cp = layout.cp_size
    if positions.shape[-1] != local:
        return (
            f"position_ids has {positions.shape[-1]} positions but this rank holds {local} tokens "
            f"(cp_size={cp}): pass position_ids as a context_parallel buffer with the tokens "
            "(seq dim 1) so they are sharded alike, or omit them (ndparallel fills the rank's global positions)"
        )
    expected = sequence_indices(local * cp, cp, layout.cp_rank, layout.load_balance, positions.device)
    offsets = positions.reshape(-1, local) - expected
    if bool((offsets != offsets[:, :1]).any()):
        return (
            "position_ids restart or skip inside a row (packed sequences: transformers would mask the documents "
            "apart), but ndparallel's tp/cp attention is full causal over the row: pass one arange per row "
            "(or omit position_ids), one document per row, or use tp_size=1 and cp_size=1"
        )
    return None


def input_hook(layout: InputLayout):
    """The forward pre-hook (``with_kwargs=True``): refuse on every rank alike, then fill the inputs in."""

    def hook(_module, args, kwargs):
        agree(input_problem(layout, args, kwargs), "forward input refused", error_type=ConfigError)
        tokens = args[0] if args else kwargs["input_ids"]
        kwargs = {**kwargs, "attention_mask": None, "use_cache": False}
        if kwargs.get("position_ids") is None:
            seq = tokens.shape[1] * layout.cp_size
            positions = sequence_indices(seq, layout.cp_size, layout.cp_rank, layout.load_balance, tokens.device)
            kwargs["position_ids"] = positions.unsqueeze(0)
        return args, kwargs

    return hook
