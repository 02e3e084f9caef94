"""The attention seam of a Hugging Face model under tp/cp: registry functions, input hook, refusals.

HF attention modules call a function from ``transformers``' attention registry. Under TP or CP,
:func:`apply_hf_attention` selects ``"ndparallel_local"`` (causal attention on the rank's heads; the name
holds no "sdpa": transformers reads that as a claim of SDPA support, which Gemma 2 lacks) or
``"ndparallel_ring"`` (:func:`ndparallel.distributed.ring.ring_attention` over ``mesh["cp"]``, by
``cp_rotate_method``), installs the input hook (:mod:`ndparallel.models.hf.inputs`: positions, KV cache off,
collective refusals) and the sharding-aware ``outputs.loss`` (:mod:`ndparallel.models.hf.loss`).
:func:`check_attention` holds the refusals that must come before the model is touched: an attention the
seam cannot route, ``cp_backend="torch"``, rotary tables recomputed per rank (dynamic rope under cp), and
attention features in the config the seam does not implement (logit soft-capping under Ulysses, attention
dropout, sinks under tp, a layer kind other than full or sliding-window attention). At call time :func:`_check_call`
refuses by name every attention keyword the functions would not honour; ``scaling``, sinks (``s_aux``) and MLA's
differing v head dim are implemented exactly.

Masks: the input hook reduces padding and packed documents to one ``DocumentMask`` and passes it down as the
``ndparallel_documents`` keyword; each layer adds its own sliding window, read as transformers reads it
(:func:`layer_window`: the layer's ``config.layer_types`` entry, else ``config.sliding_window``). A model that does
not hand its keywords down to its attention is refused after its first masked forward (the mask never arrived).
``transformers`` is imported only when an HF model is parallelised.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.distributed.documents import DocumentMask
from ndparallel.distributed.mesh import Mesh
from ndparallel.distributed.ring import ring_attention
from ndparallel.distributed.ulysses import check_sinks, local_attention
from ndparallel.errors import ConfigError
from ndparallel.models.hf.inputs import InputLayout, input_hook
from ndparallel.models.hf.loss import install_causal_lm_loss
from ndparallel.models.hf.packing import ignores_packed_positions
from ndparallel.parallel.masks import DOCUMENTS_KWARG, FLASH_VARLEN_KWARGS

__all__ = [
    "ATTENTION_RING",
    "ATTENTION_SDPA",
    "apply_hf_attention",
    "check_attention",
    "layer_kind",
    "layer_window",
    "route_hf_attention",
]

# config.layer_types entries whose masks ndparallel's attention builds (transformers' create_causal_mask and
# create_sliding_window_causal_mask)
MASK_KINDS = ("full_attention", "sliding_attention")

ATTENTION_SDPA, ATTENTION_RING = "ndparallel_local", "ndparallel_ring"


@dataclass
class _AttentionSpec:
    """What ndparallel's attention functions need, stored on each HF attention module."""

    cp_group: dist.ProcessGroup | None
    cp_size: int
    rotate: str
    load_balance: bool


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


# Keywords transformers hands the attention function that do not change its result (the rotary embedding is
# applied before the call; the KV cache is off; attention weights are not returned; ``shift_labels`` and
# ``num_items_in_batch`` are the loss's, passed down the layers with the other keywords of the model call).
# Every other keyword is a feature: implemented (``scaling``, ``s_aux``), or refused unless it has its neutral
# value (_check_call).
# flash-attention's varlen keywords (``cu_seq_lens_*``, ...) are checked against ``position_ids`` by the input hook
# and reach the attention as the mask (``ndparallel_documents``); SDPA and eager attention ignore them in one process.
_NEUTRAL_KWARGS = frozenset(
    {"position_ids", "cache_position", "use_cache", "past_key_values", "output_attentions", "output_router_logits"}
    | {"shift_labels", "num_items_in_batch", "sliding_window", DOCUMENTS_KWARG, *FLASH_VARLEN_KWARGS}
)


