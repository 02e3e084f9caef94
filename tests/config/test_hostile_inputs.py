"""Hostile input, round 2 (issue 27): each case is refused in one line, within seconds, or now does the right thing."""

from __future__ import annotations

import time

import pytest
import torch

from ndparallel.errors import ConfigError
from ndparallel.launch.cli import main


def _one_line_error(capsys, argv: list[str], fragment: str, prefix: str = "ndparallel: error: ") -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(prefix) and err.count("\n") == 1, err
    assert fragment in err, err
    return err


# ------------------------------------------------------------------ 7: the model follows torch's default dtype
def test_transformer_follows_torch_default_dtype():
    from ndparallel.models import Transformer, TransformerConfig

    before = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        model = Transformer(TransformerConfig.from_preset("tiny"))
        assert {p.dtype for p in model.parameters()} == {torch.float64}
        assert TransformerConfig().dtype == "float64"
        torch.set_default_dtype(torch.bfloat16)
        with pytest.raises(ConfigError, match="torch.get_default_dtype\\(\\) is torch.bfloat16"):
            TransformerConfig()
    finally:
        torch.set_default_dtype(before)
    assert TransformerConfig().dtype == "float32"
    assert TransformerConfig(dtype="float64").torch_dtype == torch.float64  # an explicit dtype still wins
    with pytest.raises(ConfigError, match="model.dtype='bf16' must be one of"):
        TransformerConfig.from_dict({"dtype": "bf16"})
    with pytest.raises(ConfigError, match="model.dtype=3 must be a string or null"):
        TransformerConfig.from_dict({"dtype": 3})
