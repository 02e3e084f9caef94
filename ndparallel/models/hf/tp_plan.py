"""The tensor/sequence-parallel table and FSDP units of any Hugging Face decoder, from its own ``base_model_tp_plan``.

The Linear entries come from the config's ``base_model_tp_plan`` (transformers' style names, prefixed with the
base model's attribute, ``model.``), each translated to an exact DTensor style or refused by name
(:data:`STYLES`, docs/huggingface.md has the table); the sequence-parallel entries come from the decoder's
structure::

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
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from ndparallel.errors import ConfigError
from ndparallel.models.hf.styles import GatherSequence, PerShardNorm, ReplicatedCompute, TiedColwiseParallel
from ndparallel.parallel.family import block_list
from ndparallel.parallel.fqn import fqn_matches, matching_modules

__all__ = ["REFUSED", "STYLES", "expert_count", "hf_fsdp_groups", "hf_tp_plan", "is_hf_model"]

# transformers' style name -> what ndparallel does with it (docs/huggingface.md, "The style table")
STYLES = {
    "colwise": "ColwiseParallel: output features sharded, local output",
    "rowwise": "RowwiseParallel, output reduce-scattered to sequence shards (the sublayer's exit)",
    "colwise_gather_output": "ColwiseParallel, output all-gathered (replicated compute after it)",
    "rowwise_split_input": "RowwiseParallel on a replicated input, output reduce-scattered to sequence shards",
    "replicated_with_grad_allreduce": "PerShardNorm: replicated weight over each rank's heads, gradient summed",
    "embedding_rowwise": "the input embedding: vocab-parallel, seq-sharded output; inside a sublayer: "
    "vocab-parallel, replicated output",
    "embedding_colwise": "the input embedding: placed vocab-parallel as above; inside a sublayer: "
    "dim-sharded, gathered output",
    "replicate": "the input embedding: placed vocab-parallel; inside a gathered sublayer: ReplicatedCompute",
}
# transformers' style name -> why ndparallel refuses it (each names the module and the way out when raised)
REFUSED = {
    "moe_tp_experts": "tensor parallel of fused MoE experts is not implemented (shard the experts by expert "
    "parallel instead, ep_size: docs/expert-parallel.md)",
    "moe_identity_expert": "it belongs to MoE tensor parallel of the experts, which is not implemented",
    "packed_colwise": "packed 3-D expert weights belong to MoE tensor parallel, which is not implemented",
    "packed_rowwise": "packed 3-D expert weights belong to MoE tensor parallel, which is not implemented",
    "mla_kv_a_proj": "MLA's shared rope key (kv_a_proj_with_mqa) needs a gradient all-reduce of one output "
    "slice that ndparallel does not implement",
    "local_params": "bare parameters sharded with the heads (attention sinks) are not translated",
    "unit_colwise": "replicating whole heads over a sub-mesh when the heads do not divide tp (transformers' unit "
    "mesh) is not translated",
    "unit_rowwise": "replicating whole heads over a sub-mesh when the heads do not divide tp (transformers' unit "
    "mesh) is not translated",
    "all_reduce": "a module summing partial outputs of rowwise children conflicts with ndparallel's "
    "reduce-scatter to sequence shards",
}
# model types whose attention splits q/k/v by the config's global head count (``view(..., num_heads, head_dim)``,
# CodeGen's 4-way packed qkv_proj) instead of ``-1``: measured, a raw shape error on tp 2. Refused by name.
GLOBAL_HEAD_SPLIT = ("codegen", "gptj")
_MOE_FIRST = ("moe_tp_experts", "moe_identity_expert", "mla_kv_a_proj")  # the refusal that names the real reason
_GATHERED = {"colwise_gather_output", "rowwise_split_input", "replicate", "embedding_rowwise", "embedding_colwise"}
_ROWWISE = {"rowwise", "rowwise_split_input"}


def is_hf_model(model: nn.Module) -> bool:
    """True for a ``transformers`` PreTrainedModel (duck-typed: no import of transformers)."""
    config = getattr(model, "config", None)
    return isinstance(getattr(config, "model_type", None), str) and hasattr(model, "base_model_prefix")


def _custom_plan_hint(model: nn.Module) -> str:
    return (
        f"pass tp_plan={{fqn_pattern: ParallelStyle}} to ndparallel.parallelize for {type(model).__name__} (start from "
        "ndparallel.hf.hf_tp_plan(model, overrides={fqn: style})), with "
        "blocks=[fqn, ...] and fsdp_groups=[[fqn, ...], ...] where the defaults do not fit "
        "(docs/huggingface.md#another-architecture-pass-a-plan), or use tp_size=1"
    )


def _unplaceable(model: nn.Module, fqn: str, module: nn.Module | None, why: str) -> ConfigError:
    """The refusal when the plan cannot place ``fqn``: names the model type, the module, its class and the way out."""
    kind = f" ({type(module).__name__})" if module is not None else ""
    return ConfigError(
        f"model_type={model.config.model_type!r}: the Hugging Face plan cannot place {fqn!r}{kind}: {why}; "
        f"{_custom_plan_hint(model)}"
    )


def _fqn(model: nn.Module, module: nn.Module | None) -> str | None:
    for name, mod in model.named_modules():
        if mod is module:
            return name
    return None


def _is_norm(module: nn.Module) -> bool:
    """A leaf module whose parameters are a 1-D ``weight`` and maybe a 1-D ``bias`` (RMSNorm, LayerNorm)."""
    params = dict(module.named_parameters())
    if list(module.children()) or "weight" not in params or not set(params) <= {"weight", "bias"}:
        return False
    return all(p.dim() == 1 for p in params.values())


def _blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    found = block_list(model)
    if found is None:
        raise ConfigError(
            f"model_type={model.config.model_type!r}: {type(model).__name__} has no nn.ModuleList of decoder layers; "
            f"{_custom_plan_hint(model)}"
        )
    return found


class _Context:
    """What translating one entry needs to know about the model."""

    def __init__(self, model: nn.Module, layers_pattern: str, embedding_fqn: str, output_fqn: str | None):
        self.model = model
        self.layers_pattern = layers_pattern
        self.structural = {embedding_fqn, output_fqn}
        self.depth = len(layers_pattern.split("."))

    def sublayer(self, fqn: str) -> str | None:
        """``layers.*.<sub>`` for an entry inside a decoder layer's child, else None."""
        atoms = fqn.split(".")
        if len(atoms) < self.depth + 2 or not fqn.startswith(f"{self.layers_pattern}."):
            return None
        return ".".join(atoms[: self.depth + 1])


