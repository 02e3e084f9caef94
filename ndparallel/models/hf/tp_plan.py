"""The tensor/sequence-parallel table and FSDP units of a Hugging Face decoder (Llama, Qwen2, Mistral).

The TP + SP table is derived from the model's own module names. Its Linear entries come from the
config's ``base_model_tp_plan`` when present (``"colwise"``/``"rowwise"``, prefixed with the base
model's attribute, ``model.``), the sequence-parallel entries from the decoder's structure::

    model.embed_tokens                     RowwiseParallel, output Shard(1)     (vocab split; seq-sharded output)
    model.layers.*.input_layernorm         SequenceParallel                      (every norm child of a block)
    model.layers.*.self_attn               GatherSequence: Shard(1) -> Replicate (parent of colwise projections)
    model.layers.*.self_attn.{q,k,v}_proj  ColwiseParallel                       ("colwise" in the HF plan)
    model.layers.*.self_attn.o_proj        RowwiseParallel, output Shard(1)      ("rowwise")
    model.layers.*.post_attention_layernorm SequenceParallel
    model.layers.*.mlp                     GatherSequence
    model.layers.*.mlp.{gate,up}_proj      ColwiseParallel
    model.layers.*.mlp.down_proj           RowwiseParallel, output Shard(1)
    model.norm                             SequenceParallel, local output
    lm_head                                ColwiseParallel, input Shard(1), vocab-sharded DTensor logits

Patterns follow :mod:`ndparallel.parallel.fqn` (``*`` inside one atom). Tied word embeddings (small Qwen2):
the embedding and ``lm_head`` both shard the vocabulary on dim 0, so after TP ``lm_head`` gets the
embedding's DTensor parameter back (one parameter, as before), and FSDP keeps both in the root unit (a
parameter must live in one FSDP unit). Models are recognised without importing ``transformers``.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from ndparallel.errors import ConfigError
from ndparallel.models.hf.styles import GatherSequence, TiedColwiseParallel
from ndparallel.parallel.family import block_list
from ndparallel.parallel.fqn import fqn_matches, matching_modules

__all__ = ["SUPPORTED_MODEL_TYPES", "hf_fsdp_groups", "hf_tp_plan", "is_hf_model"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")  # tested against the unparallelised model


def is_hf_model(model: nn.Module) -> bool:
    """True for a ``transformers`` PreTrainedModel (duck-typed: no import of transformers)."""
    config = getattr(model, "config", None)
    return isinstance(getattr(config, "model_type", None), str) and hasattr(model, "base_model_prefix")


def _custom_plan_hint(model: nn.Module) -> str:
    return (
        f"pass tp_plan={{fqn_pattern: ParallelStyle}} to ndparallel.parallelize for {type(model).__name__} (start from "
        "ndparallel.hf.hf_tp_plan(model, untested=True, overrides={fqn: style})), with "
        "blocks=[fqn, ...] and fsdp_groups=[[fqn, ...], ...] where the defaults do not fit "
        "(docs/huggingface.md#another-architecture-pass-a-plan), or use tp_size=1"
    )


def _unplaceable(model: nn.Module, fqn: str, module: nn.Module | None, why: str) -> ConfigError:
    """The refusal when the built-in plan cannot place ``fqn``: names the module, its class and the way out."""
    kind = f" ({type(module).__name__})" if module is not None else ""
    return ConfigError(f"the built-in Hugging Face plan cannot place {fqn!r}{kind}: {why}; {_custom_plan_hint(model)}")


_HF_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(output_layouts=Shard(1)),
}


def _fqn(model: nn.Module, module: nn.Module | None) -> str | None:
    for name, mod in model.named_modules():
        if mod is module:
            return name
    return None


def _is_norm(module: nn.Module) -> bool:
    """A leaf module whose only parameter is a 1-D ``weight`` (RMSNorm/LayerNorm without bias)."""
    params = dict(module.named_parameters())
    return not list(module.children()) and set(params) == {"weight"} and params["weight"].dim() == 1


def _blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    found = block_list(model)
    if found is None:
        raise ConfigError(f"{type(model).__name__} has no nn.ModuleList of decoder layers; {_custom_plan_hint(model)}")
    return found


def _linear_entries(
    model: nn.Module, prefix: str, overrides: Mapping[str, ParallelStyle | None]
) -> dict[str, ParallelStyle | None]:
    """The Linear entries: from the HF config's ``base_model_tp_plan`` when present, else Llama names.
    An entry in ``overrides`` (prefixed FQN pattern) replaces the translation of that pattern."""
    hf_plan = getattr(model.config, "base_model_tp_plan", None) or {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    entries = {}
    for pattern, kind in hf_plan.items():
        fqn = f"{prefix}.{pattern}" if prefix else pattern
        if fqn in overrides:
            entries[fqn] = overrides[fqn]
        elif kind in _HF_STYLES:
            entries[fqn] = _HF_STYLES[kind]()
        else:
            raise _unplaceable(
                model,
                fqn,
                _first_match(model, fqn),
                f"the model's base_model_tp_plan says {kind!r}, which has no ndparallel translation "
                f"(known: {sorted(_HF_STYLES)})",
            )
    return entries


def _first_match(model: nn.Module, pattern: str) -> nn.Module | None:
    return next((module for _, module in matching_modules(model, pattern)), None)


def _check_placeable(model: nn.Module, fqn: str, module: nn.Module, expected: type) -> None:
    """The embedding / lm_head entries shard a weight directly: the module must be that layer, not a wrapper."""
    if not isinstance(module, expected):
        inner = [f"{fqn}.{n}" for n, m in module.named_modules() if n and isinstance(m, expected)]
        where = f" (the {expected.__name__} inside it is {inner[0]!r})" if inner else ""
        raise _unplaceable(model, fqn, module, f"it is not an nn.{expected.__name__}{where}")


def hf_tp_plan(
    model: nn.Module, untested: bool = False, overrides: Mapping[str, ParallelStyle | None] | None = None
) -> dict[str, ParallelStyle]:
    """The TP + SP table for a Hugging Face decoder (see the module docstring).

    Raises :class:`ConfigError` naming the module it cannot place (a wrapped ``lm_head``, a
    ``base_model_tp_plan`` entry without a translation, a parameter left unsharded), and for a
    ``model_type`` outside :data:`SUPPORTED_MODEL_TYPES` unless ``untested=True`` (then the derived
    table is returned for you to check and pass as ``tp_plan=``). ``overrides`` maps prefixed FQN patterns
    to the style to use instead of the derived one (``None`` leaves the pattern out); it is how a
    model outside the families gets a plan (docs/huggingface.md).
    """
    if not is_hf_model(model):
        raise ConfigError(f"{type(model).__name__} is not a Hugging Face PreTrainedModel (no config.model_type)")
    model_type = model.config.model_type
    try:
        plan = _derive_plan(model, dict(overrides or {}))
    except ConfigError as err:
        if model_type in SUPPORTED_MODEL_TYPES:
            raise
        raise ConfigError(f"Hugging Face model_type={model_type!r} is not a built-in family: {err}") from None
    if model_type not in SUPPORTED_MODEL_TYPES and not untested:
        raise ConfigError(
            f"Hugging Face model_type={model_type!r} has no built-in tensor-parallel plan "
            f"(built in: {list(SUPPORTED_MODEL_TYPES)}): the derived table is untested; {_custom_plan_hint(model)}"
        )
    return plan


def _derive_plan(model: nn.Module, overrides: dict[str, ParallelStyle | None]) -> dict[str, ParallelStyle]:
    base = model.base_model
    prefix = _fqn(model, base) or ""
    dot = f"{prefix}." if prefix else ""
    layers_name, layers = _blocks(model)
    layers_pattern = f"{layers_name}.*"
    embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
    embedding_fqn = _fqn(model, embedding)
    if embedding_fqn not in overrides:
        _check_placeable(model, embedding_fqn, embedding, nn.Embedding)

    plan: dict[str, ParallelStyle | None] = {
        embedding_fqn: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    }
    linear = _linear_entries(model, prefix, overrides)
    for name, child in layers[0].named_children():
        if _is_norm(child):
            plan[f"{layers_pattern}.{name}"] = SequenceParallel()
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
            plan[output_fqn] = TiedColwiseParallel(embedding, **head) if tied else ColwiseParallel(**head)
    plan.update(overrides)
    plan = {fqn: style for fqn, style in plan.items() if style is not None}
    _check_covered(model, plan)
    return plan


def _check_covered(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> None:
    """Every parameter must become a DTensor (foreach AdamW and clipping need one kind of tensor)."""
    missing = []
    for name, _ in model.named_parameters():
        owner = name.rpartition(".")[0]
        if not any(fqn_matches(owner, p) and not isinstance(s, GatherSequence) for p, s in plan.items()):
            missing.append(name)
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
