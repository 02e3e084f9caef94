"""The tiny shrink keeps a layer of each kind (ndparallel/models/hf/tiny.py): configs only, no processes."""

from __future__ import annotations

import transformers

from ndparallel.hf import tiny_config
from ndparallel.models.hf.tiny import shrink_config
from ndparallel.verify.compare import describe_shrink

SLIDING, FULL = "sliding_attention", "full_attention"


def test_tiny_gemma3_keeps_a_full_attention_layer():
    """Gemma 3's own pattern (5 sliding : 1 full) gives 2 sliding layers at 2 layers; the shrink keeps the
    first full-attention layer too, and keeps it at any layer count, the overrides winning."""
    assert tiny_config("gemma3_text").layer_types == [SLIDING, FULL]
    assert tiny_config("gemma3_text", num_hidden_layers=4).layer_types == [SLIDING, SLIDING, SLIDING, FULL]
    assert tiny_config("gemma3_text", layer_types=[SLIDING, SLIDING]).layer_types == [SLIDING, SLIDING]


def test_shrunk_full_size_gemma3_keeps_both_kinds():
    """A full-size Gemma 3 (26 layers, full attention every 6th) shrunk by verify --shrink's rule: layers 0 and
    5, one of each kind, said in the changes."""
    full = transformers.Gemma3TextConfig()
    assert full.layer_types[:2] == [SLIDING, SLIDING] and full.layer_types[5] == FULL
    shrunk, changes = shrink_config(full)
    assert shrunk.num_hidden_layers == 2 and shrunk.layer_types == [SLIDING, FULL]
    assert changes["layer_types"] == (full.layer_types, [SLIDING, FULL])
    kinds = f"{SLIDING}, {FULL}"
    assert f"layer_types [26 entries: {kinds}] -> [2 entries: {kinds}]" in describe_shrink(changes)


def test_every_per_layer_list_follows_the_kept_layers():
    """Llama 4 (3 chunked : 1 full, no rope on the full one): layers 0 and 3 kept in both lists; a config whose
    first two layers already differ (Gemma 2, gpt-oss) keeps them; GLM-4 MoE Lite's dense-then-sparse MLP list
    is trimmed to the layer count."""
    llama4 = tiny_config("llama4_text")
    assert llama4.layer_types == ["chunked_attention", FULL] and llama4.no_rope_layers == [1, 0]
    assert tiny_config("gemma2").layer_types == [SLIDING, FULL]
    assert tiny_config("gpt_oss").layer_types == [SLIDING, FULL]
    assert tiny_config("qwen3_next").layer_types == ["linear_attention", FULL]
    shrunk, _ = shrink_config(transformers.AutoConfig.for_model("glm4_moe_lite"))
    assert shrunk.mlp_layer_types == ["dense", "sparse"]