def _prefixed_plan(model: nn.Module, prefix: str) -> dict[str, str]:
    """The config's ``base_model_tp_plan`` (empty if none) with its patterns prefixed by the base model's FQN."""
    hf_plan = getattr(model.config, "base_model_tp_plan", None) or {}
    return {f"{prefix}.{pattern}" if prefix else pattern: kind for pattern, kind in hf_plan.items()}


def _base_plan(model: nn.Module, prefix: str, overrides: Mapping) -> dict[str, str]:
    plan = _prefixed_plan(model, prefix)
    if not plan and not overrides:
        raise ConfigError(
            f"model_type={model.config.model_type!r} has no base_model_tp_plan in its transformers config, so "
            f"there is no tensor-parallel plan to translate; {_custom_plan_hint(model)}"
        )
    return plan


def _matches(model: nn.Module, pattern: str) -> tuple[nn.Module | None, bool]:
    """The first module ``pattern`` matches, and whether it matches a parameter instead."""
    module = next((m for _, m in matching_modules(model, pattern)), None)
    is_param = module is None and any(fqn_matches(name, pattern) for name, _ in model.named_parameters())
    return module, is_param


def _refuse_first(model: nn.Module, plan: dict[str, str]) -> None:
    """Raise for the first refused style, MoE / MLA first (their reason is the real one), naming the module."""
    ranked = sorted(plan.items(), key=lambda kv: kv[1] not in _MOE_FIRST)
    for fqn, kind in ranked:
        module, is_param = _matches(model, fqn)
        if module is None and not is_param:
            continue
        if kind in ("packed_colwise", "packed_rowwise") and isinstance(module, nn.Linear):
            raise _unplaceable(
                model,
                fqn,
                module,
                f"{kind!r} on an nn.Linear is not translated (each rank would "
                "need its slice of every packed part); its colwise_gather_output translation, "
                "ColwiseParallel(output_layouts=Replicate()), is exact",
            )
        if kind in REFUSED:
            raise _unplaceable(model, fqn, module, f"its base_model_tp_plan style {kind!r}: {REFUSED[kind]}")
        if kind not in STYLES:
            raise _unplaceable(
                model,
                fqn,
                module,
                f"its base_model_tp_plan style {kind!r} is unknown to ndparallel (known: "
                f"{sorted(STYLES)}; refused: {sorted(REFUSED)})",
            )
        if is_param:
            raise _unplaceable(model, fqn, None, f"{kind!r} on a bare parameter: ndparallel places modules")


