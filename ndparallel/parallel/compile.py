"""``torch.compile`` of the whole model or of each transformer block, in place (FQNs unchanged).

``nn.Module.compile()`` compiles the module's call in place instead of wrapping it in an
``OptimizedModule`` (whose ``_orig_mod.`` prefix would change every state-dict key).
Per-block compile keeps graphs small and reused across identical blocks; whole-model compile
sees across block boundaries. Per-block compile together with tensor/sequence parallelism
fails in AOT autograd on torch 2.13 (docs/parallelize.md, "Refused combinations"), so that
combination is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ndparallel.errors import ConfigError

__all__ = ["apply_compile", "check_compile", "compiled_loss_head", "loss_head"]


def check_compile(mode: str, tp_size: int) -> None:
    """Raise :class:`ConfigError` for a compile mode that cannot work with this tensor-parallel size."""
    if mode == "blocks" and tp_size > 1:
        raise ConfigError(
            f"compile='blocks' with tp_size={tp_size} is not supported: per-block torch.compile of "
            "tensor/sequence-parallel blocks fails in AOT autograd; use compile='model' (whole model) or compile='none'"
        )


def apply_compile(model: nn.Module, blocks: Sequence[nn.Module], mode: str, tp_size: int = 1) -> nn.Module:
    """Compile ``model`` (``mode="model"``) or each of ``blocks`` (``mode="blocks"``); ``none`` is a no-op."""
    check_compile(mode, tp_size)
    if mode == "model":
        model.compile()
    elif mode == "blocks":
        for block in blocks:
            block.compile()
    return model


def loss_head(norm: nn.Module, output: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``(h, labels) -> loss``: the final norm, the output projection and the mean token cross-entropy on
    logits upcast to at least fp32 (float64 stays float64), as one function (what :func:`compiled_loss_head`
    compiles; the eager reference)."""

    def head(h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = output(norm(h))
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits.flatten(0, -2), labels.flatten())

    return head


def compiled_loss_head(norm: nn.Module, output: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """:func:`loss_head` in one compiled graph, so the fp32 logits and their log-softmax are never written out
    (docs/planning.md: 2e + 40 bytes per logit eager, 3e compiled). Tensor-parallel (DTensor) weights are refused:
    the vocab-parallel loss (``ndparallel.parallel.loss``) is not compiled with the head yet."""
    if any(isinstance(p, DTensor) for p in (*norm.parameters(), *output.parameters())):
        raise ConfigError(
            "compiled_loss_head: the output projection is tensor-parallel (DTensor weights); the vocab-parallel "
            "loss is not compiled with the head: use ndparallel.cross_entropy_loss on the model's logits instead"
        )
    return torch.compile(loss_head(norm, output), fullgraph=True)
