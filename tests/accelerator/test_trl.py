"""TRL's ``SFTTrainer`` on ndparallel (``ndparallel.hf.trainer_class(SFTTrainer)``) against TRL's own run in one
process: the same tiny float64 Llama, pre-tokenized data, global batch 8 in sequential order, SGD with clipping.

The runs are ``tests/accelerator/trl_job.py``: one plain process for the references and one
``ndparallel launch --cpu-ranks 4`` for the layouts. TRL computes its loss and metrics itself, through a fused
LM head whose kernel accumulates in float32 (trl/kernels/chunked_logprob.py), and logs the loss as a float32: so
even a float64 model has a float32 floor. Measured floor: TRL's own one-process run with the batch as two or four
accumulated parts differs from the whole batch by up to 4.8e-7 in the loss (one float32 step), 8.5e-9 relative in
the grad norm, 7.2e-7 in the token accuracy / entropy and 8.1e-9 in a final weight after 3 steps; the layouts
measured 4.8e-7, 3.8e-8 (pp, whose float64 pipeline loss is not TRL's float32 kernel), 4.8e-7 and 8.0e-9
(docs/fine-tuning.md). SGD, not AdamW: AdamW's first steps normalise every gradient entry to about +-lr, so an
entry near zero turns float32 round-off into lr-sized weight differences (4e-6 measured) that hide nothing. A
1/cp loss (the bug this guards) is off by 2.
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
LOSS_TOL, NORM_TOL, WEIGHT_TOL, METRIC_TOL = 2e-6, 2e-7, 5e-8, 2e-6  # a few times the floor (module doc)
# bf16=True (float32 model, 6 steps) against one process's bf16=True: its own bf16 noise (the batch in accumulated
# halves) measured 3.4e-5 / 6.9e-5 / 6.4e-5 (loss, relative grad norm, weight), dp_shard 4 2.1e-5 / 7.5e-5 /
# 5.5e-5; FSDP's bf16 compute instead 9.1e-5 / 4.4e-4 / 1.2e-4 (docs/fine-tuning.md#bf16)
BF16_TOLS = (1e-4, 2e-4, 1.5e-4, 5e-3)  # the last: a top-1 flip (1/248) is bf16 noise too

PAD4 = {"pad_to_multiple_of": 4}  # rows a multiple of 2 x cp (cp's load balancing) and of tp (sequence parallel)
REFERENCES = {  # TRL's own run in one process: name -> spec
    "full": {"data": "full"},
    "text": {"data": "text", "sft": PAD4},
    "completion": {"data": "completion", "sft": {"completion_only_loss": True, **PAD4}},
    "assistant": {"data": "assistant", "sft": PAD4},
    "padding_free": {"data": "text", "sft": {"padding_free": True, "max_length": None, **PAD4}},
    "packing": {"data": "text", "sft": {"packing": True, **PAD4}},
    "dpo": {"trainer": "dpo"},  # TRL's DPOTrainer: its own loss, exact on data ranks, refused under tp/cp/pp
    "bf16": {"data": "full", "dtype": "float32", "bf16": True, "steps": 6},  # one process's autocast
}
DP2_CP2, DP2_TP2, PP2_DP2 = {"dp_shard_size": 2, "cp_size": 2}, {"dp_shard_size": 2, "tp_size": 2}, {"pp_size": 2}
# name: (reference, mesh sizes, extra spec); the default tier (make test), then the wide matrix (make zoo)
LAYOUTS = {
    "dp2_cp2_acc2": ("full", DP2_CP2, {"accumulation": 2}),  # TRL's loss was 1/cp
    "dp2_tp2_padded": ("text", DP2_TP2, {}),  # TRL's fused head crashed on the shards; padding masks (tp)
    # the pipeline's loss and masks, rows padded to one length (torch's schedule fixes shapes): the same real
    # tokens and labels as "text", whose rows are padded less
    "pp2_dp2_padded": ("text", {**PP2_DP2, "dp_shard_size": 2}, {"sft": {"pad_to_multiple_of": 32}}),
    "bf16_dp4": ("bf16", {"dp_shard_size": 4}, {}),  # bf16=True: autocast as one process, not FSDP's bf16
}
MATRIX = {
    "dp4_completion": ("completion", {"dp_shard_size": 4}, {}),
    "dp4_assistant": ("assistant", {"dp_shard_size": 4}, {}),
    "dp4_packing": ("packing", {"dp_shard_size": 4}, {}),
    "dp4_padding_free": ("padding_free", {"dp_shard_size": 4}, {}),
    "dp2_cp2_padded": ("text", DP2_CP2, {}),
    "dp2_cp2_completion": ("completion", DP2_CP2, {}),
    "dp2_cp2_assistant": ("assistant", DP2_CP2, {}),
    "dp2_cp2_padding_free": ("padding_free", DP2_CP2, {}),  # the alternative to packing, which TRL refuses on cp
    # the exact alternative: the dataset packed by trl.data_utils.pack_dataset, trained padding-free, against
    # TRL's own packing=True in one process
    "dp2_cp2_prepacked": ("packing", DP2_CP2, {"data": "prepacked", "sft": REFERENCES["padding_free"]["sft"]}),
    "dp2_tp2_packing": ("packing", DP2_TP2, {}),
    "dp2_tp2_padding_free": ("padding_free", DP2_TP2, {}),
    "tp2_cp2_completion": ("completion", {"tp_size": 2, "cp_size": 2}, {}),
    "pp2_tp2": ("full", {**PP2_DP2, "tp_size": 2}, {}),
    "dpo_dp4": ("dpo", {"dp_shard_size": 4}, {}),
    "dpo_hsdp": ("dpo", {"dp_replicate_size": 2, "dp_shard_size": 2}, {}),
    "bf16_dp2_tp2": ("bf16", DP2_TP2, {}),
    "bf16_dp2_cp2": ("bf16", DP2_CP2, {}),
    "bf16_pp2_dp2": ("bf16", {**PP2_DP2, "dp_shard_size": 2}, {}),
}
DP2_TP2_CP2 = {"dp_shard_size": 2, "tp_size": 2, "cp_size": 2}
MATRIX_8 = {
    "dp2_tp2_cp2_padding_free": ("padding_free", DP2_TP2_CP2, {}),
    "dp2_tp2_cp2_completion": ("completion", DP2_TP2_CP2, {}),
}


def _runs(printed: str) -> dict[str, dict]:
    return {
        line.split()[1]: json.loads(line.split(" ", 2)[2]) for line in printed.splitlines() if line.startswith("RUN ")
    }


def _weights(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(folder / "model.safetensors"))


def _plain(root: Path, names: set[str]) -> dict:
    runs = [{"out": str(root / name), **REFERENCES[name]} for name in sorted(names)]
    done = subprocess.run(
        [sys.executable, JOB, json.dumps(runs), "--plain"], capture_output=True, text=True, timeout=900, cwd=REPO,
        env=clean_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return _runs(done.stdout)


def _launch(root: Path, layouts: dict, ranks: int, extra_runs: list | None = None) -> dict:
    runs = [
        {"out": str(root / name), **REFERENCES[ref], **extra, "sizes": sizes}
        for name, (ref, sizes, extra) in layouts.items()
    ]
    runs += extra_runs or []  # refusals last: a run that raises mid-way leaves nothing behind for the next
    done = run_ndparallel("launch", "--cpu-ranks", str(ranks), "--", JOB, json.dumps(runs), timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    return _runs(done.stdout)


def _compare(layouts: dict, root: Path, runs: dict, ref_root: Path, refs: dict) -> None:
    """Loss, grad norm, TRL's token accuracy, entropy and token count at every step, and every final weight."""
    for name, (ref_name, _, _) in layouts.items():
        loss_tol, norm_tol, weight_tol, metric_tol = (
            BF16_TOLS if ref_name == "bf16" else (LOSS_TOL, NORM_TOL, WEIGHT_TOL, METRIC_TOL)
        )
        got, ref = runs[str(root / name)]["logs"], refs[str(ref_root / ref_name)]["logs"]
        assert [r[0] for r in got] == [r[0] for r in ref] == list(range(1, len(ref) + 1)) and len(ref) >= 3, name
        for (_, loss, norm, accuracy, entropy, tokens), (_, r_loss, r_norm, r_acc, r_ent, r_tokens) in zip(
            got, ref, strict=True
        ):
            assert abs(loss - r_loss) < loss_tol and abs(norm - r_norm) / r_norm < norm_tol, (name, got, ref)
            if accuracy is not None:  # under pp TRL's compute_loss (its metrics) does not run
                assert abs(accuracy - r_acc) < metric_tol and abs(entropy - r_ent) < metric_tol, (name, got, ref)
                # TRL counts a padding-free row's positions, padding included: per rank, not per batch
                assert tokens == r_tokens or ref_name in ("packing", "padding_free"), (name, got, ref)
        final, ref_final = _weights(root / name / "final"), _weights(ref_root / ref_name / "final")
        assert sorted(final) == sorted(ref_final), name
        worst = max(float(np.abs(final[k] - ref_final[k]).max()) for k in ref_final)
        assert worst < weight_tol, (name, worst)


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("trl-plain")
    return root, _plain(root, {ref for ref, _, _ in LAYOUTS.values()})


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("trl-ndp")
    refused = [
        {"out": str(root / "refused_subclass_cp2"), "data": "full", "sizes": DP2_CP2, "subclass": True},
        {"out": str(root / "refused_dpo_tp2"), "trainer": "dpo", "sizes": DP2_TP2},
        {
            "out": str(root / "refused_packing_pp2"),
            "data": "text",
            "sft": {"packing": True},
            "sizes": {**PP2_DP2, "dp_shard_size": 2},
        },
    ]
    return root, _launch(root, LAYOUTS, 4, [{**run, "expect_error": True} for run in refused])