def _refuse(module: nn.Module, feature: str, why: str) -> ConfigError:
    return ConfigError(
        f"model_type={module.config.model_type!r} ({type(module).__name__}) uses {feature} in its attention: "
        f"{why}; use tp_size=1 and cp_size=1"
    )


def _check_call(module: nn.Module, seq: int, dropout: float, kwargs: dict, softcap_ok: bool = False) -> None:
    """Refuse, by name, every attention keyword of this call that ndparallel's attention would not honour.
    ``seq`` is the whole sequence the call attends over (the rank's rows times cp)."""
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal", True) is False:
        raise _refuse(module, "is_causal=False", "ndparallel's tp/cp attention is causal only")
    if dropout:
        raise _refuse(module, f"dropout={dropout}", "attention dropout is not implemented (set attention_dropout=0)")
    if kwargs.get("softcap") is not None and not softcap_ok:
        raise _refuse(module, f"softcap={kwargs['softcap']}", "attention logit soft-capping is not implemented")
    for name, value in kwargs.items():
        if name not in _NEUTRAL_KWARGS | {"is_causal", "softcap", "s_aux"}:
            if value is not None and value is not False:
                raise _refuse(module, f"{name}={_short(value)}", "ndparallel's tp/cp attention does not know it")


def _short(value: object) -> str:
    return f"<tensor {tuple(value.shape)}>" if isinstance(value, torch.Tensor) else repr(value)[:40]


