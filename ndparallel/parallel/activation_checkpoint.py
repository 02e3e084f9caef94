"""Activation checkpointing per transformer block, keeping every parameter FQN unchanged.

``full`` recomputes every block's forward during backward (activation memory of one block
instead of all of them, ~one extra forward of compute); ``selective`` does it for every other
block (half the saving, half the recompute). The block's ``forward`` is routed through the
public ``torch.utils.checkpoint.checkpoint`` (non-reentrant) on the instance, so the module
tree, state-dict keys and FSDP/TP hooks on the block stay as they were.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["apply_activation_checkpointing"]


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(blocks: Sequence[nn.Module], mode: str) -> list[nn.Module]:
    """Checkpoint ``blocks`` (``full``: all, ``selective``: every other one, ``none``: no-op); return those changed."""
    if mode == "none":
        return []
    chosen = [b for i, b in enumerate(blocks) if mode == "full" or i % 2 == 0]
    for block in chosen:
        if getattr(block, "_ndp_checkpointed", False):
            continue
        block.forward = functools.partial(_checkpointed, block.forward)
        block._ndp_checkpointed = True
    return chosen
