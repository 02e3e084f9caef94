"""Tiny random configs of any ``transformers`` causal LM: the one builder the tests and the zoo walk share.

``AutoConfig.for_model(model_type)`` gives an architecture's default (full-size) config; :func:`tiny_config`
shrinks every size field it has (hidden, FFN, layers, heads, kv heads, head dim, experts, MLA ranks), keeps
the special token ids inside the vocabulary, trims ``layer_types`` to the layer count, opens sliding windows
to ``window`` (a window shorter than the sequence is refused under tp/cp) and switches every dropout and
router jitter off, so that one process is deterministic. Measured quirks are in DESIGN.md "Facts measured".

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


def _finish(config: Any) -> Any:
    """``layer_types`` trimmed to the layer count; eager experts (grouped_mm has no float64 kernel)."""
    layers = getattr(config, "num_hidden_layers", None)
    types = getattr(config, "layer_types", None)
    if isinstance(layers, int) and isinstance(types, list) and len(types) != layers:
        config.layer_types = (types * layers)[:layers]
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
    return _finish(transformers.AutoConfig.for_model(model_type, **fields))


def shrink_config(config: Any, window: int = 64) -> tuple[Any, dict[str, tuple[Any, Any]]]:
    """``config`` (a full-size ``transformers`` config) shrunk by the rule of :func:`tiny_config`, every other
    field kept; and what changed, ``{field: (from, to)}``. Raises ``ValueError`` (transformers' own check)
    when the architecture's fields cannot take the tiny sizes."""
    before = config.to_dict()
    fields = {**before, **_tiny_fields(config, None, window)}
    layers, types = fields.get("num_hidden_layers"), fields.get("layer_types")
    if isinstance(layers, int) and isinstance(types, list):  # validated against the layer count when built
        fields["layer_types"] = (types * layers)[:layers]
    shrunk = _finish(type(config).from_dict(fields))
    after = shrunk.to_dict()
    changes = {k: (before.get(k), v) for k, v in after.items() if k in before and before[k] != v}
    return shrunk, changes
