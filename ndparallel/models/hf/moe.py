"""Hugging Face mixtures of experts on a mesh: the balancing loss of the global batch, and expert parallelism.

transformers 5 runs every MoE family's routed experts through one module kind (``@use_experts_implementation``):
stacked 3-D weights, expert on dim 0 (``gate_up_proj``, ``down_proj``, gpt-oss's biases), called as
``experts(hidden [T, D], top_k_index [T, k], top_k_weights [T, k])`` and returning ``sum_k expert(x) * weight``.

- **Balancing loss.** With ``output_router_logits`` the causal LM adds ``router_aux_loss_coef x
  load_balancing_loss_func(router_logits, ...)`` to ``outputs.loss``, from this rank's tokens only: its token
  fractions are not the global batch's (the classic MoE bug). Under dp x cp > 1 :func:`install_global_router_loss`
  replaces that term by the same function of every rank's router logits, all-gathered with a gradient
  (:func:`ndparallel.distributed.reduce.all_gather_rows`): the model's own formula on the global batch, so the
  mean over ``dp_cp`` that FSDP takes is one process's loss and gradient. ``outputs.aux_loss`` is the global one.
- **Expert parallelism.** :func:`adapt_experts` gives an HF experts module the contract of
  :mod:`ndparallel.parallel.expert_parallel` (``n_experts``, a ``dispatcher`` seam, ``compute``): its forward
  sorts the (token, k) rows by expert, hands them to the dispatcher, and weights and sums the outputs as the HF
  forward does. ``compute`` runs transformers' own forward (eager, or grouped_mm where it has a kernel) on
  this rank's experts only, one expert per row and weight 1, so every family's expert math is its own.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ndparallel.distributed.mesh import Mesh
from ndparallel.distributed.reduce import all_gather_rows
from ndparallel.errors import ConfigError
from ndparallel.parallel.expert_parallel import expert_weight_names

__all__ = ["adapt_experts", "hf_moe_layers", "install_global_router_loss", "is_hf_experts"]


def is_hf_experts(module: nn.Module) -> bool:
    """A transformers experts module (its class wears ``@use_experts_implementation``)."""
    return all(hasattr(module, name) for name in ("num_experts", "is_concatenated", "has_gate", "config"))


def hf_moe_layers(model: nn.Module) -> list[nn.Module]:
    """The sparse MoE blocks of an HF model: the modules whose ``experts`` child is an HF experts module."""
    return [
        m for m in model.modules() if isinstance(getattr(m, "experts", None), nn.Module) and is_hf_experts(m.experts)
    ]


# ------------------------------------------------------------------------------------ balancing loss


def _balancing_loss(model: nn.Module) -> Callable[..., Any] | None:
    """The ``load_balancing_loss_func`` of the model's modeling module (34 families carry the same one); the
    class's own module, not that of a wrapper class FSDP derives from it."""
    for cls in type(model).__mro__:
        found = getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)
        if found is not None:
            return found
    return None


_BALANCING_ARGS = ("gate_logits", "num_experts", "top_k", "attention_mask")  # the function's (and its call's) order


def _cannot(model: nn.Module, why: str) -> ConfigError:
    return ConfigError(
        f"{type(model).__name__}'s router aux loss cannot be computed over the global batch ({why}): it would be this "
        "rank's alone, not one process's; pass output_router_logits=False, or use dp_shard_size x cp_size = 1"
    )


def _one_process_order(batch: int, local_seq: int, cp: int, load_balance: bool, ranks: int) -> torch.Tensor:
    """The index that puts one layer's router-logit rows, as gathered from the ``ranks`` dp x cp ranks (group order:
    cp innermost; each rank's ``batch`` rows x its ``local_seq`` positions), in one process's order: batch row by
    batch row, positions in sequence order. transformers sums the balancing loss in fp32, so only the same order
    gives the same value (another order moved it by one fp32 ulp, 2**-27 at 0.06, under cp)."""
    from ndparallel.parallel.context_parallel import sequence_indices  # the cp layout's one rule

    seq = local_seq * cp
    target = []
    for r in range(ranks):
        data_rank, positions = divmod(r, cp)[0], sequence_indices(seq, cp, r % cp, load_balance)
        rows = torch.arange(batch)[:, None] * seq + positions[None, :]  # [batch, local_seq] one-process rows
        target.append(data_rank * batch * seq + rows.reshape(-1))
    return torch.cat(target).argsort()


