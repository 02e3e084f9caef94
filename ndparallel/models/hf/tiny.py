"""Tiny random configs of any ``transformers`` causal LM: the one builder the tests and the zoo walk share.

``AutoConfig.for_model(model_type)`` gives an architecture's default (full-size) config; :func:`tiny_config`
shrinks every size field it has (hidden, FFN, layers, heads, kv heads, head dim, experts, MLA ranks), keeps
the special token ids inside the vocabulary, trims ``layer_types`` to the layer count, opens sliding windows
to ``window`` (a window shorter than the sequence is refused under tp/cp) and switches every dropout and
router jitter off, so that one process is deterministic. Measured quirks are in DESIGN.md "Facts measured".
"""

from __future__ import annotations

from typing import Any

__all__ = ["TINY_SIZES", "tiny_config"]

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


def tiny_config(model_type: str, window: int = 64, initializer_range: float = 0.1, **overrides: Any):
    """A tiny config of ``model_type`` (see the module docstring); ``overrides`` win over the shrinking."""
    import transformers

    defaults = transformers.AutoConfig.for_model(model_type)
    fields: dict[str, Any] = {k: v for k, v in TINY_SIZES.items() if getattr(defaults, k, None) is not None}
    vocab = overrides.get("vocab_size", fields.get("vocab_size", TINY_SIZES["vocab_size"]))
    for name in _TOKEN_IDS:
        value = getattr(defaults, name, None)
        if isinstance(value, int):
            fields[name] = min(value, vocab - 1)
        elif isinstance(value, list):
            fields[name] = [min(v, vocab - 1) for v in value]
    for name, value in defaults.to_dict().items():
        if isinstance(value, float) and ("dropout" in name or "pdrop" in name or "jitter" in name):
            fields[name] = 0.0
    if isinstance(getattr(defaults, "sliding_window", None), int):
        fields["sliding_window"] = window
    if hasattr(defaults, "initializer_range"):
        fields["initializer_range"] = initializer_range
    fields.update(overrides)
    config = transformers.AutoConfig.for_model(model_type, **fields)
    layers = getattr(config, "num_hidden_layers", None)
    types = getattr(config, "layer_types", None)
    if isinstance(layers, int) and isinstance(types, list) and len(types) != layers:
        config.layer_types = (types * layers)[:layers]
    config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    return config
