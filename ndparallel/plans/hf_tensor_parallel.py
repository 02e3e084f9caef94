"""Hugging Face decoders (Llama, Qwen2, Mistral): tensor/sequence-parallel table, FSDP units, attention seam.

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

Tied word embeddings (small Qwen2): the embedding and ``lm_head`` both shard the vocabulary on dim 0,
so after TP ``lm_head`` gets the embedding's DTensor parameter back (one parameter, as before), and
FSDP keeps both in the root unit (a parameter must live in one FSDP unit).

HF attention modules call a function from ``transformers``' attention registry. Under TP or CP,
:func:`apply_hf_attention` selects ``"ndparallel_sdpa"`` (causal SDPA on the rank's heads) or
``"ndparallel_ring"`` (:func:`ndparallel.comm.ring.ring_attention` over ``mesh["cp"]``), and a
forward pre-hook on the model supplies global ``position_ids`` (the rank's shard under CP;
the local sequence under SP would otherwise number tokens ``0..seq/tp``), turns the KV cache off and
refuses what the sharded attention cannot honour. Input refusals are collective (one all-reduce of a flag
per forward): a rank that sees padding and one that does not raise the same ConfigError instead of
one rank raising while the others block in the next collective. ``transformers`` is imported only when
an HF model is parallelised.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from ndparallel.comm.ring import ring_attention
from ndparallel.config import ParallelismConfig
from ndparallel.errors import ConfigError
from ndparallel.mesh import Mesh
from ndparallel.plans.context_parallel import sequence_indices
from ndparallel.plans.hf_loss import install_causal_lm_loss, labels_problem

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "GatherSequence",
    "TiedColwiseParallel",
    "apply_hf_attention",
    "hf_fsdp_groups",
    "hf_parallelize_kwargs",
    "hf_tp_plan",
    "is_hf_model",
]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")  # tested against the unparallelised model
ATTENTION_SDPA, ATTENTION_RING = "ndparallel_sdpa", "ndparallel_ring"


def is_hf_model(model: nn.Module) -> bool:
    """True for a ``transformers`` PreTrainedModel (duck-typed: no import of transformers)."""
    config = getattr(model, "config", None)
    return isinstance(getattr(config, "model_type", None), str) and hasattr(model, "base_model_prefix")


def _custom_plan_hint(model: nn.Module) -> str:
    return (
        f"pass plan={{fqn_pattern: ParallelStyle}} to ndparallel.parallelize for {type(model).__name__} (start from "
        "ndparallel.plans.hf_tensor_parallel.hf_tp_plan(model, untested=True, overrides={fqn: style})), with "
        "blocks=[fqn, ...] and fsdp_groups=[[fqn, ...], ...] where the defaults do not fit "
        "(docs/huggingface.md#another-architecture-pass-a-plan), or use tp_size=1"
    )


def _unplaceable(model: nn.Module, fqn: str, module: nn.Module | None, why: str) -> ConfigError:
    """The refusal when the built-in plan cannot place ``fqn``: names the module, its class and the way out."""
    kind = f" ({type(module).__name__})" if module is not None else ""
    return ConfigError(f"the built-in Hugging Face plan cannot place {fqn!r}{kind}: {why}; {_custom_plan_hint(model)}")


# ------------------------------------------------------------------------------------------ styles


class GatherSequence(ParallelStyle):
    """Input hidden states (first positional argument or ``hidden_states=``) from sequence shards to
    a Replicate DTensor: the all-gather before attention / MLP under sequence parallel (its backward
    reduce-scatters). Works however the parent calls the module, positionally or by keyword."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(x):
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
            return x.redistribute(device_mesh, (Replicate(),))

        def hook(_module, args, kwargs):
            if args:
                return (gather(args[0]), *args[1:]), kwargs
            if "hidden_states" not in kwargs:
                raise ConfigError(
                    f"{type(module).__name__} got no hidden states to gather (positional or hidden_states=)"
                )
            return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class TiedColwiseParallel(ColwiseParallel):
    """``lm_head`` sharing the embedding's weight: shard like ColwiseParallel, then reuse the embedding's
    DTensor parameter (RowwiseParallel on an embedding shards its weight on dim 0 too)."""

    def __init__(self, embedding: nn.Module, **kwargs: Any):
        super().__init__(**kwargs)
        self.embedding = embedding

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        shared = self.embedding.weight
        if not isinstance(shared, DTensor) or shared.placements != module.weight.placements:
            raise ConfigError(
                "tied lm_head/embedding: the embedding must be sharded on the vocabulary (RowwiseParallel) "
                "before lm_head in the plan; or untie them (config.tie_word_embeddings=False)"
            )
        module.weight = shared
        return module


