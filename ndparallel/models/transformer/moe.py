"""The reference mixture-of-experts feed-forward: a router, routed experts (dropless), shared experts.

Module names (under ``layers.*.feed_forward`` of an MoE :class:`~ndparallel.models.transformer.model.Transformer`)::

    router.gate                      nn.Linear(dim, n_experts): one logit per expert
    router.expert_bias               buffer [n_experts] (sigmoid router only): added to the scores for the choice
    router.tokens_per_expert         non-persistent buffer [n_experts]: global tokens per expert since the last
                                     :func:`update_router_biases` (training forwards only; :func:`router_loads`)
    router.nonfinite_logits          non-persistent buffer []: training forwards since then whose router logits
                                     held a NaN/inf (:func:`nonfinite_routers` names them when a step diverges)
    experts.w1 / w3                  [n_experts, expert_ffn_dim, dim]   stacked SwiGLU weights, expert on dim 0
    experts.w2                       [n_experts, dim, expert_ffn_dim]
    shared_experts.w1 / w3 / w2      nn.Linear: one SwiGLU MLP of width n_shared_experts x expert_ffn_dim

Two seams, each an attribute a planner sets from outside (the model imports no planner):

- ``MoE.reduce_counts(counts) -> counts``: the tokens per expert of this rank's batch, summed over every rank that
  holds other tokens of the same global batch (dp and cp). The load-balancing loss uses the token fractions of the
  *global* batch, so that it equals one process (a per-rank fraction is the classic MoE bug). None: one process.
- ``GroupedExperts.dispatcher(experts, x_sorted, counts) -> y_sorted``: how the rows, sorted by expert, reach the
  experts. None: every expert is here, a plain loop (:meth:`GroupedExperts.compute`). Expert parallelism
  sends them by all-to-all to the ranks that own their experts (``ndparallel.parallel.expert_parallel``).

Each rank's loss is ``aux_loss_coef * n_experts * sum_e f_e * P_e + z_loss_coef * mean(logsumexp(logits)^2)``, with
``f_e`` the global token fraction (not differentiable) and ``P_e`` the rank's mean router probability: its mean
over equal-sized ranks is exactly the one-process loss, value and gradient. It is left in ``MoE.aux_loss`` after
each forward; :func:`ndparallel.parallel.loss.auxiliary_loss` collects it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GroupedExperts", "MoE", "Router", "nonfinite_routers", "router_loads", "update_router_biases"]


class Router(nn.Module):
    """Top-k routing: ``softmax`` (renormalised over the chosen k) or ``sigmoid`` with a choice-only bias."""

    def __init__(self, dim: int, n_experts: int, top_k: int, kind: str, dtype: torch.dtype):
        super().__init__()
        self.top_k, self.kind = top_k, kind
        self.gate = nn.Linear(dim, n_experts, bias=False, dtype=dtype)
        if kind == "sigmoid":
            self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=dtype))
        self.register_buffer("tokens_per_expert", torch.zeros(n_experts, dtype=torch.float64), persistent=False)
        self.register_buffer("nonfinite_logits", torch.zeros((), dtype=torch.int64), persistent=False)

    def reset_buffers(self) -> None:
        if self.kind == "sigmoid":
            self.expert_bias.zero_()
        self.tokens_per_expert.zero_()
        self.nonfinite_logits.zero_()

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(probs [N, E], indices [N, k], weights [N, k])`` from router logits (fp32 or wider); ``probs`` are the
        per-token expert probabilities the balancing loss averages."""
        if self.kind == "softmax":
            probs = logits.softmax(dim=-1)
            weights, indices = probs.topk(self.top_k, dim=-1)
        else:
            scores = logits.sigmoid()
            indices = (scores + self.expert_bias.to(scores.dtype)).topk(self.top_k, dim=-1).indices
            weights = scores.gather(1, indices)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        return probs, indices, weights / weights.sum(dim=-1, keepdim=True)


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``counts[e]`` consecutive rows of ``x`` times ``weight[e].T``, for every expert in one grouped GEMM.

    Private torch API, isolated here: ``torch._grouped_mm`` (torch 2.8+) is torch's only grouped GEMM (CUDA bf16
    on Hopper; a CPU kernel in fp32/bf16; none in float64). Its CPU backward fails on a gradient with zero
    strides (an expanded ``sum()``), so the output hands back a contiguous gradient.
    """
    offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    return _ContiguousGrad.apply(torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets))


class _ContiguousGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts as stacked 3-D weights (expert on dim 0): run as a plain loop (``impl="loop"``:
    any dtype, CPU and float64) or as three grouped GEMMs (``impl="grouped_mm"``: :func:`grouped_matmul`)."""

    def __init__(self, dim: int, hidden: int, n_experts: int, dtype: torch.dtype, impl: str = "loop"):
        super().__init__()
        self.n_experts, self.impl = n_experts, impl
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim, dtype=dtype))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden, dtype=dtype))
        self.dispatcher: Callable[[GroupedExperts, torch.Tensor, list[int]], torch.Tensor] | None = None

    def forward(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows sorted by expert, ``counts[e]`` of them for expert ``e``: the experts' outputs in the same order."""
        if self.dispatcher is not None:
            return self.dispatcher(self, x_sorted, counts)
        return self.compute(x_sorted, counts, self.w1, self.w3, self.w2)

    def compute(
        self, x: torch.Tensor, counts: list[int], w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
    ) -> torch.Tensor:
        """``counts[e]`` consecutive rows through expert ``e`` of the stacked weights (every expert runs, with zero
        rows if none reach it, so each has a gradient)."""
        if self.impl == "grouped_mm":
            hidden = F.silu(grouped_matmul(x, w1, counts)) * grouped_matmul(x, w3, counts)
            return grouped_matmul(hidden, w2, counts)
        outs = []
        for e, rows in enumerate(x.split(counts)):
            hidden = F.silu(rows @ w1[e].transpose(0, 1)) * (rows @ w3[e].transpose(0, 1))
            outs.append(hidden @ w2[e].transpose(0, 1))
        return torch.cat(outs)


class SharedExperts(nn.Module):
    """The shared experts, one SwiGLU MLP every token passes through."""

    def __init__(self, dim: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False, dtype=dtype)
        self.w3 = nn.Linear(dim, hidden, bias=False, dtype=dtype)
        self.w2 = nn.Linear(hidden, dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Routed experts (dropless: every token reaches its top-k experts) plus optional shared experts."""

    def __init__(self, cfg) -> None:
        super().__init__()
        dtype = cfg.torch_dtype
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.aux_loss_coef, self.z_loss_coef = cfg.aux_loss_coef, cfg.z_loss_coef
        self.router = Router(cfg.dim, cfg.n_experts, cfg.top_k, cfg.router, dtype)
        self.experts = GroupedExperts(cfg.dim, cfg.expert_ffn_dim, cfg.n_experts, dtype, cfg.experts_impl)
        shared = cfg.n_shared_experts * cfg.expert_ffn_dim
        self.shared_experts = SharedExperts(cfg.dim, shared, dtype) if shared else None
        self.reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router.gate(flat)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        probs, indices, weights = self.router(logits)
        local_counts = torch.bincount(indices.flatten(), minlength=self.n_experts)
        counts = local_counts.to(torch.float64)
        if self.reduce_counts is not None:
            counts = self.reduce_counts(counts)
        if self.training:  # the balancing bias and the progress line's imbalance read them after the step
            self.router.tokens_per_expert += counts
            self.router.nonfinite_logits += (~torch.isfinite(logits.detach())).any()  # no sync: read on divergence
        self.aux_loss = self._aux_loss(logits, probs, counts)
        order = indices.flatten().argsort(stable=True)  # slots sorted by expert, the router's order within one
        token = order // self.top_k
        y = self.experts(flat[token], local_counts.tolist())
        y = y * weights.flatten()[order, None].to(y.dtype)
        out = torch.zeros_like(flat).index_add(0, token, y.to(flat.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view_as(x)

    def _aux_loss(self, logits: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        loss = logits.new_zeros(())
        if self.aux_loss_coef:
            fractions = (counts / counts.sum()).to(probs.dtype)  # of the global batch: no gradient
            loss = loss + self.aux_loss_coef * self.n_experts * (fractions * probs.mean(dim=0)).sum()
        if self.z_loss_coef:
            loss = loss + self.z_loss_coef * torch.logsumexp(logits, dim=-1).square().mean()
        return loss


def router_loads(model: nn.Module) -> list[torch.Tensor]:
    """Each router's tokens per expert (float64 copies, in module order) counted by the training forwards since
    the last :func:`update_router_biases`: of the global batch (the counts are reduced over dp x cp, as the
    balancing loss's are), so every rank holds the same numbers. Empty for a model without routers."""
    return [m.tokens_per_expert.clone() for m in model.modules() if isinstance(m, Router)]


def nonfinite_routers(model: nn.Module) -> list[str]:
    """The FQNs of the routers whose logits held a NaN or inf in a training forward since the last
    :func:`update_router_biases` (this rank's; reading them waits for the device)."""
    return [name for name, m in model.named_modules() if isinstance(m, Router) and int(m.nonfinite_logits)]


@torch.no_grad()
def update_router_biases(model: nn.Module, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: after an optimizer step, move each sigmoid router's
    ``expert_bias`` by ``rate`` towards its under-loaded experts (``+rate`` below the mean load, ``-rate`` above),
    from the global tokens per expert counted since the last call; then reset every router's counts (``rate``
    0: only the reset, of the non-finite flags too). Every rank moves its replica of the bias by the same global
    counts."""
    for module in model.modules():
        if isinstance(module, Router):
            load = module.tokens_per_expert
            if module.kind == "sigmoid" and rate:
                module.expert_bias += (rate * torch.sign(load.mean() - load)).to(module.expert_bias.dtype)
            load.zero_()
            module.nonfinite_logits.zero_()