def _translate(ctx: _Context, fqn: str, kind: str, module: nn.Module, gathered: bool) -> ParallelStyle | None:
    """One base-plan entry as a DTensor style (None: nothing to do), or a ConfigError naming it."""
    model = ctx.model
    if fqn in ctx.structural:
        return None  # the input embedding / lm_head: ndparallel's own placement (exact for every style here)
    sub = ctx.sublayer(fqn)
    if sub is None:
        raise _unplaceable(
            model,
            fqn,
            module,
            f"{kind!r} outside a decoder layer's sublayer: the sequence-parallel table has no place for it",
        )
    if kind in ("colwise", "colwise_gather_output", "rowwise", "rowwise_split_input"):
        if not isinstance(module, nn.Linear):
            raise _unplaceable(model, fqn, module, f"{kind!r} shards an nn.Linear, and this is not one")
    if kind == "colwise":
        return ColwiseParallel()
    if kind == "colwise_gather_output":
        return ColwiseParallel(output_layouts=Replicate())
    if kind in _ROWWISE:
        if len(fqn.split(".")) != ctx.depth + 2:
            raise _unplaceable(
                model,
                fqn,
                module,
                f"{kind!r} below the sublayer's children: ndparallel reduce-"
                "scatters only a sublayer's last projection into sequence shards",
            )
        inputs = Replicate() if kind == "rowwise_split_input" else Shard(-1)
        return RowwiseParallel(input_layouts=inputs, output_layouts=Shard(1))
    if kind in ("embedding_rowwise", "embedding_colwise"):
        if not isinstance(module, nn.Embedding):
            raise _unplaceable(model, fqn, module, f"{kind!r} shards an nn.Embedding, and this is not one")
        style = RowwiseParallel if kind == "embedding_rowwise" else ColwiseParallel
        return style(input_layouts=Replicate(), output_layouts=Replicate())
    if kind == "replicate":
        if not gathered:
            raise _unplaceable(
                model,
                fqn,
                module,
                "'replicate' inside a sublayer whose inputs are sharded: its gradients would differ per rank",
            )
        return ReplicatedCompute()
    # replicated_with_grad_allreduce
    params = list(module.parameters())
    if not params:
        return None  # a norm without a scale: nothing to shard or sum
    if list(module.children()) or any(p.dim() != 1 for p in params):
        raise _unplaceable(
            model,
            fqn,
            module,
            "'replicated_with_grad_allreduce' on a module that is not a norm (a leaf with 1-D parameters)",
        )
    return PerShardNorm()


