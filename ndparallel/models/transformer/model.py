"""A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP.

Module names are part of the public contract: tensor-parallel plans, FSDP wrapping and
context parallel address modules by these names (``*`` = layer index)::

    tok_embeddings                      nn.Embedding(vocab, dim)
    layers.*.attention_norm             nn.RMSNorm(dim)
    layers.*.attention.wq / wk / wv     nn.Linear(dim, heads * head_dim), kv heads for wk/wv
    layers.*.attention.core_attention   CoreAttention: softmax(q k^T) v, no parameters
    layers.*.attention.wo               nn.Linear(heads * head_dim, dim)
    layers.*.ffn_norm                   nn.RMSNorm(dim)
    layers.*.feed_forward.w1 / w3 / w2  SwiGLU: w2(silu(w1 x) * w3 x)
    layers.*.feed_forward               MoE instead when n_experts > 0 (router, experts, shared_experts: moe.py)
    norm                                nn.RMSNorm(dim)
    output                              OutputProjection(dim, vocab): an nn.Linear that, given labels,
                                        returns the loss instead of the logits

The model imports nothing from ndparallel's planners (only the loss rule, ``ndparallel.parallel.loss``): it is
parallelised from outside, the same way a user's own model is. ``core_attention`` is the one seam for attention variants
(context parallel swaps it for ring attention): any module with the same ``forward(q, k, v)``
contract (``[batch, seq, heads, head_dim]`` in and out, k/v possibly with fewer heads) fits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ndparallel.distributed.documents import DocumentMask
from ndparallel.distributed.regions import local_region
from ndparallel.distributed.ulysses import local_attention
from ndparallel.models.seed import name_seed
from ndparallel.models.transformer.moe import MoE, Router
from ndparallel.models.transformer.presets import TransformerConfig
from ndparallel.parallel.loss import cross_entropy_loss

__all__ = [
    "CoreAttention",
    "OutputProjection",
    "Transformer",
    "apply_rotary",
    "as_document_mask",
    "init_parameters",
    "rotary_tables",
]


def rotary_tables(
    head_dim: int, max_seq_len: int, theta: float, device=None, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape ``[max_seq_len, head_dim // 2]``, computed in ``dtype`` (fp32 or float64)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=dtype) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=dtype), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[batch, seq, heads, head_dim]`` by position; cos/sin are ``[(batch,) seq, head_dim/2]``.

    Computed in fp32 or wider (bf16 inputs are upcast, float64 stays float64), returned in ``x``'s dtype.
    """
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # type promotion lifts the products: no saved copies
    x1, x2 = x.to(torch.promote_types(x.dtype, torch.float32)).chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.type_as(x)


@torch.no_grad()
def init_parameters(module: nn.Module, cfg: TransformerConfig, seed: int | None = None) -> None:
    """Initialise ``module``'s parameters as the reference Transformer does, each from a generator seeded by
    ``(seed, its FQN)``: a module holding part of the model under the unsplit names (a pipeline stage) gets
    exactly the values the whole model gets. Norm weights 1; others normal(0, 0.02), the residual projections
    (``wo``, ``w2``) normal(0, 0.02 / sqrt(2 n_layers)). A DTensor parameter (a model built on meta and
    parallelised first) draws its full tensor and keeps its own region, so every layout holds one process's
    values (DTensor's own random ops would draw others). Routers' balancing state (bias, counts) restarts at zero:
    a stage built on meta holds uninitialised memory there until this runs."""
    seed = cfg.seed if seed is None else seed
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    for name, param in module.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        std = residual_std if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else 0.02
        local = param.to_local() if isinstance(param, DTensor) else param
        generator = torch.Generator(device=local.device).manual_seed(name_seed(seed, name))
        if local is param:
            param.normal_(0.0, std, generator=generator)
            continue
        full = torch.empty(param.shape, dtype=local.dtype, device=local.device).normal_(0.0, std, generator=generator)
        local.copy_(full[local_region(param)])
    for router in module.modules():
        if isinstance(router, Router):
            router.reset_buffers()


def as_document_mask(document_ids: torch.Tensor | DocumentMask | None, tokens: torch.Tensor) -> DocumentMask | None:
    """``document_ids`` ``[batch, seq]`` (one id per token of ``tokens``) as the attention's mask; a DocumentMask
    (prepared by context parallel's hook over the whole rows) as is. ValueError for ids of another shape."""
    if document_ids is None or isinstance(document_ids, DocumentMask):
        return document_ids
    if document_ids.shape != tokens.shape or document_ids.is_floating_point():
        raise ValueError(
            f"document_ids must be integers shaped like the tokens {list(tokens.shape)}, got "
            f"{document_ids.dtype} {list(document_ids.shape)}: one document id per token"
        )
    return DocumentMask.from_document_ids(document_ids)