_HF_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(output_layouts=Shard(1)),
}


# ------------------------------------------------------------------------------------------ plan


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
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            return name, module
    raise ConfigError(f"{type(model).__name__} has no nn.ModuleList of decoder layers; {_custom_plan_hint(model)}")


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
    return next((m for name, m in model.named_modules() if _matches(name, pattern)), None)


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
    table is returned for you to check and pass as ``plan=``). ``overrides`` maps prefixed FQN patterns
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


def _matches(fqn: str, pattern: str) -> bool:
    atoms, parts = fqn.split("."), pattern.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatchcase(a, p) for a, p in zip(atoms, parts, strict=True))


def _check_covered(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> None:
    """Every parameter must become a DTensor (foreach AdamW and clipping need one kind of tensor)."""
    missing = []
    for name, _ in model.named_parameters():
        owner = name.rpartition(".")[0]
        if not any(_matches(owner, p) and not isinstance(s, GatherSequence) for p, s in plan.items()):
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


def hf_parallelize_kwargs(
    model: nn.Module,
    cfg: ParallelismConfig,
    mesh: Mesh,
    *,
    plan: Mapping[str, ParallelStyle] | None = None,
    fsdp_groups: list[list[str]] | None = None,
) -> dict[str, Any]:
    """``plan`` and ``fsdp_groups`` for :func:`ndparallel.parallelize`: the caller's where given, else the
    HF defaults (the plan only when tp > 1). Every refusal (an architecture without a built-in plan, an
    attention the seam cannot route) happens here, before the model is touched."""
    if plan is None and mesh.size("tp") > 1:
        plan = hf_tp_plan(model)
    _check_attention(model, cfg, mesh)
    return {"plan": plan, "fsdp_groups": hf_fsdp_groups(model) if fsdp_groups is None else fsdp_groups}


# --------------------------------------------------------------------------------- attention seam


@dataclass
class _AttentionSpec:
    """What ndparallel's attention functions need, stored on each HF attention module."""

    cp_group: dist.ProcessGroup | None
    cp_size: int
    rotate: str
    load_balance: bool
    tp_size: int = 1
    device: torch.device = torch.device("cpu")  # where the refusal flag is all-reduced (cuda under NCCL)


def _is_hf_attention(module: nn.Module) -> bool:
    """HF attention modules (they call the registry) carry ``is_causal``, ``layer_idx`` and ``config``."""
    return all(getattr(module, name, None) is not None for name in ("is_causal", "layer_idx", "config"))


def _spec(module: nn.Module) -> _AttentionSpec:
    spec = getattr(module, "_ndparallel_attention", None)
    if spec is None:
        raise ConfigError(
            f"{type(module).__name__} uses attn_implementation={module.config._attn_implementation!r} but was not "
            "prepared by ndparallel.parallelize (apply_hf_attention)"
        )
    return spec


def _check_call(module: nn.Module, q_len: int, spec: _AttentionSpec, dropout: float, kwargs: dict) -> None:
    if not getattr(module, "is_causal", True):
        raise ConfigError(
            f"{type(module).__name__} is not causal: ndparallel's HF attention supports causal masks only"
        )
    if dropout:
        raise ConfigError(f"attention dropout={dropout} is not supported under tp/cp; set config.attention_dropout=0")
    window = kwargs.get("sliding_window")
    if window is not None and window < q_len * spec.cp_size:
        raise ConfigError(
            f"sliding_window={window} is shorter than the sequence ({q_len * spec.cp_size}): ndparallel's "
            "attention is full causal; use sequences <= sliding_window or config.sliding_window=None"
        )


def _sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal SDPA on ``[batch, heads, seq, head_dim]`` (the rank's heads); returns ``[batch, seq, heads, dim]``."""
    _check_call(module, query.shape[2], _spec(module), dropout, kwargs)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _ring_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Ring attention over the cp group; HF passes ``[batch, heads, seq, head_dim]``, the ring wants seq first."""
    spec = _spec(module)
    _check_call(module, query.shape[2], spec, dropout, kwargs)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = ring_attention(q, k, v, spec.cp_group, True, spec.rotate, spec.load_balance, scale=scaling)
    return out, None


def _register_attention(model: nn.Module, name: str) -> None:
    from transformers import AttentionInterface  # present: the model is a transformers model

    AttentionInterface.register(ATTENTION_SDPA, _sdpa_attention)
    AttentionInterface.register(ATTENTION_RING, _ring_attention)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    if model.config._attn_implementation != name:  # older versions: the config attribute is the switch
        model.config._attn_implementation = name


def _input_problem(spec: _AttentionSpec, args: tuple, kwargs: dict) -> str | None:
    """Why this rank's forward inputs cannot run under tp/cp, or None."""
    if len(args) > 1:
        return "pass attention_mask / position_ids as keywords to a model parallelised by ndparallel"
    tokens = args[0] if args else kwargs.get("input_ids")
    if tokens is None:
        return "tp/cp need input_ids (inputs_embeds bypass the sharded embedding); pass input_ids"
    mask = kwargs.get("attention_mask")
    if mask is not None and (mask.dim() != 2 or not bool(mask.all())):
        return (
            "attention_mask with padding is not supported under tp/cp (the attention is full causal): "
            "pack sequences without padding and pass attention_mask=None"
        )
    if kwargs.get("use_cache"):
        return "use_cache=True (KV cache, generation) is not supported on a model with tp/cp > 1"
    local = tokens.shape[1]
    if local % spec.tp_size:
        return _sequence_problem(spec, local)
    labels = labels_problem(kwargs, local, spec.cp_size)  # outputs.loss: ndparallel/plans/hf_loss.py
    if labels:
        return labels
    positions = kwargs.get("position_ids")
    if positions is not None and positions.shape[-1] != local:
        return (
            f"position_ids has {positions.shape[-1]} positions but this rank holds {local} tokens "
            f"(cp_size={spec.cp_size}): pass position_ids as a context_parallel buffer with the tokens "
            "(seq dim 1) so they are sharded alike, or omit them (ndparallel fills the rank's global positions)"
        )
    return None


def _sequence_problem(spec: _AttentionSpec, local: int) -> str:
    tp, cp = spec.tp_size, spec.cp_size
    if cp == 1:
        return (
            f"sequence length {local} is not divisible by tp_size={tp}: sequence parallel splits the tokens "
            f"over tp; use a sequence length that is a multiple of {tp}"
        )
    chunks = 2 * cp if spec.load_balance else cp
    return (
        f"sequence length {local * cp} (cp_size={cp}: {local} tokens per rank) is not divisible by tp_size={tp} "
        f"per rank: sequence parallel splits each rank's tokens over tp; use a sequence length that is a multiple "
        f"of tp_size * {'2 * cp_size' if spec.load_balance else 'cp_size'} = {tp * chunks}"
        + (" (cp_load_balance cuts the sequence into 2 * cp_size chunks)" if spec.load_balance else "")
    )


def _agree(problem: str | None, device: torch.device) -> None:
    """Raise the same ConfigError on every rank when any rank has a problem (an all-reduce of a flag, and an
    all-gather of the messages only on failure), so no rank is left waiting in FSDP's next collective."""
    if not dist.is_initialized():
        if problem:
            raise ConfigError(problem)
        return
    flag = torch.tensor([int(problem is not None)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, problem)
    rank, message = next((r, m) for r, m in enumerate(messages) if m is not None)
    raise ConfigError(f"{message} (input refused on rank {rank})")


def _input_hook(spec: _AttentionSpec, cp_rank: int):
    def hook(_module, args, kwargs):
        _agree(_input_problem(spec, args, kwargs), spec.device)
        tokens = args[0] if args else kwargs["input_ids"]
        kwargs = {**kwargs, "attention_mask": None, "use_cache": False}
        if kwargs.get("position_ids") is None:
            seq = tokens.shape[1] * spec.cp_size
            if spec.cp_size > 1:
                positions = sequence_indices(seq, spec.cp_size, cp_rank, spec.load_balance, device=tokens.device)
            else:
                positions = torch.arange(seq, device=tokens.device)
            kwargs["position_ids"] = positions.unsqueeze(0)
        return args, kwargs

    return hook


def apply_hf_attention(model: nn.Module, mesh: Mesh, cfg: ParallelismConfig | None = None) -> nn.Module:
    """Route an HF model's attention through ndparallel when ``tp > 1`` or ``cp > 1`` (no-op otherwise).

    Sets ``attn_implementation`` to ``"ndparallel_ring"`` (cp > 1) or ``"ndparallel_sdpa"``, and hooks the
    model's inputs: ``position_ids`` default to this rank's global positions (the layout of
    :func:`ndparallel.context_parallel`), the KV cache is off; padding masks, a sequence not divisible by tp,
    unsharded ``position_ids`` and misshapen labels are refused on every rank alike. ``labels=`` /
    ``shift_labels=`` give the one-process ``outputs.loss`` (:mod:`ndparallel.plans.hf_loss`).
    """
    cfg = cfg or mesh.config
    if not _check_attention(model, cfg, mesh):
        return model
    cp, cp_mesh = mesh.size("cp"), mesh["cp"]
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    spec = _AttentionSpec(
        cp_mesh.get_group() if cp > 1 else None,
        cp,
        cfg.cp_rotate_method,
        cfg.cp_load_balance,
        tp_size=mesh.size("tp"),
        device=device,
    )
    for module in model.modules():
        if _is_hf_attention(module):
            module._ndparallel_attention = spec
    _register_attention(model, ATTENTION_RING if cp > 1 else ATTENTION_SDPA)
    cp_rank = cp_mesh.get_local_rank() if cp > 1 else 0
    model.register_forward_pre_hook(_input_hook(spec, cp_rank), with_kwargs=True)
    install_causal_lm_loss(model, spec.cp_group, cp, cp_rank, cfg.cp_load_balance)
    return model


def _check_attention(model: nn.Module, cfg: ParallelismConfig, mesh: Mesh) -> bool:
    """Whether the attention must be routed (tp or cp > 1); ConfigError when it cannot be."""
    if mesh.size("tp") == 1 and mesh.size("cp") == 1:
        return False
    if mesh.size("cp") > 1 and cfg.cp_backend != "ndparallel":
        raise ConfigError(f"cp_backend={cfg.cp_backend!r} is not supported for Hugging Face models; use 'ndparallel'")
    if mesh.size("cp") > 1:
        _check_rope(model, mesh.size("cp"))
    if not any(_is_hf_attention(m) for m in model.modules()):
        raise ConfigError(
            f"{type(model).__name__} has no HF attention module (with is_causal, layer_idx, config) calling the "
            "attention registry: tensor/context parallel cannot route its attention; use tp_size=cp_size=1"
        )
    return True


def _is_dynamic_rope(kind: object) -> bool:
    """The rope types HF's ``dynamic_rope_update`` recomputes from max(position_ids) (its own test)."""
    return isinstance(kind, str) and ("dynamic" in kind or kind == "longrope")


def _check_rope(model: nn.Module, cp: int) -> None:
    """Under CP each rank sees a shard of the positions: a rotary table recomputed from max(position_ids) + 1
    would differ between ranks (silently wrong attention), so such rope types are refused."""
    for module in model.modules():
        rope = getattr(module, "rope_type", None)
        for kind in rope.values() if isinstance(rope, Mapping) else [rope]:
            if _is_dynamic_rope(kind):
                raise ConfigError(
                    f"rope_type={kind!r} (config.rope_parameters, rope_scaling in older transformers) recomputes "
                    f"the rotary table from each rank's max(position_ids) under cp_size={cp}, so ranks would "
                    "rotate differently; use cp_size=1 or the default rope"
                )
