"""A pipeline stage of the reference Transformer: some of its blocks, under the unsplit model's names.

``layers`` is an ``nn.ModuleDict`` keyed by the original block index, so ``layers.5.attention.wq.weight``
has the same name on any pp size and in one process (TP tables, FSDP units and checkpoint keys keep
working). The first stage also holds ``tok_embeddings``, the last ``norm`` and ``output``; every stage
has the rotary tables. ``forward(x, positions, documents=None)``: ``x`` is tokens on the first stage, hidden
states elsewhere; ``positions`` is ``[batch, seq]`` (micro-batched with the tokens); ``documents`` is the
micro-batch's mask over the whole rows, ``[batch, 2, seq]`` query and key document ids
(:meth:`ndparallel.parallel.pipeline.Pipeline.step` builds it; docs/pipeline-parallel.md#masks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ndparallel.distributed.documents import DocumentMask
from ndparallel.models.transformer.model import Transformer, init_parameters, rotary_tables

__all__ = ["TransformerStage"]


class TransformerStage(nn.Module):
    """Blocks ``block_ids`` of ``model`` (their modules are shared, not copied: build ``model`` on meta)."""

    def __init__(self, model: Transformer, block_ids: Sequence[int], first: bool, last: bool):
        super().__init__()
        self.config = model.config
        self.first, self.last = first, last
        if first:
            self.tok_embeddings = model.tok_embeddings
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in block_ids})
        if last:
            self.norm = model.norm
            self.output = model.output
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """The values the whole Transformer gets from ``seed`` (default ``config.seed``), and the rotary tables."""
        cfg = self.config
        device = self.rope_cos.device
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=device, dtype=cfg.torch_dtype)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        init_parameters(self, cfg, seed)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        h = self.tok_embeddings(x) if self.first else x
        mask = None if documents is None else DocumentMask(documents[:, 0], documents[:, 1])
        for layer in self.layers.values():
            h = layer(h, cos, sin) if mask is None else layer(h, cos, sin, documents=mask)
        return self.output(self.norm(h)) if self.last else h