def _linear_entries(
    ctx: _Context, prefix: str, overrides: Mapping[str, ParallelStyle | None]
) -> dict[str, ParallelStyle | None]:
    """The entries of the base plan, translated; an entry in ``overrides`` (prefixed FQN pattern) replaces the
    translation of that pattern. Base entries matching nothing in this instance are left out."""
    model = ctx.model
    plan = {fqn: kind for fqn, kind in _base_plan(model, prefix, overrides).items() if fqn not in overrides}
    _refuse_first(model, plan)
    by_sub: dict[str, set[str]] = {}
    for fqn, kind in plan.items():
        sub = ctx.sublayer(fqn)
        if sub is not None and _matches(model, fqn)[0] is not None:
            by_sub.setdefault(sub, set()).add(kind)
    entries: dict[str, ParallelStyle | None] = {}
    exits: dict[str, str] = {}
    for fqn, kind in plan.items():
        module, _ = _matches(model, fqn)
        if module is None:
            continue
        sub = ctx.sublayer(fqn)
        if kind in _ROWWISE and fqn not in ctx.structural and sub is not None:
            if sub in exits:
                raise _unplaceable(
                    model,
                    fqn,
                    module,
                    f"a second rowwise projection in {sub!r} (after "
                    f"{exits[sub]!r}): ndparallel reduce-scatters one exit per sublayer",
                )
            exits[sub] = fqn
        style = _translate(ctx, fqn, kind, module, by_sub.get(sub or "", set()) <= _GATHERED)
        if style is not None:
            entries[fqn] = style
    entries.update(overrides)
    for sub, kinds in by_sub.items():
        if kinds <= _GATHERED:
            entries.update(_replicated_inside(model, sub, entries))
    return entries


def _replicated_inside(model: nn.Module, sub: str, entries: Mapping) -> dict[str, ParallelStyle]:
    """The parameter-holding leaves of a gathered sublayer no entry covers: they compute on replicated inputs."""
    extra = {}
    for name, module in matching_modules(model, sub):
        for child, leaf in module.named_modules():
            if not child or list(leaf.children()) or not list(leaf.parameters(recurse=False)):
                continue
            pattern = f"{sub}.{child}"
            if not any(fqn_matches(f"{name}.{child}", p) for p in entries):
                extra[pattern] = ReplicatedCompute()
        break  # the layers share one structure: the first matching sublayer names the patterns
    return extra


def _first_match(model: nn.Module, pattern: str) -> nn.Module | None:
    return next((module for _, module in matching_modules(model, pattern)), None)


