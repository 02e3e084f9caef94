"""The one FQN-pattern meaning (ndparallel.plans.fqn) and the model-family registry (ndparallel.family)."""

from __future__ import annotations

import pytest
import torch

from ndparallel.models import Transformer, TransformerConfig
from ndparallel.plans.fqn import first_match, fqn_matches, matching_modules


@pytest.mark.parametrize(
    ("fqn", "pattern", "expected"),
    [
        ("layers.0.attention", "layers.*.attention", True),
        ("layers.11.attention", "layers.*.attention", True),
        ("layers.0.block.attention", "layers.*.attention", False),  # `*` never crosses a dot
        ("layers.0", "layers.*.attention", False),
        ("layers.0.attention.core_attention", "*core_attention", False),
        ("layers.3.feed_forward.w1", "layers.*.feed_forward.w[13]", True),
        ("layers.3.feed_forward.w2", "layers.*.feed_forward.w[13]", False),
        ("norm", "norm", True),
        ("Norm", "norm", False),  # case-sensitive
        ("layers.0.attention_norm", "layers.?.attention_norm", True),
        ("", "*", False),  # the root matches no pattern
    ],
)
def test_fqn_pattern_meaning(fqn: str, pattern: str, expected: bool) -> None:
    assert fqn_matches(fqn, pattern) is expected


def test_reference_plan_patterns_match_one_module_per_layer() -> None:
    from ndparallel.plans.tensor_parallel import transformer_tp_plan

    with torch.device("meta"):
        model = Transformer(TransformerConfig.from_preset("tiny", n_layers=3))
    plan = transformer_tp_plan()
    for pattern in plan:
        names = [name for name, _ in matching_modules(model, pattern)]
        expected = [pattern.replace("*", str(i)) for i in range(3)] if "*" in pattern else [pattern]
        assert names == expected, pattern
    assert first_match("layers.2.attention.wq", plan) is plan["layers.*.attention.wq"]
    assert first_match("layers.2.attention.core_attention", plan) is None
