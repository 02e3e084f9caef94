"""🤗 Accelerate's own examples, kept verbatim in tests/accelerator/examples/upstream/, run with their imports
renamed to ndparallel and compared with Accelerate's run of the same file on the same torchrun CPU ranks
(tests/accelerator/twin.py), GLUE MRPC and BERT swapped for tiny local ones (examples/tiny_glue.py): every
training loss, everything the script prints (evaluation metrics, gathered predictions) and the files it saves.

``make test`` runs nlp_example on 2 ranks; ``make accelerate-examples`` (marker ``examples``) runs every example
on 1, 2 and 4 ranks, and the checkpointing example's resume from the other library's folder. On 1 and 2 ranks
the runs are bit-identical (measured); on 4, gloo sums the gradient buckets of DDP and of ndparallel in another
order, so numbers agree to fp32 round-off (held to 1e-4 relative). docs/accelerate-migration.md lists the
examples that cannot run here and why."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.accelerator.accelerate_twins import run_twin

pytest.importorskip("accelerate")
pytest.importorskip("datasets")

UPSTREAM = Path(__file__).parent / "examples" / "upstream"
SETUP = {"TWIN_SETUP": "tests.accelerator.examples.tiny_glue"}
PACKAGES = ("ndparallel", "accelerate")

# example -> its command-line arguments
EXAMPLES: dict[str, list[str]] = {
    "nlp_example": [],
    "complete_nlp_example": ["--checkpointing_steps", "epoch", "--with_tracking"],
    "checkpointing": ["--checkpointing_steps", "epoch"],
    "gradient_accumulation": ["--gradient_accumulation_steps", "2"],
    "tracking": ["--with_tracking"],
    "memory": [],
    "multi_process_metrics": [],
    "early_stopping": [],
    "local_sgd": ["--local_sgd_steps", "2"],
    "profiler": ["--output_trace_dir", "traces"],
    "automatic_gradient_accumulation": [],
    "ddp_comm_hook": [],
}
_NUMBER = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?")


def _close(ours: str, theirs: str, relative: float) -> bool:
    """Two texts equal but for their decimal numbers, which agree within ``relative``."""
    if _NUMBER.sub("#", ours) != _NUMBER.sub("#", theirs):
        return False
    pairs = zip(map(float, _NUMBER.findall(ours)), map(float, _NUMBER.findall(theirs)), strict=True)
    return all(abs(a - b) <= relative * max(1.0, abs(b)) for a, b in pairs)


def compare(out: Path, ranks: int, only_epochs: bool = False) -> None:
    """Losses and printed output of every rank of the two runs: identical on 1 and 2 ranks, within fp32
    round-off on 4 (``only_epochs``: the per-epoch lines only; the profiler's tables are timings)."""
    relative = 0.0 if ranks <= 2 else 1e-4
    for rank in range(ranks):
        ours, theirs = (
            json.loads((out / p / f"losses_rank{rank}.json").read_text()) for p in ("ndparallel", "accelerate")
        )
        assert len(ours) == len(theirs) > 0, (rank, len(ours), len(theirs))
        worst = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(ours, theirs, strict=True))
        assert worst <= relative, (rank, worst)
        printed = [(out / p / f"stdout_rank{rank}.txt").read_text() for p in PACKAGES]
        if only_epochs:
            printed = ["".join(line for line in text.splitlines(True) if line.startswith("epoch")) for text in printed]
        assert _close(*printed, relative), (rank, printed)


def _run(tmp_path: Path, name: str, ranks: int, *extra: str) -> Path:
    run_twin(UPSTREAM / f"{name}.py", tmp_path, ranks, *EXAMPLES[name], *extra, env=SETUP)
    compare(tmp_path, ranks, only_epochs=name == "profiler")
    return tmp_path


@pytest.mark.jobs
@pytest.mark.slow
def test_nlp_example_on_two_ranks_equals_accelerates(tmp_path):
    out = _run(tmp_path, "nlp_example", 2)
    printed = (out / "ndparallel" / "stdout_rank0.txt").read_text()
    assert printed.count("epoch ") == 3 and "'accuracy'" in printed and "=====  tensor" in printed


@pytest.mark.examples
@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_equals_accelerates(tmp_path, name, ranks):
    if (name, ranks) == ("nlp_example", 2):
        pytest.skip("run by test_nlp_example_on_two_ranks_equals_accelerates")
    out = _run(tmp_path, name, ranks)
    if name == "checkpointing":
        _same_folders(out / "ndparallel", out / "accelerate", ["epoch_0", "epoch_1", "epoch_2"], ranks)
    if name == "profiler":
        assert sorted(p.name for p in (out / "ndparallel" / "traces").iterdir()) == [
            f"profile_{r}.json" for r in range(ranks)
        ]


@pytest.mark.examples
@pytest.mark.parametrize("ranks", [1, 2])
def test_checkpointing_example_resumes_from_the_other_librarys_folder(tmp_path, ranks):
    """Each library resumes epoch 2 from the folder the other wrote (``--resume_from_checkpoint`` names it
    relative to the run's own folder), and goes on as the uninterrupted runs did."""
    first = _run(tmp_path / "first", "checkpointing", ranks)
    for other in ("accelerate", "ndparallel"):  # each run gets the same arguments: one reads the other's folder
        resumed = tmp_path / f"from_{other}"
        run_twin(UPSTREAM / "checkpointing.py", resumed, ranks, *EXAMPLES["checkpointing"], "--resume_from_checkpoint",
                 str(first / other / "epoch_1"), env=SETUP)  # fmt: skip
        for package in ("ndparallel", "accelerate"):
            printed = (resumed / package / "stdout_rank0.txt").read_text()
            uninterrupted = (first / package / "stdout_rank0.txt").read_text()
            assert printed.strip().splitlines()[-1] == uninterrupted.strip().splitlines()[-1], (other, package)


def _same_folders(ours: Path, theirs: Path, names: list[str], ranks: int) -> None:
    """The save_state folders of both runs: the same files, byte for byte on 1 and 2 ranks (measured), the same
    model tensors within fp32 round-off on 4."""
    from safetensors.torch import load_file

    for name in names:
        files = sorted(p.name for p in (ours / name).iterdir())
        assert files == sorted(p.name for p in (theirs / name).iterdir()), name
        if ranks <= 2:
            for file in files:
                assert (ours / name / file).read_bytes() == (theirs / name / file).read_bytes(), (name, file)
            continue
        mine, reference = load_file(ours / name / "model.safetensors"), load_file(theirs / name / "model.safetensors")
        assert mine.keys() == reference.keys(), name
        assert all((mine[k] - reference[k]).abs().max() <= 1e-5 for k in mine), name
