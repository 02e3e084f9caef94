"""``ndparallel train`` on documents: a folder of text files and a JSONL file, each file / line one document,
packed with document masks. The windows' masks (positions restarting per document, document ids), the refusals
of bad JSONL, and the whole job in float64 on dp_shard 2 x cp 2 (2 micro-batches), tp 2 x cp 2 and pp 2 x dp 2
against one process within 1e-10."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ndparallel.errors import ConfigError
from ndparallel.testing import run_distributed
from ndparallel.train.data import DOCUMENT_START, BatchLoader, ByteCorpus

TEXTS = ["alpha beta gamma " * 3, "x = 1\n" * 9, "short", "the quick brown fox jumps " * 4]


def write_corpus(root) -> tuple:
    """A folder of text files and a JSONL file with the same documents."""
    folder = root / "docs"
    folder.mkdir()
    for i, text in enumerate(TEXTS):
        (folder / f"{i}.txt").write_text(text)
    jsonl = root / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)))
    return folder, jsonl


def test_documents_from_a_folder_and_a_jsonl_are_the_same_windows_with_masks(tmp_path):
    folder, jsonl = write_corpus(tmp_path)
    a, b = ByteCorpus(16, folder, documents=True), ByteCorpus(16, jsonl, documents=True)
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.starts, b.starts)
    expected = b"".join(bytes([DOCUMENT_START]) + t.encode() for t in TEXTS)
    assert bytes(a.tokens.tolist()) == expected
    for index in range(a.num_windows):
        positions, ids = a.window_documents(index)
        start = index * 16
        for offset in range(16):
            doc = ids[offset]
            assert a.starts[doc] <= start + offset < a.starts[doc] + len(TEXTS[doc]) + 1
            first = max(a.starts[doc], start)  # a document cut by the window edge starts again at 0
            assert positions[offset] == start + offset - first
    loader = BatchLoader(a, global_batch=2, dp_rank=1, dp_size=2)
    masks = loader.masks(0)
    assert set(masks) == {"positions", "document_ids"} and masks["positions"].shape == (1, 16)
    assert BatchLoader(ByteCorpus(16, folder), 2).masks(0) == {}, "the byte stream carries no masks"


def test_bad_jsonl_is_named_with_its_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(ConfigError, match=r"line 2 is not JSON"):
        ByteCorpus(4, bad, documents=True)
    bad.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(ConfigError, match=r"line 2 has no string field 'text'; set data.text_field"):
        ByteCorpus(4, bad, documents=True)
    bad.write_text('{"body": "no text"}\n')
    assert ByteCorpus(4, bad, documents=True, text_field="body").tokens.size == len("no text") + 1


def _train_many(configs: list[dict]) -> list[dict]:
    from ndparallel.train import TrainConfig, train

    return [
        {"losses": r.losses, "grad_norms": r.grad_norms}
        for r in (train(TrainConfig.from_dict(config)) for config in configs)
    ]


def _config(parallelism: dict, path: str) -> dict:
    return {
        "parallelism": parallelism,
        "model": {"preset": "tiny", "max_seq_len": 32, "dtype": "float64"},
        "data": {"path": path, "seq_len": 32, "documents": True},
        "train": {"steps": 2, "global_batch": 4, "lr": 0.01, "warmup_steps": 1, "log_every": 100},
    }


@pytest.mark.slow  # one 4-rank group of three jobs: ~15 s
def test_document_training_matches_one_process(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    generator = np.random.default_rng(0)
    for i in range(24):  # documents of 5 to 60 bytes: several per window, some cut by window edges
        (folder / f"{i:02}.txt").write_bytes(bytes(generator.integers(32, 127, generator.integers(5, 60)).tolist()))
    stream = {**_config({}, str(folder)), "data": {"path": str(folder), "seq_len": 32}}  # no documents: no masks
    reference, stream = run_distributed(_train_many, 1, [_config({}, str(folder)), stream])[0]
    assert stream["losses"][0] != pytest.approx(reference["losses"][0], abs=1e-6), "the masks must matter"
    layouts = [
        ({"dp_shard_size": 2, "cp_size": 2}, {"micro_batch": 1}),
        ({"tp_size": 2, "cp_size": 2}, {}),
        ({"pp_size": 2, "dp_shard_size": 2}, {}),
    ]
    configs = []
    for parallelism, train in layouts:
        config = _config(parallelism, str(folder))
        config["train"].update(train)
        configs.append(config)
    for (parallelism, _), got in zip(layouts, run_distributed(_train_many, 4, configs)[0], strict=True):
        assert got["losses"] == pytest.approx(reference["losses"], abs=1e-10), parallelism
        assert got["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-10), parallelism
    assert torch.isfinite(torch.tensor(reference["losses"])).all()