def _same_head_dim(query, key, value) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero-pad q/k or v (``[..., head_dim]``) to one head dim (MLA: DeepSeek's v_head_dim != qk head dim):
    zero columns add nothing to q.k and give zero output columns, which the caller drops. Exact."""
    pad = value.shape[-1] - query.shape[-1]
    if pad > 0:
        return F.pad(query, (0, pad)), F.pad(key, (0, pad)), value
    return query, key, F.pad(value, (0, -pad)) if pad else value


def _documents(module: nn.Module, kwargs: dict) -> DocumentMask | None:
    """The mask the input hook (or a pipeline stage) passed down for this forward; counted as delivered."""
    documents = kwargs.get(DOCUMENTS_KWARG)
    if documents is not None:
        documents.delivered += 1
    return documents


def _sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal SDPA on ``[batch, heads, seq, head_dim]`` (the rank's heads); returns ``[batch, seq, heads, dim]``."""
    _check_call(module, query.shape[2] * _spec(module).cp_size, dropout, kwargs, softcap_ok=True)
    sinks, softcap = kwargs.get("s_aux"), kwargs.get("softcap")
    documents, window = _documents(module, kwargs), layer_window(module)
    check_sinks(sinks, query.shape[1])
    if softcap is not None:
        if sinks is not None:
            raise _refuse(module, "softcap with sinks", "their combination is not implemented")
        return _softcapped_attention(query, key, value, scaling, softcap, documents, window), None
    out = local_attention(query, key, value, True, scaling, sinks, documents, window)
    return out.transpose(1, 2).contiguous(), None


def _softcapped_attention(
    query, key, value, scaling: float | None, softcap: float, documents: DocumentMask | None, window: int | None
) -> torch.Tensor:
    """Causal attention with logit soft-capping (Gemma 2) on the rank's heads, the arithmetic of transformers'
    eager attention (the only one such models have): scores capped by ``tanh(s / cap) * cap``, softmax in
    float32. ``[batch, heads, seq, dim]`` in, ``[batch, seq, heads, dim]`` out. Under cp the ring caps alike.
    With a mask, a row that sees no key outputs zeros (the ring's answer; eager attention would average)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    seq = query.shape[2]
    if documents is None and window is None:
        visible = torch.ones(seq, seq, dtype=torch.bool, device=query.device).tril()
    else:
        batch = query.shape[0]
        whole = documents or DocumentMask.from_document_ids(torch.zeros(batch, seq, dtype=torch.long))
        visible = whole.to(query.device).dense(window)[:, None]
    scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = probs * visible.any(-1, keepdim=True)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


def _ring_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Ring attention over the cp group; HF passes ``[batch, heads, seq, head_dim]``, the ring wants seq first."""
    spec = _spec(module)
    _check_call(module, query.shape[2] * spec.cp_size, dropout, kwargs, softcap_ok=spec.rotate != "alltoall")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling  # before any padding of the head dim
    v_dim = value.shape[-1]
    q, k, v = (t.transpose(1, 2) for t in _same_head_dim(query, key, value))
    sinks, softcap = kwargs.get("s_aux"), kwargs.get("softcap")
    if softcap is not None and sinks is not None:
        raise _refuse(module, "softcap with sinks", "their combination is not implemented")
    out = ring_attention(
        q, k, v, spec.cp_group, True, spec.rotate, spec.load_balance, scaling, sinks=sinks, softcap=softcap,
        documents=_documents(module, kwargs), window=layer_window(module),
    )  # fmt: skip
    return out[..., :v_dim], None


def _register_attention(model: nn.Module, name: str) -> None:
    from transformers import AttentionInterface  # present: the model is a transformers model

    AttentionInterface.register(ATTENTION_SDPA, _sdpa_attention)
    AttentionInterface.register(ATTENTION_RING, _ring_attention)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    if model.config._attn_implementation != name:  # older versions: the config attribute is the switch
        model.config._attn_implementation = name


def apply_hf_attention(model: nn.Module, mesh: Mesh, cfg: ParallelismConfig | None = None) -> nn.Module:
    """Route an HF model's attention through ndparallel when ``tp > 1`` or ``cp > 1`` (no-op otherwise).

    Sets ``attn_implementation`` to ``"ndparallel_ring"`` (cp > 1) or ``"ndparallel_local"``, and hooks the
    model's inputs: ``position_ids`` default to this rank's global positions (the layout of
    :func:`ndparallel.context_parallel`), the KV cache is off; padding masks, a sequence the mesh cannot split,
    unsharded ``position_ids`` and misshapen labels are refused on every rank alike. ``labels=`` /
    ``shift_labels=`` give the one-process ``outputs.loss`` (:mod:`ndparallel.models.hf.loss`).
    """
    cfg = cfg or mesh.config
    if not route_hf_attention(model, mesh, cfg):
        return model
    cp, cp_mesh = mesh.size("cp"), mesh["cp"]
    cp_group = cp_mesh.get_group() if cp > 1 else None
    cp_rank = cp_mesh.get_local_rank() if cp > 1 else 0
    ignores = getattr(model.config, "model_type", "?") if ignores_packed_positions(model) else None
    layout = InputLayout(mesh.size("tp"), cp, cp_rank, cfg.cp_load_balance, cp_group, ignores)
    model.register_forward_pre_hook(input_hook(layout), with_kwargs=True)
    model.register_forward_hook(_check_delivered, with_kwargs=True)
    install_causal_lm_loss(model, cp_group, cp, cp_rank, cfg.cp_load_balance)
    return model


def route_hf_attention(model: nn.Module, mesh: Mesh, cfg: ParallelismConfig) -> bool:
    """Only the attention routing of :func:`apply_hf_attention` (no input hook, no loss): what a pipeline stage
    needs, whose runtime shards tokens, labels and ``position_ids`` itself. Returns whether it routed."""
    if not check_attention(model, cfg, mesh):
        return False
    cp = mesh.size("cp")
    cp_group = mesh["cp"].get_group() if cp > 1 else None
    spec = _AttentionSpec(cp_group, cp, cfg.cp_rotate_method, cfg.cp_load_balance)
    for module in model.modules():
        if _is_hf_attention(module):
            module._ndparallel_attention = spec
    _register_attention(model, ATTENTION_RING if cp > 1 else ATTENTION_SDPA)
    return True


def check_attention(model: nn.Module, cfg: ParallelismConfig, mesh: Mesh) -> bool:
    """Whether the attention must be routed (tp or cp > 1); ConfigError when it cannot be."""
    if mesh.size("tp") == 1 and mesh.size("cp") == 1:
        return False
    if mesh.size("cp") > 1 and cfg.cp_backend != "ndparallel":
        raise ConfigError(f"cp_backend={cfg.cp_backend!r} is not supported for Hugging Face models; use 'ndparallel'")
    if mesh.size("cp") > 1:
        _check_rope(model, mesh.size("cp"))
    _check_features(model, mesh.size("tp"), mesh.size("cp"), cfg.cp_rotate_method)
    if not any(_is_hf_attention(m) for m in model.modules()):
        raise ConfigError(
            f"{type(model).__name__} has no HF attention module (with is_causal, layer_idx, config) calling the "
            "attention registry: tensor/context parallel cannot route its attention; use tp_size=cp_size=1"
        )
    return True


def _check_features(model: nn.Module, tp: int, cp: int, rotate: str) -> None:
    """Refuse, before the model is touched, the attention features its config turns on that the seam cannot
    honour (each would otherwise reach :func:`_check_call` on the first forward, or worse be ignored)."""
    for module in filter(_is_hf_attention, model.modules()):
        config = module.config
        softcap = getattr(config, "attn_logit_softcapping", None)
        if softcap is not None and cp > 1 and rotate == "alltoall":
            raise _refuse(
                module,
                f"attn_logit_softcapping={softcap}",
                "logit soft-capping is not implemented under cp_rotate_method='alltoall' (use 'ring' or 'allgather')",
            )
        dropout = getattr(config, "attention_dropout", 0.0)
        if isinstance(dropout, float | int) and dropout > 0:
            raise _refuse(module, f"attention_dropout={dropout}", "attention dropout is not implemented")
        if tp > 1 and isinstance(getattr(module, "sinks", None), torch.Tensor):
            raise ConfigError(
                f"model_type={config.model_type!r} ({type(module).__name__}) has attention sinks (s_aux), one per "
                f"head, which tensor parallel does not shard with the heads; use tp_size=1 (cp_size > 1 is exact)"
            )
        if layer_kind(module) not in MASK_KINDS:
            raise _refuse(
                module,
                f"layer_types[{module.layer_idx}]={layer_kind(module)!r}",
                f"ndparallel's tp/cp attention builds {' and '.join(MASK_KINDS)} masks only",
            )


def layer_kind(module: nn.Module) -> str:
    """The mask kind transformers builds for this attention layer: its ``config.layer_types`` entry, else (Mistral,
    Phi-3, StarCoder 2: no layer types) ``sliding_attention`` wherever ``config.sliding_window`` is set."""
    config, index = module.config, module.layer_idx
    kinds = getattr(config, "layer_types", None)
    if kinds is not None and index < len(kinds):
        return kinds[index]
    return "full_attention" if getattr(config, "sliding_window", None) is None else "sliding_attention"


def layer_window(module: nn.Module) -> int | None:
    """This layer's sliding window as transformers' mask applies it (query ``i`` sees keys ``i - w < j <= i``), or
    None for full causal attention. Qwen2-MoE's ``sliding_window=0`` with every layer ``full_attention`` is None."""
    return module.config.sliding_window if layer_kind(module) == "sliding_attention" else None


def _check_delivered(model: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
    """After a forward that carried a mask: every attention layer must have received it (a model whose layers do
    not hand their keywords to the attention would have attended across documents and padding)."""
    documents = kwargs.get(DOCUMENTS_KWARG)
    if documents is not None and documents.delivered == 0:
        raise ConfigError(
            f"{type(model).__name__} does not pass its forward keywords down to its attention layers, so the "
            "padding / document mask of this batch never reached them under tp/cp: use batches without padding "
            "or packing (one document per row), or tp_size=1 and cp_size=1"
        )


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
