"""Hostile Hugging Face folders for ``load_pretrained`` and ``import_safetensors``, one process: a header that
declares a float weight ``I32`` (same bytes), a sharded folder missing a shard, an index that maps a tensor to a
shard that does not hold it. Each is refused in one line naming the file and the fix (before, the dtype lie
loaded integers cast to floats, and the other two surfaced as raw or misleading errors)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install 'ndparallel[hf]'")

from ndparallel.errors import CheckpointError, ConfigError  # noqa: E402

VICTIM = "model.layers.0.mlp.up_proj.weight"


def _tiny(path: Path, **save) -> None:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).float().save_pretrained(path, **save)  # F32, whatever the default dtype


def _declare(file: Path, name: str, dtype: str) -> None:
    """Rewrite ``name``'s dtype in ``file``'s header, same length, same bytes after it."""
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header[name]["dtype"] = dtype
    text = json.dumps(header, separators=(",", ":")).encode()
    file.write_bytes(raw[:8] + text.ljust(length) + raw[8 + length :])


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile-hf")
    _tiny(root / "lie")
    _declare(root / "lie" / "model.safetensors", VICTIM, "I32")
    _tiny(root / "sharded", max_shard_size="40KB")
    return {"lie": root / "lie", "sharded": root / "sharded"}


def _load(folder: Path):
    from ndparallel.distributed.process import destroy_distributed
    from ndparallel.hf import load_pretrained

    try:  # without a mesh, load_pretrained starts a one-process group
        return load_pretrained(folder)
    finally:
        destroy_distributed()


def test_a_float_weight_declared_int32_is_refused_by_load_pretrained_and_import(folders):
    from ndparallel.checkpoint import import_safetensors

    with pytest.raises(ConfigError, match=rf"{VICTIM}: 'model.safetensors' stores it as I32, which does not fit"):
        _load(folders["lie"])
    model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(folders["lie"])).float()
    before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    with pytest.raises(CheckpointError, match=rf"stored dtypes of another kind .*{VICTIM}: file I32 vs model"):
        import_safetensors(folders["lie"] / "model.safetensors", model)
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, before)  # untouched


def test_a_missing_shard_and_an_index_pointing_at_the_wrong_shard_are_named(folders, tmp_path):
    index = json.loads((folders["sharded"] / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2, shards  # the case needs a sharded folder
    assert _load(folders["sharded"]).model.embed_tokens.weight.shape == (64, 32)  # the folder itself loads
    missing = tmp_path / "missing"
    missing.mkdir()
    for file in folders["sharded"].iterdir():
        if file.name != shards[-1]:
            (missing / file.name).write_bytes(file.read_bytes())
    with pytest.raises(ConfigError, match=rf"maps tensors to \['{shards[-1]}'\] \(1 shard\(s\)\), which are not in"):
        _load(missing)
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    for file in folders["sharded"].iterdir():
        (wrong / file.name).write_bytes(file.read_bytes())
    name = next(k for k, v in index["weight_map"].items() if v == shards[0])
    index["weight_map"][name] = shards[-1]
    (wrong / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=rf"index.json maps '{name}' to '{shards[-1]}', which does not hold it"):
        _load(wrong)
