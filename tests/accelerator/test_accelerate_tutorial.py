"""Accelerate's tutorial loop (``Accelerator()``, ``prepare``, ``backward``, ``save(unwrap_model(model)
.state_dict())``) with its imports renamed equals 🤗 Accelerate's own run on the same torchrun CPU ranks: the
same losses, learning rates, gathered evaluation predictions and saved weights. ``Accelerator()`` is data
parallel over every rank, with Accelerate's data order (sampler and generator kept, whole batches dealt,
``even_batches``), its scheduler rule and its dropout streams.

Measured (torch 2.13 CPU, gloo): 1 and 2 ranks are bit-identical; on 4 ranks gloo sums the gradients of DDP's
and ndparallel's buckets in another order, 2.4e-7 at most in a loss and 3e-8 in a weight (fp32 round-off), so
4 ranks are held to 1e-5. Opt-in (``make accelerate-examples``): ``make test`` runs Accelerate's nlp_example on 2
ranks instead, which checks the same on a Hugging Face model (test_accelerate_examples.py)."""

from __future__ import annotations

import pytest
import torch

from tests.accelerator.accelerate_twins import SCRIPTS, largest_difference, rank_results, run_twin

pytest.importorskip("accelerate")

TOLERANCE = {1: 0.0, 2: 0.0, 4: 1e-5}


def _compare(out, ranks: int) -> None:
    ours, theirs = rank_results(out / "ndparallel", ranks), rank_results(out / "accelerate", ranks)
    difference, where = largest_difference(ours, theirs)
    assert difference <= TOLERANCE[ranks], (ranks, difference, where)
    assert len(ours[0]["losses"]) == 2 * -(-18 // ranks)  # two epochs of 18 batches dealt to the ranks
    mine, reference = torch.load(out / "ndparallel" / "model.pt"), torch.load(out / "accelerate" / "model.pt")
    assert list(mine) == list(reference)
    assert max((mine[k] - reference[k]).abs().max().item() for k in mine) <= TOLERANCE[ranks]
    assert len(ours[0]["predictions"][0]) == 27  # gather_for_metrics dropped the samples even_batches repeated


@pytest.mark.examples
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_tutorial_equals_accelerates(tmp_path, ranks):
    run_twin(SCRIPTS / "tutorial.py", tmp_path, ranks)
    _compare(tmp_path, ranks)


@pytest.mark.examples
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_a_stream_equals_accelerates(tmp_path, ranks):
    """An IterableDataset's loader: Accelerate dispatches it from the first process, and so does ndparallel; the
    losses and the gathered evaluation are identical (measured on 1, 2 and 4 ranks)."""
    run_twin(SCRIPTS / "stream.py", tmp_path, ranks)
    ours, theirs = rank_results(tmp_path / "ndparallel", ranks), rank_results(tmp_path / "accelerate", ranks)
    assert largest_difference(ours, theirs)[0] == 0.0
    assert [len(p) for p in ours[0]["predictions"]] == [23, 23]  # every sample once, the repeated ones dropped


@pytest.mark.examples
def test_tutorial_under_accelerate_launch_with_fsdp_equals_accelerates(tmp_path):
    """``accelerate launch --use_fsdp`` starts the renamed tutorial: ndparallel shards with FSDP2 (Accelerate
    falls back to DDP on CPU) and computes the same numbers as Accelerate's run, bit for bit on 2 ranks."""
    import socket
    import subprocess
    import sys

    from tests.accelerator.twin import renamed
    from tests.command import REPO, clean_env

    run_twin(SCRIPTS / "tutorial.py", tmp_path / "twin", 2, env={"TWIN_PACKAGES": "accelerate"})
    launched = tmp_path / "launched"
    launched.mkdir()
    (launched / "tutorial.py").write_text(renamed((SCRIPTS / "tutorial.py").read_text()))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--use_fsdp", "--fsdp_version", "2",
               "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(port), "tutorial.py"]  # fmt: skip
    env = {**clean_env(), "ACCELERATE_USE_CPU": "true", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=launched, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    ours, theirs = rank_results(launched, 2), rank_results(tmp_path / "twin" / "accelerate", 2)
    assert largest_difference(ours, theirs)[0] == 0.0
