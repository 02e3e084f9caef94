"""A user's own model for the verify tests: a tiny MLP language model with a TP plan, a wrong plan and
planted faults. Module level: the rank processes import the factories by ``module:name``."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Partial
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

VOCAB, DIM, HIDDEN = 64, 32, 64


class Center(nn.Module):
    """Subtracts the mean over batch and sequence: under dp or cp each rank takes the mean of its own
    piece, not of the global batch (the planted per-rank-mean fault)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(dim=(0, 1), keepdim=True)


class Block(nn.Module):
    def __init__(self, center: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.center = Center() if center else nn.Identity()
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.drop = nn.Dropout(dropout)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(torch.tanh(self.up(self.center(x)))))


class Toy(nn.Module):
    vocab_size = VOCAB

    def __init__(self, center: bool = False, dropout: float = 0.0, fp32_inside: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block(), Block(center=center, dropout=dropout)])
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.fp32_inside = fp32_inside

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.layers:
            h = block(h)
        if self.fp32_inside:  # like a Gemma norm in fp32: the weight gradient sums over the batch in fp32
            return torch.nn.functional.linear(h.float(), self.head.weight.float()).to(h.dtype)
        return self.head(h)


def build() -> Toy:
    return Toy()


def build_centered() -> Toy:
    return Toy(center=True)


def build_with_dropout() -> Toy:
    return Toy(dropout=0.1)


def build_fp32_inside() -> Toy:
    return Toy(fp32_inside=True)


def build_failing() -> Toy:
    raise RuntimeError("weights file missing")


def build_flat() -> nn.Module:
    return nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB))


PLAN = {"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()}
# The planted TP fault: block 1's down projection keeps its partial sums (no all-reduce over tp).
WRONG_PLAN = {
    "layers.*.up": ColwiseParallel(),
    "layers.0.down": RowwiseParallel(),
    "layers.1.down": RowwiseParallel(output_layouts=Partial()),
}
# A plan that cannot run: down expects the full hidden width, up hands it a tp shard (a shape error).
BROKEN_PLAN = {"layers.*.up": ColwiseParallel(), "layers.*.down": ColwiseParallel()}
