"""Pipeline pieces that need no ranks: the split, the stage placement, stage modules and their init."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ndparallel.errors import ConfigError
from ndparallel.models import Transformer, TransformerConfig
from ndparallel.parallel.family import family_for
from ndparallel.parallel.pipeline import balanced_split, last_stage_rank, stage_ids, stage_ranges

TINY = dict(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32, seed=3)


def test_balanced_split_minimises_the_largest_stage():
    assert balanced_split([1] * 8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    # a big embedding on the first stage and head on the last push blocks to the middle stages
    assert balanced_split([10] * 6, 3, first_extra=25, last_extra=25) == [range(0, 1), range(1, 5), range(5, 6)]
    assert balanced_split([5, 1, 1, 1, 1, 5], 2) == [range(0, 3), range(3, 6)]
    with pytest.raises(ConfigError, match="4 pipeline stages .* but the model has 3 blocks"):
        balanced_split([1, 1, 1], 4)


def test_explicit_split_is_checked_against_the_model():
    assert stage_ranges([1] * 4, 2, [[0, 1], [1, 4]]) == [range(0, 1), range(1, 4)]
    with pytest.raises(ConfigError, match="covers blocks 0..2 but the model has 4 blocks"):
        stage_ranges([1] * 4, 2, [[0, 1], [1, 3]])
    with pytest.raises(ConfigError, match="pp_split has 3 ranges but there are 2 stages"):
        stage_ranges([1] * 4, 2, [[0, 1], [1, 2], [2, 4]])


def test_stage_placement_per_schedule_style():
    assert [stage_ids(r, 2, 1, "1f1b") for r in range(2)] == [[0], [1]]
    assert [stage_ids(r, 4, 2, "interleaved_1f1b") for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stage_ids(r, 4, 2, "zbv") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert last_stage_rank(4, 2, "interleaved_zb") == 3 and last_stage_rank(4, 2, "dualpipev") == 0


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
