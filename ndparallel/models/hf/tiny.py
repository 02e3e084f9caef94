"""Tiny random configs of any ``transformers`` causal LM: the one builder the tests and the zoo walk share.

``AutoConfig.for_model(model_type)`` gives an architecture's default (full-size) config; :func:`tiny_config`
shrinks every size field it has (hidden, FFN, layers, heads, kv heads, head dim, experts, MLA ranks), keeps
the special token ids inside the vocabulary, keeps a layer of each kind where the config's own 2-layer
pattern lacks one (:func:`_kept_layers`: Gemma 3's 5 sliding : 1 full keeps a full-attention layer), opens
sliding windows to ``window`` (a window shorter than the sequence is refused under tp/cp) and switches every
dropout and router jitter off, so that one process is deterministic. Measured quirks are in DESIGN.md "Facts measured".

:func:`shrink_config` applies the same rule to a user's own (full-size) config, keeping its other fields (the
architecture's knobs), and says what it changed: ``ndparallel verify --shrink``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TINY_SIZES", "shrink_config", "tiny_config"]

# field -> tiny value, applied only to fields the default config has (None-valued fields stay None)
TINY_SIZES: dict[str, int] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 64,
    "max_position_embeddings": 64,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,  # MLA: head_dim must equal qk_rope_head_dim
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
}
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")
# per-layer lists (one entry per layer) whose entries are a layer's kind: the kept layers cover their values
_KIND_LISTS = ("layer_types", "mlp_layer_types", "layers_block_type", "attention_layers", "no_rope_layers")
# per-layer lists that follow the kept layers (not kinds themselves). Index lists (moe_layers, mlp_only_layers,
# full_attn_idxs, ...) name layers instead and are left to the config's own rule.
_FOLLOW_LISTS = ("layer_rope_theta", "indexer_types")


def _tiny_fields(config: Any, vocab: int | None, window: int) -> dict[str, Any]:
    """The one shrinking rule: the tiny size of every size field ``config`` has (None-valued fields stay None),
    its special token ids inside the vocabulary (``vocab``, or the tiny one), every dropout and router
    jitter 0, a sliding window opened to ``window``."""
    fields: dict[str, Any] = {k: v for k, v in TINY_SIZES.items() if getattr(config, k, None) is not None}
    vocab = vocab if vocab is not None else fields.get("vocab_size", TINY_SIZES["vocab_size"])
    for name in _TOKEN_IDS:
        value = getattr(config, name, None)
        if isinstance(value, int):
            fields[name] = min(value, vocab - 1)
        elif isinstance(value, list):
            fields[name] = [min(v, vocab - 1) for v in value]
    for name, value in config.to_dict().items():
        if isinstance(value, float) and ("dropout" in name or "pdrop" in name or "jitter" in name):
            fields[name] = 0.0
    if isinstance(getattr(config, "sliding_window", None), int):
        fields["sliding_window"] = window
    return fields


def _kept_layers(config: Any, layers: int) -> list[int]:
    """Which of ``config``'s layers a ``layers``-layer shrink keeps, in order: layer 0, then each first layer
    whose entry in some kind list (``_KIND_LISTS``) is a value not kept yet, then (kinds exhausted) the next
    layers in order. A config whose first ``layers`` layers already differ keeps them: ``[0, 1]``."""
    total = getattr(config, "num_hidden_layers", None)
    lists = [getattr(config, n) for n in _KIND_LISTS if _per_layer(getattr(config, n, None), total)]
    if not isinstance(total, int) or total <= layers or not lists:
        return list(range(layers))
    kept, seen = [0], [{_key(kinds[0])} for kinds in lists]
    for i in range(1, total):
        if len(kept) == layers:
            break
        if any(_key(kinds[i]) not in s for kinds, s in zip(lists, seen, strict=True)):
            kept.append(i)
            for kinds, s in zip(lists, seen, strict=True):
                s.add(_key(kinds[i]))
    rest = [i for i in range(total) if i not in kept]
    return sorted(kept + rest[: layers - len(kept)])


def _per_layer(value: Any, total: Any) -> bool:
    """Whether ``value`` is a list with one entry per layer of a ``total``-layer config."""
    return isinstance(value, list | tuple) and isinstance(total, int) and len(value) == total


def _key(entry: Any) -> Any:
    """A hashable form of a per-layer entry."""
    return repr(entry) if isinstance(entry, list | dict) else entry


def _settable(config: Any, name: str) -> bool:
    """Whether ``name`` is a field of ``config`` rather than a property derived from others (Recurrent
    Gemma's ``layer_types`` -> ``layers_block_type``, computed from ``block_types``)."""
    name = getattr(type(config), "attribute_map", {}).get(name, name)
    return not isinstance(getattr(type(config), name, None), property)


def _kept_fields(config: Any, layers: int) -> dict[str, Any]:
    """Every per-layer list of ``config`` (``_KIND_LISTS``, ``_FOLLOW_LISTS``) at the layers
    :func:`_kept_layers` keeps (none above ``config``'s own layer count)."""
    total = getattr(config, "num_hidden_layers", None)
    if not isinstance(total, int) or total <= layers:
        return {}
    kept = _kept_layers(config, layers)
    fields = {}
    for name in _KIND_LISTS + _FOLLOW_LISTS:
        value = getattr(config, name, None)
        if _per_layer(value, total) and _settable(config, name):
            fields[name] = [value[i] for i in kept]
    return fields


def _fitted_layer_types(types: Any, layers: Any) -> Any:
    """``layer_types`` repeated or cut to ``layers`` entries (anything else as it is)."""
    if isinstance(layers, int) and isinstance(types, list) and len(types) != layers:
        return (types * layers)[:layers]
    return types


def _finish(config: Any) -> Any:
    """``layer_types`` fitted to the layer count; eager experts (grouped_mm has no float64 kernel)."""
    types = getattr(config, "layer_types", None)
    fitted = _fitted_layer_types(types, getattr(config, "num_hidden_layers", None))
    if fitted is not types:
        config.layer_types = fitted
    config._experts_implementation = "eager"
    return config


def tiny_config(model_type: str, window: int = 64, initializer_range: float = 0.1, **overrides: Any):
    """A tiny config of ``model_type`` (see the module docstring); ``overrides`` win over the shrinking."""
    import transformers

    defaults = transformers.AutoConfig.for_model(model_type)
    fields = _tiny_fields(defaults, overrides.get("vocab_size"), window)
    if hasattr(defaults, "initializer_range"):
        fields["initializer_range"] = initializer_range
    fields.update(overrides)
    config = _finish(transformers.AutoConfig.for_model(model_type, **fields))
    layers = getattr(config, "num_hidden_layers", None)
    kept = _kept_fields(defaults, layers) if layers and not set(_KIND_LISTS) & set(overrides) else {}
    if kept and _kinds(kept) > _kinds({k: getattr(config, k, None) for k in kept}):
        # the config's own pattern at the tiny layer count lacks a kind (Gemma 3: 2 sliding layers)
        config = _finish(transformers.AutoConfig.for_model(model_type, **fields, **kept))
    return config


def _kinds(lists: dict[str, Any]) -> int:
    """How many distinct (list, entry) kinds the kind lists among ``lists`` hold."""
    return len({(n, _key(e)) for n, v in lists.items() if n in _KIND_LISTS and isinstance(v, list) for e in v})


def shrink_config(config: Any, window: int = 64) -> tuple[Any, dict[str, tuple[Any, Any]]]:
    """``config`` (a full-size ``transformers`` config) shrunk by the rule of :func:`tiny_config`, every other
    field kept; and what changed, ``{field: (from, to)}``. Raises ``ValueError`` (transformers' own check)
    when the architecture's fields cannot take the tiny sizes."""
    before = config.to_dict()
    fields = {**before, **_tiny_fields(config, None, window)}
    layers = fields.get("num_hidden_layers")
    if isinstance(layers, int):
        fields.update(_kept_fields(config, layers))
        if isinstance(fields.get("num_attention_heads_per_layer"), list):  # Laguna: one head count per layer
            fields["num_attention_heads_per_layer"] = [fields["num_attention_heads"]] * layers
    if "layer_types" in fields:  # validated against the layer count when built
        fields["layer_types"] = _fitted_layer_types(fields["layer_types"], layers)
    shrunk = _finish(type(config).from_dict(fields))
    after = shrunk.to_dict()
    changes = {k: (before.get(k), v) for k, v in after.items() if k in before and before[k] != v}
    return shrunk, changes