def _check_placeable(model: nn.Module, fqn: str, module: nn.Module, expected: type) -> None:
    """The embedding / lm_head entries shard a weight directly: the module must be that layer, not a wrapper."""
    if not isinstance(module, expected):
        inner = [f"{fqn}.{n}" for n, m in module.named_modules() if n and isinstance(m, expected)]
        where = f" (the {expected.__name__} inside it is {inner[0]!r})" if inner else ""
        raise _unplaceable(model, fqn, module, f"it is not an nn.{expected.__name__}{where}")


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
    prefix = _fqn(model, base) or ""
    dot = f"{prefix}." if prefix else ""
    layers_name, layers = _blocks(model)
    layers_pattern = f"{layers_name}.*"
    if model.config.model_type in GLOBAL_HEAD_SPLIT and not overrides:
        attn = next((n for n, _ in layers[0].named_children() if "attn" in n), "attn")
        raise _unplaceable(
            model,
            f"{layers_pattern}.{attn}",
            getattr(layers[0], attn, None),
            "its attention splits q/k/v by the global head count, not the rank's heads (a shape error on tp 2)",
        )
    if not overrides:
        _refuse_packed_experts(model)
    embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
    embedding_fqn = _fqn(model, embedding)
    if embedding_fqn not in overrides:
        _check_placeable(model, embedding_fqn, embedding, nn.Embedding)

    plan: dict[str, ParallelStyle | None] = {
        embedding_fqn: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    }
    ctx = _Context(model, layers_pattern, embedding_fqn, _fqn(model, output) if output is not None else None)
    linear = _linear_entries(ctx, prefix, overrides)
    for name, child in layers[0].named_children():
        if _is_norm(child):
            plan[f"{layers_pattern}.{name}"] = SequenceParallel(use_local_output=True)  # before or after a sublayer
        elif any(p.startswith(f"{layers_pattern}.{name}.") for p in linear):
            plan[f"{layers_pattern}.{name}"] = GatherSequence()
    plan.update(linear)
    for name, child in base.named_children():
        if child is not embedding and _is_norm(child):
            plan[f"{dot}{name}"] = SequenceParallel(use_local_output=True)  # HF slices the output: keep it local
    if output is not None:
        output_fqn = _fqn(model, output)
        if output_fqn not in overrides:
            _check_placeable(model, output_fqn, output, nn.Linear)
            head = dict(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
            tied = output.weight is embedding.weight
            plan[output_fqn] = TiedColwiseParallel(embedding, output, **head) if tied else ColwiseParallel(**head)
    plan.update(overrides)
    plan = {fqn: style for fqn, style in plan.items() if style is not None}
    _check_covered(model, plan)
    return plan


_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def expert_count(config: object) -> int | None:
    """The routed experts per MoE layer a config (a transformers config, or a ``config.json`` dict) declares, or
    None for a dense model."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in _EXPERT_COUNT_KEYS:
        value = text.get(key) if isinstance(text, Mapping) else getattr(text, key, None)
        if isinstance(value, int) and value > 1:
            return value
    return None


def _packed_experts(model: nn.Module) -> list[str]:
    """Modules holding experts fused into one ``[n_experts, out, in]`` weight (a convolution's is 3-D too)."""
    n_experts = expert_count(model.config)
    found = []
    for name, param in model.named_parameters():
        owner = name.rpartition(".")[0]
        if param.dim() == 3 and param.shape[0] == n_experts and owner not in found:
            if not isinstance(model.get_submodule(owner), _CONVOLUTIONS):
                found.append(owner)
    return found


def _refuse_packed_experts(model: nn.Module, among: list[str] | None = None) -> None:
    """Name the MoE experts as the reason, before a router or shared expert the plan also cannot place
    (transformers 5.25's plans list no experts at all)."""
    experts = [fqn for fqn in _packed_experts(model) if among is None or fqn in among]
    if not experts:
        return
    fqn, module = experts[0], model.get_submodule(experts[0])
    names = [fqn, *(f"{fqn}.{name}" for name, _ in module.named_parameters())]
    listed = [  # the plan's own style for the experts (5.24 lists every MoE's; 5.25 mostly none)
        kind
        for pattern, kind in _prefixed_plan(model, _fqn(model, model.base_model) or "").items()
        if any(fqn_matches(name, pattern) for name in names)
    ]
    if listed:
        why = f"its base_model_tp_plan style {listed[0]!r}: {REFUSED.get(listed[0], REFUSED['moe_tp_experts'])}"
    else:
        why = f"no entry covers it: {REFUSED['moe_tp_experts']}"
    raise _unplaceable(model, fqn, module, why)


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
        raise _unplaceable(
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
    prefix = _fqn(model, model.base_model) or ""
    norms = [f"{prefix}.{n}".lstrip(".") for n, child in model.base_model.named_children() if _is_norm(child)]
    if output is not None and _shares_a_parameter(output, embedding):  # also through a wrapper module
        return []
    head = norms + ([_fqn(model, output)] if output is not None else [])
    return [[_fqn(model, embedding)]] + ([head] if head else [])


def _shares_a_parameter(a: nn.Module, b: nn.Module) -> bool:
    ids = {id(p) for p in b.parameters()}
    return any(id(p) in ids for p in a.parameters())