def _tokens_shape(args: tuple, kwargs: dict) -> tuple[int, int] | None:
    """(batch, this rank's sequence length) of the forward's input ids or embeddings."""
    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), args[0] if args else None):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[0]), int(value.shape[1])
    return None


def _global_router_loss_hook(group: dist.ProcessGroup, mask_position: int | None, cp: int, load_balance: bool):
    def hook(model: nn.Module, args: tuple, kwargs: dict, outputs: Any) -> Any:
        if not hasattr(outputs, "keys"):  # return_dict=False: a tuple whose aux loss cannot be told apart
            if kwargs.get("output_router_logits", getattr(model.config, "output_router_logits", False)):
                raise _cannot(model, "return_dict=False hides it in a tuple; keep return_dict=True")
            return outputs
        local, logits = getattr(outputs, "aux_loss", None), getattr(outputs, "router_logits", None)
        if local is None:
            return outputs
        balancing = _balancing_loss(model)
        if balancing is None or not isinstance(logits, tuple):
            raise _cannot(model, "no load_balancing_loss_func in its module")
        if not hasattr(model, "router_aux_loss_coef"):  # multimodal MoEs keep it in their text config
            raise _cannot(model, "its loss is not the causal LM's router_aux_loss_coef x load_balancing_loss_func")
        arguments = tuple(inspect.signature(balancing).parameters)
        if arguments[:4] != _BALANCING_ARGS:
            raise _cannot(model, f"its load_balancing_loss_func takes {arguments}")
        mask = kwargs.get("attention_mask")
        if mask is None and mask_position is not None and len(args) > mask_position:
            mask = args[mask_position]
        gathered = tuple(all_gather_rows(layer, group) for layer in logits)
        # flattened: each rank's rows in the logits' order, whatever each rank's padded length
        mask = None if mask is None else all_gather_rows(mask.reshape(-1), group).reshape(1, -1)
        shape = _tokens_shape(args, kwargs)
        ranks = dist.get_world_size(group)
        if cp > 1 and shape and all(g.dim() == 2 and g.shape[0] == ranks * shape[0] * shape[1] for g in gathered):
            order = _one_process_order(*shape, cp, load_balance, ranks).to(gathered[0].device)
            gathered = tuple(g[order] for g in gathered)
            mask = None if mask is None else mask[0, order.to(mask.device)].reshape(ranks // cp * shape[0], -1)
        total = balancing(gathered, model.num_experts, model.num_experts_per_tok, mask)
        if outputs.loss is not None:  # the model added coef x its local term: the same expression, swapped
            coef = model.router_aux_loss_coef
            outputs.loss = outputs.loss - coef * local.to(outputs.loss.device) + coef * total.to(outputs.loss.device)
        outputs.aux_loss = total
        return outputs

    return hook


def install_global_router_loss(model: nn.Module, mesh: Mesh) -> None:
    """Under dp x cp > 1, make an HF MoE causal LM's router aux loss (and its share of ``outputs.loss``) the
    global batch's; a no-op for a dense model or a single data rank. An aux loss the hook cannot recompute (a
    multimodal MoE's, a tuple output's, another function's) is refused at the forward that returns one."""
    if mesh.size("dp_cp") == 1:
        return
    # every MoE causal LM with a router aux loss, experts module of transformers 5 or not (DBRX, Doge)
    names = list(inspect.signature(model.forward).parameters)
    if "output_router_logits" not in names:  # no aux loss from the router logits (DeepSeek-V3: a bias balances)
        return
    mask_position = names.index("attention_mask") if "attention_mask" in names else None
    hook = _global_router_loss_hook(
        mesh["dp_cp"].get_group(), mask_position, mesh.size("cp"), mesh.config.cp_load_balance
    )
    model.register_forward_hook(hook, with_kwargs=True)


# ------------------------------------------------------------------------------------ expert parallel


class _LocalExperts:
    """An HF experts module seen with only some of its experts: transformers' forward runs on it as ``self``."""

    def __init__(self, experts: nn.Module, weights: dict[str, torch.Tensor], count: int):
        self.__dict__.update(_experts=experts, _weights=weights, num_experts=count)

    def __getattr__(self, name: str) -> Any:
        weights = self.__dict__["_weights"]
        return weights[name] if name in weights else getattr(self.__dict__["_experts"], name)


def _compute(experts: nn.Module) -> Callable[..., torch.Tensor]:
    forward = type(experts).forward  # transformers' implementation switch, then the family's expert math
    names = expert_weight_names(experts)

    def compute(rows: torch.Tensor, counts: list[int], *weights: torch.Tensor) -> torch.Tensor:
        """``counts[e]`` consecutive rows through local expert ``e``, unweighted (weight 1, one expert a row)."""
        local = len(counts)
        index = torch.repeat_interleave(
            torch.arange(local, device=rows.device), torch.tensor(counts, device=rows.device)
        )[:, None]
        out = forward(_LocalExperts(experts, dict(zip(names, weights, strict=True)), local), rows, index,
                      rows.new_ones(rows.shape[0], 1))  # fmt: skip
        # an expert no row reaches gets a zero gradient, as in one process (its stacked weight has one); and with
        # no rows at all (transformers' eager forward then returns fresh zeros) the rows stay in the graph, so this
        # rank runs the all-to-all's backward with the others
        anchor = rows.flatten()[:0].sum() + sum(w.flatten()[:0].sum() for w in weights)
        return out + anchor.to(out.dtype)

    return compute


def _routed_forward(experts: nn.Module) -> Callable[..., torch.Tensor]:
    def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        flat = top_k_index.reshape(-1)
        if flat.numel() and int(flat.max()) >= experts.n_experts:
            raise ConfigError(
                f"{type(experts).__name__} got an expert index >= its {experts.n_experts} experts: a router that "
                "masks experts (transformers' own expert parallel) cannot run under ndparallel's ep_size > 1"
            )
        order = flat.argsort(stable=True)  # rows sorted by expert, the router's order within one
        token = order // top_k_index.shape[-1]
        counts = torch.bincount(flat, minlength=experts.n_experts).tolist()
        rows = hidden[token]
        if experts.dispatcher is None:  # every expert is here
            out = experts.compute(rows, counts, *(getattr(experts, name) for name in expert_weight_names(experts)))
        else:
            out = experts.dispatcher(experts, rows, counts)
        out = out * top_k_weights.reshape(-1)[order, None]  # as transformers weights each expert's output
        return torch.zeros_like(hidden).index_add_(0, token, out.to(hidden.dtype))

    return forward


def adapt_experts(experts: nn.Module) -> None:
    """Give an HF experts module the expert-parallel contract (its FQNs and weights stay as they are). Refused: a
    parameter not stacked by expert (a submodule's, or one without the experts on dim 0), which ep would leave
    unsynchronised between the ep ranks."""
    own = dict(experts.named_parameters(recurse=False))
    odd = [n for n, _ in experts.named_parameters() if n not in own]
    odd += [n for n, p in own.items() if p.dim() == 0 or p.shape[0] != experts.num_experts]
    if odd:
        raise ConfigError(
            f"ep_size > 1 on {type(experts).__name__}: {odd[:3]} are not stacked by expert (dim 0 = its "
            f"{experts.num_experts} experts), so their copies on the ep ranks would drift apart; use ep_size=1"
        )
    experts.n_experts = experts.num_experts
    experts.compute = _compute(experts)
    experts.dispatcher = None
    experts.forward = _routed_forward(experts)
