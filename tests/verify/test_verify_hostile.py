"""Hostile input to ``ndparallel verify`` refused (or accepted) before any rank starts, in this process: a
dimension given twice, a model without trainable parameters, forwards that return their logits in a dict, an
object, a tuple or flattened, and ``--json`` to a folder or an unwritable path (checked before the run: a PASS
never exits 1 because of its report file)."""

from __future__ import annotations

import pytest
import torch

from ndparallel.errors import ConfigError
from ndparallel.verify.layouts import parse_layouts
from ndparallel.verify.model import model_spec
from tests.verify import toy


def test_a_dimension_given_twice_is_refused():
    with pytest.raises(ConfigError, match=r"layout 'tp=2,tp=2' gives tp twice"):
        parse_layouts("tp=2,tp=2", 4)
    with pytest.raises(ConfigError, match=r"gives dp_shard twice"):
        parse_layouts("dp_shard=2;dp_shard=2,dp_shard_size=2", 4)


def test_forward_outputs_with_logits_are_read_and_the_rest_refused(monkeypatch):
    spec = model_spec("tests.verify.toy:build")
    tokens, positions = torch.randint(0, toy.VOCAB, (2, 8)), torch.arange(8)
    expected = spec.logits(spec.build(), tokens, positions)
    for how in ("dict", "object"):
        monkeypatch.setattr(toy, "build", lambda how=how: toy.Returns(how))
        assert torch.equal(spec.logits(spec.build(), tokens, positions), expected), how
    refusals = {
        "tuple": "the forward returned a tuple with no logits",
        "scores": "the forward returned a dict with no logits",
        "flat": r"logits of shape \(16, 64\) for tokens of shape \(2, 8\): verify needs \[batch, seq, vocab\]",
    }
    for how, message in refusals.items():
        monkeypatch.setattr(toy, "build", lambda how=how: toy.Returns(how))
        with pytest.raises(ConfigError, match=message):
            spec.logits(spec.build(), tokens, positions)


def test_a_model_without_trainable_parameters_is_refused():
    from ndparallel.verify import verify

    with pytest.raises(ConfigError, match="Toy has no trainable parameters"):
        verify("tests.verify.toy:build_frozen", "dp_shard=2", cpu_ranks=2)


def test_json_to_a_folder_or_an_unwritable_path_exits_2_before_the_run(tmp_path, capsys):
    from ndparallel.launch.cli import main

    for target, cause in ((tmp_path, "is a folder: name a file"), (tmp_path / "no" / "r.json", "cannot be written")):
        assert main(["verify", "--model", "tiny", "--layouts", "tp=2", "--json", str(target)]) == 2
        err = capsys.readouterr().err
        assert f"ndparallel: error: --json='{target}' {cause}" in err and "verify:" not in err, err
