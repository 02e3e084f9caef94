"""Reference Transformer: presets, deterministic init, meta-device construction, stable names."""

from __future__ import annotations

import pytest
import torch

from ndparallel import ConfigError
from ndparallel.models import PRESETS, CoreAttention, Transformer, TransformerConfig


def test_presets_param_counts_match_formula():
    for name in PRESETS:
        cfg = TransformerConfig.from_preset(name)
        with torch.device("meta"):
            model = Transformer(cfg)
        assert sum(p.numel() for p in model.parameters()) == cfg.num_params(), name
    assert TransformerConfig.from_preset("tiny").num_params() < 1_000_000
    assert TransformerConfig.from_preset("1b").num_params() == 953_223_168


def test_init_is_deterministic_and_independent_of_global_rng():
    cfg = TransformerConfig.from_preset("tiny")
    torch.manual_seed(1)
    a = Transformer(cfg)
    torch.manual_seed(2)
    b = Transformer(cfg)
    c = Transformer(TransformerConfig.from_preset("tiny", seed=5))
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_meta_construction_then_materialise_equals_eager():
    cfg = TransformerConfig.from_preset("tiny")
    with torch.device("meta"):
        lazy = Transformer(cfg)
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    lazy.init_weights()
    eager = Transformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    torch.testing.assert_close(lazy(tokens), eager(tokens), rtol=0, atol=0)


def test_module_names_are_the_documented_contract():
    model = Transformer(TransformerConfig.from_preset("tiny"))
    names = dict(model.named_modules())
    for expected in [
        "tok_embeddings",
        "layers.0.attention_norm",
        "layers.0.attention.wq",
        "layers.0.attention.wk",
        "layers.0.attention.wv",
        "layers.0.attention.wo",
        "layers.1.ffn_norm",
        "layers.1.feed_forward.w1",
        "layers.1.feed_forward.w2",
        "layers.1.feed_forward.w3",
        "norm",
        "output",
    ]:
        assert expected in names, expected
    assert isinstance(names["layers.0.attention.core_attention"], CoreAttention)
    assert "rope_cos" not in model.state_dict(), "rotary tables are not checkpointed"


def test_gqa_attention_matches_explicit_repeat_and_is_causal():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 10, 8, 4), torch.randn(2, 10, 2, 4), torch.randn(2, 10, 2, 4)
    out = CoreAttention()(q, k, v)
    k4, v4 = k.repeat_interleave(4, dim=2), v.repeat_interleave(4, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k4) / 2.0
    scores = scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v4)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_positions_argument_and_errors():
    model = Transformer(TransformerConfig.from_preset("tiny"))
    tokens = torch.randint(0, 256, (1, 12))
    torch.testing.assert_close(model(tokens), model(tokens, torch.arange(12)))
    with pytest.raises(ValueError, match="exceeds model.max_seq_len=256"):
        model(torch.zeros(1, 300, dtype=torch.long))
    with pytest.raises(ConfigError, match="n_kv_heads=3 does not divide model.n_heads=8"):
        TransformerConfig(n_kv_heads=3)
    with pytest.raises(ConfigError, match="unknown model preset"):
        TransformerConfig.from_preset("7b")
