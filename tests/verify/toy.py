"""A user's own models for the verify tests: a tiny MLP language model with a TP plan, a wrong plan and
planted faults; and a tiny attention model (rotary positions, ndparallel's CoreAttention, so cp applies)
with two more planted faults: a norm left replicated on a tp-sharded activation (its weight gradient misses
the all-reduce over tp) and a rotary module that ignores the positions it is given (wrong under cp). Module
level: the rank processes import the factories by ``module:name``."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInputOutput, RowwiseParallel

from ndparallel.models import CoreAttention

VOCAB, DIM, HIDDEN = 64, 32, 64
HEAD_DIM = 8  # DIM / HEAD_DIM = 4 heads: tp=2 splits them


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


def _rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[batch, seq, heads, head_dim]`` at ``positions`` ``[seq]``."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=x.dtype) / half))
    angles = positions.to(x.dtype)[:, None] * inv_freq
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Rotary(nn.Module):
    """Rotates q or k by each token's position (the positions the forward is given: global under cp)."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return _rotate(x, positions)


class LocalRotary(Rotary):
    """The planted cp fault: ignores the positions it is given and numbers its own tokens 0..seq-1, right in
    one process, wrong on every cp rank (each holds a piece of the sequence)."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return _rotate(x, torch.arange(x.shape[1]))


class Attention(nn.Module):
    def __init__(self, local_positions: bool = False) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.rotary = LocalRotary() if local_positions else Rotary()
        self.core_attention = CoreAttention()  # the seam cp swaps for ring attention

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (proj(x).view(batch, seq, -1, HEAD_DIM) for proj in (self.wq, self.wk, self.wv))
        q, k = self.rotary(q, positions), self.rotary(k, positions)
        return self.wo(self.core_attention(q, k, v).reshape(batch, seq, -1))


class AttnBlock(nn.Module):
    def __init__(self, local_positions: bool = False) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.attention = Attention(local_positions)
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm(x), positions)
        return x + self.down(torch.tanh(self.up(x)))


class AttnToy(nn.Module):
    vocab_size = VOCAB

    def __init__(self, local_positions: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([AttnBlock(), AttnBlock(local_positions)])
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1]) if positions is None else positions
        h = self.embed(tokens)
        for block in self.layers:
            h = block(h, positions)
        return self.head(h)


def build_attn() -> AttnToy:
    return AttnToy()


def build_attn_local_positions() -> AttnToy:
    return AttnToy(local_positions=True)


ATTN_PLAN = {
    "layers.*.attention.wq": ColwiseParallel(),
    "layers.*.attention.wk": ColwiseParallel(),
    "layers.*.attention.wv": ColwiseParallel(),
    "layers.*.attention.wo": RowwiseParallel(),
    "layers.*.up": ColwiseParallel(),
    "layers.*.down": RowwiseParallel(),
}
# The planted norm fault: block 1's norm runs on its rank's tp shard of the sequence (as under sequence
# parallelism) but its weight stays a plain replicated tensor, so its gradient holds only this rank's tokens:
# the all-reduce over tp that SequenceParallel() would give it is missing. The forward is right.
NORM_FAULT_PLAN = {
    **ATTN_PLAN,
    "layers.1.norm": PrepareModuleInputOutput(
        input_layouts=(Replicate(),),
        desired_input_layouts=(Shard(1),),
        use_local_input=True,
        output_layouts=(Shard(1),),
        desired_output_layouts=(Replicate(),),
        use_local_output=True,
    ),
}


class Returns(Toy):
    """The toy whose forward hands its logits back another way (``how``): a dict or an object with ``logits``
    (accepted), a tuple, a dict without ``logits``, or ``[batch * seq, vocab]`` logits (refused)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, tokens: torch.Tensor):
        logits = super().forward(tokens)
        return {
            "dict": lambda: {"logits": logits},
            "object": lambda: SimpleNamespace(logits=logits),
            "tuple": lambda: (logits,),
            "scores": lambda: {"scores": logits},
            "flat": lambda: logits.flatten(0, 1),
        }[self.how]()


def build_frozen() -> Toy:
    return Toy().requires_grad_(False)