@pytest.mark.slow
@pytest.mark.jobs
def test_sft_trainer_equals_trls_own_one_process_run(references, launched):
    _compare(LAYOUTS, *launched, *references)


@pytest.mark.zoo
@pytest.mark.jobs
def test_sft_trainer_matrix_equals_trls_own_one_process_run(tmp_path):
    """Every data layout (padding, completion-only, assistant-only, packing, padding-free) on dp, cp, tp and pp,
    and a 3-D mesh on 8 ranks: ``make zoo``."""
    layouts = {**MATRIX, **MATRIX_8}
    refs = _plain(tmp_path / "plain", {ref for ref, _, _ in layouts.values()})
    runs = {**_launch(tmp_path / "ndp", MATRIX, 4), **_launch(tmp_path / "ndp", MATRIX_8, 8)}
    _compare(layouts, tmp_path / "ndp", runs, tmp_path / "plain", refs)


@pytest.mark.slow
@pytest.mark.jobs
def test_what_would_differ_is_refused_by_name_at_trainer_init(launched):
    """A user's ``compute_loss`` under cp, ``DPOTrainer`` under tp (its loss sees one rank's shard of the logits),
    TRL's packing under pp (one flattened row per batch): refused at ``Trainer(...)``, on every rank."""
    root, runs = launched
    expected = {
        "refused_subclass_cp2": "Custom.compute_loss under cp_size=2 computes the loss outside",
        "refused_dpo_tp2": "DPOTrainer.compute_loss under tp_size=2 computes the loss outside",
        "refused_packing_pp2": "SFTTrainer(packing=True) under pp_size=2: TRL flattens each batch into one row",
    }
    for name, message in expected.items():
        error = runs[str(root / name)]["error"]
        assert error.startswith("ConfigError: ") and message in error, (name, error)


@pytest.mark.zoo
@pytest.mark.jobs
def test_the_sft_example_prints_its_one_process_losses_on_cp_with_padding_free(tmp_path):
    """examples/sft_trl.py on dp_shard 2 x cp 2 with padding-free batches, against the same script in one
    process: the losses it prints (4 decimals) are the same."""
    example = str(REPO / "examples" / "sft_trl.py")
    args = ["--steps", "10", "--padding-free", "--output-dir"]
    plain = subprocess.run(
        [sys.executable, example, *args, str(tmp_path / "plain")], capture_output=True, text=True, timeout=600,
        cwd=REPO, env=clean_env(),
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr[-3000:]
    cp_args = ["--cp", "2", *args, str(tmp_path / "cp")]
    done = run_ndparallel("launch", "--cpu-ranks", "4", "--", example, *cp_args, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [line for line in plain.stdout.splitlines() if line.startswith("losses")]
    assert losses and losses[0].split(";")[0] in done.stdout, (plain.stdout[-500:], done.stdout[-500:])
