"""The tensor/sequence-parallel table and FSDP units of any Hugging Face decoder, from its own ``base_model_tp_plan``.

The Linear entries come from the config's ``base_model_tp_plan`` (transformers' style names, prefixed with the
base model's attribute, ``model.``), each translated to an exact DTensor style or refused by name
(:data:`~ndparallel.models.hf.tp_translate.STYLES`, docs/huggingface.md has the table); the sequence-parallel
entries come from the decoder's structure::

    model.embed_tokens                     RowwiseParallel, output Shard(1)     (vocab split; seq-sharded output)
    model.layers.*.input_layernorm         SequenceParallel                      (every norm child of a block)
    model.layers.*.self_attn               GatherSequence: Shard(1) -> Replicate (a sublayer holding plan entries)
    model.layers.*.self_attn.{q,k,v}_proj  ColwiseParallel                       ("colwise")
    model.layers.*.self_attn.q_norm        PerShardNorm                          ("replicated_with_grad_allreduce")
    model.layers.*.self_attn.o_proj        RowwiseParallel, output Shard(1)      ("rowwise": the sublayer's exit)
    model.layers.*.mlp                     GatherSequence
    model.layers.*.mlp.down_proj           RowwiseParallel, output Shard(1)
    model.norm                             SequenceParallel, local output
    lm_head                                ColwiseParallel, input Shard(1), vocab-sharded DTensor logits

A sublayer whose projections all gather their outputs (``colwise_gather_output`` / ``rowwise_split_input``:
OLMo 2, Phi-3) computes replicated inside, so its other parameter-holding modules (OLMo 2's full-width
q/k norms) run as :class:`ReplicatedCompute`. Patterns follow :mod:`ndparallel.parallel.fqn`; base-plan
entries that match nothing in this instance (variants of the architecture) are left out. Tied word
embeddings: the embedding and ``lm_head`` both shard the vocabulary on dim 0, ``lm_head`` gets the
embedding's DTensor parameter back, and FSDP keeps both in the root unit. No ``transformers`` import.

This module assembles the plan and the FSDP units; each base-plan entry is translated (or refused) in
:mod:`ndparallel.models.hf.tp_translate`, and the model lookups (``is_hf_model``, ``expert_count``) live in
:mod:`ndparallel.models.hf.detect`.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from ndparallel.errors import ConfigError
from ndparallel.models.hf.detect import is_hf_model, is_norm, module_fqn, packed_experts
from ndparallel.models.hf.styles import GatherSequence, TiedColwiseParallel
from ndparallel.models.hf.tp_translate import (
    REFUSED,
    PlanContext,
    custom_plan_hint,
    linear_entries,
    prefixed_plan,
    unplaceable,
)
from ndparallel.parallel.fqn import fqn_matches
from ndparallel.parallel.protocol import block_list

__all__ = ["hf_fsdp_groups", "hf_tp_plan"]

# model types whose attention splits q/k/v by the config's global head count (``view(..., num_heads, head_dim)``,
# CodeGen's 4-way packed qkv_proj) instead of ``-1``: measured, a raw shape error on tp 2. Refused by name.
GLOBAL_HEAD_SPLIT = ("codegen", "gptj")


def _blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    found = block_list(model)
    if found is None:
        raise ConfigError(
            f"model_type={model.config.model_type!r}: {type(model).__name__} has no nn.ModuleList of decoder layers; "
            f"{custom_plan_hint(model)}"
        )
    return found


def _check_placeable(model: nn.Module, fqn: str, module: nn.Module, expected: type) -> None:
    """The embedding / lm_head entries shard a weight directly: the module must be that layer, not a wrapper."""
    if not isinstance(module, expected):
        inner = [f"{fqn}.{n}" for n, m in module.named_modules() if n and isinstance(m, expected)]
        where = f" (the {expected.__name__} inside it is {inner[0]!r})" if inner else ""
        raise unplaceable(model, fqn, module, f"it is not an nn.{expected.__name__}{where}")


def hf_tp_plan(
    model: nn.Module, overrides: Mapping[str, ParallelStyle | None] | None = None
) -> dict[str, ParallelStyle]:
    """The TP + SP table for a Hugging Face decoder, from its ``config.base_model_tp_plan`` (module docstring).

    Raises :class:`ConfigError` naming the module it cannot place (a wrapped ``lm_head``, a style ndparallel
    refuses or does not know, a parameter left unsharded) and for a config without a ``base_model_tp_plan``.
    ``overrides`` maps prefixed FQN patterns to the style to use instead of the translated one (``None``
    leaves the pattern out); it is how a model the translation refuses gets a plan (docs/huggingface.md).
    """
    if not is_hf_model(model):
        raise ConfigError(f"{type(model).__name__} is not a Hugging Face PreTrainedModel (no config.model_type)")
    return _derive_plan(model, dict(overrides or {}))


def _derive_plan(model: nn.Module, overrides: dict[str, ParallelStyle | None]) -> dict[str, ParallelStyle]:
    base = model.base_model
    prefix = module_fqn(model, base) or ""
    dot = f"{prefix}." if prefix else ""
    layers_name, layers = _blocks(model)
    layers_pattern = f"{layers_name}.*"
    if model.config.model_type in GLOBAL_HEAD_SPLIT and not overrides:
        attn = next((n for n, _ in layers[0].named_children() if "attn" in n), "attn")
        raise unplaceable(
            model,
            f"{layers_pattern}.{attn}",
            getattr(layers[0], attn, None),
            "its attention splits q/k/v by the global head count, not the rank's heads (a shape error on tp 2)",
        )
    if not overrides:
        _refuse_packed_experts(model)
    embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
    embedding_fqn = module_fqn(model, embedding)
    if embedding_fqn not in overrides:
        _check_placeable(model, embedding_fqn, embedding, nn.Embedding)

    plan: dict[str, ParallelStyle | None] = {
        embedding_fqn: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    }
    ctx = PlanContext(model, layers_pattern, embedding_fqn, module_fqn(model, output) if output is not None else None)
    linear = linear_entries(ctx, prefix, overrides)
    for name, child in layers[0].named_children():
        if is_norm(child):
            plan[f"{layers_pattern}.{name}"] = SequenceParallel(use_local_output=True)  # before or after a sublayer
        elif any(p.startswith(f"{layers_pattern}.{name}.") for p in linear):
            plan[f"{layers_pattern}.{name}"] = GatherSequence()
    plan.update(linear)
    for name, child in base.named_children():
        if child is not embedding and is_norm(child):
            plan[f"{dot}{name}"] = SequenceParallel(use_local_output=True)  # HF slices the output: keep it local
    if output is not None:
        output_fqn = module_fqn(model, output)
        if output_fqn not in overrides:
            _check_placeable(model, output_fqn, output, nn.Linear)
            head = dict(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
            tied = output.weight is embedding.weight
            plan[output_fqn] = TiedColwiseParallel(embedding, output, **head) if tied else ColwiseParallel(**head)
    plan.update(overrides)
    plan = {fqn: style for fqn, style in plan.items() if style is not None}
    _check_covered(model, plan)
    return plan


def _refuse_packed_experts(model: nn.Module, among: list[str] | None = None) -> None:
    """Name the MoE experts as the reason, before a router or shared expert the plan also cannot place
    (transformers 5.25's plans list no experts at all)."""
    experts = [fqn for fqn in packed_experts(model) if among is None or fqn in among]
    if not experts:
        return
    fqn, module = experts[0], model.get_submodule(experts[0])
    names = [fqn, *(f"{fqn}.{name}" for name, _ in module.named_parameters())]
    listed = [  # the plan's own style for the experts (5.24 lists every MoE's; 5.25 mostly none)
        kind
        for pattern, kind in prefixed_plan(model, module_fqn(model, model.base_model) or "").items()
        if any(fqn_matches(name, pattern) for name in names)
    ]
    if listed:
        why = f"its base_model_tp_plan style {listed[0]!r}: {REFUSED.get(listed[0], REFUSED['moe_tp_experts'])}"
    else:
        why = f"no entry covers it: {REFUSED['moe_tp_experts']}"
    raise unplaceable(model, fqn, module, why)


def _check_covered(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> None:
    """Every parameter must become a DTensor (foreach AdamW and clipping need one kind of tensor)."""
    missing = []
    for name, _ in model.named_parameters():
        owner = name.rpartition(".")[0]
        if not any(fqn_matches(owner, p) and not isinstance(s, GatherSequence) for p, s in plan.items()):
            missing.append(name)
    _refuse_packed_experts(model, [name.rpartition(".")[0] for name in missing])
    if missing:
        owner = missing[0].rpartition(".")[0]
        raise unplaceable(
            model,
            owner,
            model.get_submodule(owner),
            f"no entry covers it, so parameters {missing[:4]}{' ...' if len(missing) > 4 else ''} would stay "
            "unsharded (every parameter must become a DTensor for foreach optimizers and clipping)",
        )


def hf_fsdp_groups(model: nn.Module) -> list[list[str]]:
    """FSDP units besides the decoder layers: ``[[embedding], [final norm, lm_head]]``; tied embeddings
    stay in the root unit with the final norm (one parameter, one unit)."""
    try:
        embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return []  # no standard embedding accessors: everything outside the layers stays in the root unit
    prefix = module_fqn(model, model.base_model) or ""
    norms = [f"{prefix}.{n}".lstrip(".") for n, child in model.base_model.named_children() if is_norm(child)]
    if output is not None and _shares_a_parameter(output, embedding):  # also through a wrapper module
        return []
    head = norms + ([module_fqn(model, output)] if output is not None else [])
    return [[module_fqn(model, embedding)]] + ([head] if head else [])


def _shares_a_parameter(a: nn.Module, b: nn.Module) -> bool:
    ids = {id(p) for p in b.parameters()}
    return any(id(p) in ids for p in a.parameters())
