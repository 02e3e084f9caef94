"""Stage modules (``ndparallel/parallel/pipeline/stages.py``): cut by the model's family, they keep the whole
model's FQNs and get its init; a model without a stage builder is refused. No ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ndparallel.errors import ConfigError
from ndparallel.models import Transformer, TransformerConfig
from ndparallel.parallel.family import family_for

TINY = dict(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32, seed=3)


def test_stages_keep_fqns_and_get_the_whole_models_init():
    cfg = TransformerConfig(dtype="float64", **TINY)
    whole = Transformer(cfg)
    with torch.device("meta"):
        meta = Transformer(cfg)
    family = family_for(meta)
    first = family.pipeline_stage(meta, [0, 1], True, False)
    last = family.pipeline_stage(meta, [2, 3], False, True)
    assert family.stage_blocks(last) == ["layers.2", "layers.3"]
    names = [n for n, _ in first.named_parameters()] + [n for n, _ in last.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in whole.named_parameters())  # same FQNs, no clash
    reference = dict(whole.named_parameters())
    for stage in (first, last):
        stage.to_empty(device="cpu")
        stage.init_weights()
        for name, param in stage.named_parameters():
            assert torch.equal(param, reference[name]), name
        x = torch.randint(0, 64, (2, 8)) if stage.first else torch.randn(2, 8, 32, dtype=torch.float64)
        assert stage(x, torch.arange(8).expand(2, 8)).shape[-1] == (64 if stage.last else 32)
    assert not any(p.is_meta for p in first.parameters()) and meta.layers[3].attention.wq.weight.is_meta is False


def test_a_model_without_a_stage_builder_is_refused():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4)])

    with pytest.raises(ConfigError, match="cannot find the blocks of Plain"):
        family_for(Plain()).pipeline_stage(Plain(), [0], True, True)