class CoreAttention(nn.Module):
    """Causal scaled-dot-product attention on ``[batch, seq, heads, head_dim]`` tensors.

    k and v may carry fewer heads than q (grouped-query attention); they are repeated here. ``documents``
    (a :class:`~ndparallel.distributed.documents.DocumentMask`, from ``Transformer(document_ids=...)``) keeps
    each token's attention inside its own document; a row that sees no key (padding) outputs zeros.
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentMask | None = None
    ) -> torch.Tensor:
        if documents is not None:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            return local_attention(q, k, v, True, None, None, documents).transpose(1, 2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        repeats = q.shape[1] // k.shape[1]
        if repeats > 1:
            k = k.repeat_interleave(repeats, dim=1)
            v = v.repeat_interleave(repeats, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        dtype = cfg.torch_dtype
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False, dtype=dtype)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False, dtype=dtype)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False, dtype=dtype)
        self.core_attention = CoreAttention()
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False, dtype=dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents: DocumentMask | None = None
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds heads / tp of them.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # by keyword only when set: a user's attention module of the plain (q, k, v) contract keeps working
        out = self.core_attention(q, k, v) if documents is None else self.core_attention(q, k, v, documents=documents)
        return self.wo(out.reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False, dtype=cfg.torch_dtype)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False, dtype=cfg.torch_dtype)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False, dtype=cfg.torch_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps, dtype=cfg.torch_dtype)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps, dtype=cfg.torch_dtype)
        self.feed_forward = MoE(cfg) if cfg.is_moe else FeedForward(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents: DocumentMask | None = None
    ) -> torch.Tensor:
        # documents by keyword: the TP plan's PrepareModuleInput lays out the positional (x, cos, sin) only
        x = x + self.attention(self.attention_norm(x), cos, sin, documents=documents)
        return x + self.feed_forward(self.ffn_norm(x))


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross entropy of the logits ``x @ weight.T``: :func:`ndparallel.parallel.loss.cross_entropy_loss`'s
    rule (upcast to at least fp32, labels -100 ignored) on plain tensors."""
    return cross_entropy_loss(F.linear(x, weight), labels)


class OutputProjection(nn.Linear):
    """The output projection ``nn.Linear(dim, vocab, bias=False)``; ``forward(x, labels)`` returns the mean token
    cross entropy instead of the logits (labels -100 ignored, as ``F.cross_entropy``; refused under tensor parallel).

    The loss runs inside this module's forward, where FSDP has gathered the weight, so :meth:`compile_loss` can
    compile projection and cross entropy as one graph: the fp32 logits and their log-softmax are never written
    out (``compile: blocks`` does it; docs/parallelize.md#compile-blocks-and-the-loss-head).
    """

    def __init__(self, dim: int, vocab_size: int, dtype: torch.dtype | None = None):
        super().__init__(dim, vocab_size, bias=False, dtype=dtype)
        self._loss = linear_cross_entropy

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(x)
        if isinstance(self.weight, DTensor):  # tensor parallel: the vocab is sharded, this loss would be a shard's
            raise ValueError(
                "Transformer(tokens, labels=...) under tensor parallelism: the output projection is vocab-sharded; "
                "call the model without labels and take ndparallel.cross_entropy_loss(logits, labels)"
            )
        return self._loss(x, self.weight, labels)

    def compile_loss(self) -> None:
        """Compile the labels path (projection + cross entropy) as one ``fullgraph`` graph."""
        self._loss = torch.compile(linear_cross_entropy, fullgraph=True)

    @property
    def loss_compiled(self) -> bool:
        return self._loss is not linear_cross_entropy


class Transformer(nn.Module):
    """Decoder-only language model: ``forward(tokens[, positions]) -> logits`` (``labels=``: the loss).

    ``positions`` (``[seq]`` or ``[batch, seq]``, default ``0..seq-1``) index the rotary tables.
    ``document_ids`` (``[batch, seq]`` integers, optional): packed documents; a token attends only the earlier
    tokens of its own document, and a negative id marks padding (attends nothing, attended by nothing). Pass
    positions restarting per document with them if each document should rotate from 0. Under context parallel
    shard them like the tokens (a ``context_parallel`` buffer, seq dim 1): the planner's hook gathers them
    into the whole rows' mask (docs/context-parallel.md#masks).
    Under context parallel each rank holds a shard of the sequence and needs its tokens' global
    positions: pass them sharded like the tokens, or omit them inside ``ndparallel.context_parallel``
    (ndparallel's planner hooks this forward from outside and fills them; outside the block the call
    is refused). Parameters are created in ``cfg.dtype``. Weights are initialised from
    ``cfg.seed`` with a private generator per parameter (seeded by the seed and the parameter's name,
    :func:`init_parameters`), so two models built from one config are equal whatever the global RNG
    state, and a pipeline stage holding some blocks gets their values too. Built under
    ``torch.device("meta")`` nothing is allocated: call ``model.to_empty(device=...)`` then ``model.init_weights()``.
    """

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.config = cfg
        dtype = cfg.torch_dtype
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim, dtype=dtype)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps, dtype=dtype)
        self.output = OutputProjection(cfg.dim, cfg.vocab_size, dtype=dtype)
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, dtype=dtype)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if self.tok_embeddings.weight.device.type != "meta":
            self.init_weights()

    @property
    def loss_in_forward(self) -> bool:
        """True once ``compile: blocks`` compiled the loss head: a training step then passes ``labels`` to
        ``forward`` and gets the loss, so projection and cross entropy run as one graph."""
        return self.output.loss_compiled

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Deterministic init from ``seed`` (default ``config.seed``); also rebuilds the rotary tables."""
        cfg = self.config
        device = self.tok_embeddings.weight.device
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=device, dtype=cfg.torch_dtype)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        init_parameters(self, cfg, seed)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        document_ids: torch.Tensor | DocumentMask | None = None,
    ) -> torch.Tensor:
        """The logits ``[batch, seq, vocab]``; with ``labels`` ``[batch, seq]``, the mean token cross entropy
        computed by the output projection (:class:`OutputProjection`: one compiled graph under ``compile: blocks``).
        ``document_ids``: see the class doc (a prepared ``DocumentMask`` of the whole rows is taken as is).
        """
        if positions is None:
            seq = tokens.shape[1]
            if seq > self.config.max_seq_len:
                raise ValueError(f"sequence length {seq} exceeds model.max_seq_len={self.config.max_seq_len}")
            cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        documents = as_document_mask(document_ids, tokens)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin) if documents is None else layer(h, cos, sin, documents=documents)
        h = self.norm(h)
        # labels by keyword: TP styles' input hooks see positional inputs only, and would drop them
        return self.output(h) if labels is None else self.output(h, labels=labels)
