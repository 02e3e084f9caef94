"""``torch.compile`` of the whole model or of each transformer block, in place (FQNs unchanged).

``nn.Module.compile()`` compiles the module's call in place instead of wrapping it in an
``OptimizedModule`` (whose ``_orig_mod.`` prefix would change every state-dict key).
Per-block compile keeps graphs small and reused across identical blocks; whole-model compile
sees across block boundaries. Per-block compile together with tensor/sequence parallelism
fails in AOT autograd on torch 2.13 (docs/parallelize.md, "Refused combinations"), so that
combination is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ndparallel.errors import ConfigError

__all__ = ["apply_compile", "check_compile"]


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
