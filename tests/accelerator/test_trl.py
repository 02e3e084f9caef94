"""TRL's ``SFTTrainer`` on ndparallel (``ndparallel.hf.trainer_class(SFTTrainer)``) against TRL's own run in one
process: the same tiny float64 Llama, pre-tokenized data, global batch 8 in sequential order, AdamW, clipping.

The runs are ``tests/accelerator/trl_job.py``: one plain process for the references and one
``ndparallel launch --cpu-ranks 4`` for the layouts. TRL computes its loss and metrics itself, through a fused
LM head whose kernel accumulates in float32 (trl/kernels/chunked_logprob.py), and logs the loss as a float32: so
even a float64 model has a float32 floor. Measured floor: TRL's own one-process run with the batch as two
accumulated halves or quarters differs from the whole batch by up to 4.8e-7 in the loss, 2.6e-9 relative in the
grad norm, 3.6e-7 in the token accuracy / entropy and 2.7e-8 in any final weight after 3 steps
(docs/fine-tuning.md); the bounds below are a few times that. A 1/cp loss (the bug this guards) is off by 2.
Under pp the loss is not TRL's but the pipeline's float64 cross entropy of the same labels: it differs from
TRL's float32 kernel by up to 1.1e-7 relative in the grad norm and 1.0e-6 in a final weight (AdamW normalises
those gradient differences into lr-sized ones), hence its own bounds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("trl", reason="TRL's trainers need the trl extra (make test installs it)")
pytest.importorskip("datasets", reason="TRL's trainers need datasets (make test installs it)")

from tests.command import REPO, clean_env, run_ndparallel  # noqa: E402

JOB = str(Path(__file__).with_name("trl_job.py"))
LOSS_TOL, NORM_TOL, WEIGHT_TOL, METRIC_TOL = 2e-6, 1e-7, 2e-7, 2e-6
PP_NORM_TOL, PP_WEIGHT_TOL = 5e-7, 5e-6  # float64 pipeline loss against TRL's float32 kernel (module doc)

# name: (reference run, mesh sizes, extra spec)
LAYOUTS = {
    "dp2_cp2_acc2": ("full", {"dp_shard_size": 2, "cp_size": 2}, {"accumulation": 2}),  # TRL's loss was 1/cp
    "dp2_tp2": ("full", {"dp_shard_size": 2, "tp_size": 2}, {}),  # TRL's fused head crashed on the shards
    "dp4_completion": ("completion", {"dp_shard_size": 4}, {"sft": {"completion_only_loss": True}}),  # padding
    "pp2_dp2": ("full", {"pp_size": 2, "dp_shard_size": 2}, {}),  # the pipeline's loss, no TRL metrics
}
REFERENCES = {"full": {"data": "full"}, "completion": {"data": "completion", "sft": {"completion_only_loss": True}}}


def _runs(printed: str) -> dict[str, dict]:
    return {
        line.split()[1]: json.loads(line.split(" ", 2)[2]) for line in printed.splitlines() if line.startswith("RUN ")
    }


def _weights(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("trl-plain")
    runs = [{"out": str(root / name), **spec} for name, spec in REFERENCES.items()]
    done = subprocess.run(
        [sys.executable, JOB, json.dumps(runs), "--plain"], capture_output=True, text=True, timeout=600, cwd=REPO,
        env=clean_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return root, _runs(done.stdout)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("trl-ndp")
    runs = [
        {"out": str(root / name), **REFERENCES[ref], **extra, "sizes": sizes}
        for name, (ref, sizes, extra) in LAYOUTS.items()
    ]
    refused = {"data": "full", "sizes": {"dp_shard_size": 2, "cp_size": 2}, "subclass": True, "expect_error": True}
    runs.append({"out": str(root / "refused_subclass_cp2"), **refused})
    done = run_ndparallel("launch", "--cpu-ranks", "4", "--", JOB, json.dumps(runs), timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return root, _runs(done.stdout)


@pytest.mark.slow
@pytest.mark.jobs
def test_sft_trainer_equals_trls_own_one_process_run(references, launched):
    """Loss, grad norm, TRL's token accuracy, entropy and token count at every step, and every final weight."""
    ref_root, refs = references
    root, runs = launched
    for name, (ref_name, sizes, _) in LAYOUTS.items():
        norm_tol, weight_tol = (PP_NORM_TOL, PP_WEIGHT_TOL) if sizes.get("pp_size", 1) > 1 else (NORM_TOL, WEIGHT_TOL)
        got, ref = runs[str(root / name)]["logs"], refs[str(ref_root / ref_name)]["logs"]
        assert [r[0] for r in got] == [r[0] for r in ref] == [1, 2, 3], name
        for (_, loss, norm, accuracy, entropy, tokens), (_, r_loss, r_norm, r_acc, r_ent, r_tokens) in zip(
            got, ref, strict=True
        ):
            assert abs(loss - r_loss) < LOSS_TOL and abs(norm - r_norm) / r_norm < norm_tol, (name, got, ref)
            if accuracy is not None:  # under pp TRL's compute_loss (its metrics) does not run
                assert abs(accuracy - r_acc) < METRIC_TOL and abs(entropy - r_ent) < METRIC_TOL, (name, got, ref)
                assert tokens == r_tokens, name
        final, ref_final = _weights(root / name / "final"), _weights(ref_root / ref_name / "final")
        assert sorted(final) == sorted(ref_final), name
        worst = max(float(np.abs(final[k] - ref_final[k]).max()) for k in ref_final)
        assert worst < weight_tol, (name, worst)


@pytest.mark.slow
@pytest.mark.jobs
def test_a_compute_loss_override_under_cp_is_refused_at_trainer_init(launched):
    root, runs = launched
    error = runs[str(root / "refused_subclass_cp2")]["error"]
    assert error.startswith("ConfigError: ") and "Custom.compute_loss under cp_size=2" in error, error
