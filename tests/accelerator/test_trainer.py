"""``ndparallel.hf.Trainer``: the transformers Trainer on ndparallel's engine equals transformers' own Trainer in
one process (float64), on six meshes (pp 2 x dp_shard 2 with gradient accumulation among them), resumes from its
checkpoint on other meshes, and saves transformers' layout.

The reference is transformers' ``Trainer`` itself (Accelerate's engine) in one process; the runs are
``tests/accelerator/trainer_job.py`` under ``ndparallel launch --cpu-ranks 4`` (real torchrun), one job for every
mesh (each run builds its own). Same model, data (sequential, global batch 8), AdamW, linear schedule, clipping.
Both use a float64 causal-LM loss (transformers' own casts float64 logits to float32; under tp / cp ndparallel's
loss is float64 anyway): losses, grad norms and parameters then agree to ~1e-15 (bound 1e-10).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="the Trainer needs the hf extra (make test installs it)")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (make test installs it)")

from tests.command import REPO, clean_env, run_ndparallel  # noqa: E402

JOB = str(Path(__file__).with_name("trainer_job.py"))
TOL = 1e-10
STEPS = 4
# the aux loss sums router probabilities in fp32 (transformers), over the ranks' rows in another order
MOE_TOL = 1e-7
EVAL_MESHES = ("hsdp", "dp2_cp2")  # dp 4 (predict's row order), and cp 2 (its eval loss is shared by 2 ranks)
MESHES = {
    "dp_shard4": {"dp_shard_size": 4},
    "hsdp": {"dp_replicate_size": 2, "dp_shard_size": 2},
    "dp2_tp2": {"dp_shard_size": 2, "tp_size": 2},
    "dp2_cp2": {"dp_shard_size": 2, "cp_size": 2},
    "tp2_cp2": {"tp_size": 2, "cp_size": 2},
    "pp2_dp2_acc2": {"pp_size": 2, "dp_shard_size": 2},  # the pipeline schedule per Trainer micro-batch
}
ACCUMULATION = {"pp2_dp2_acc2": 2}  # gradient accumulation steps (the same global batch of 8)
PADDED = {  # rows of 5 to 16 real tokens, padded left or right (trainer_job.py "data": "padded")
    "padded_dp2_cp2_acc2": {"dp_shard_size": 2, "cp_size": 2},
    "padded_tp2_cp2": {"tp_size": 2, "cp_size": 2},
    "padded_pp2_dp2": {"pp_size": 2, "dp_shard_size": 2},
}


def _runs(printed: str, tag: str = "RUN") -> dict[str, list]:
    return {
        line.split()[1]: json.loads(line.split(" ", 2)[2])
        for line in printed.splitlines()
        if line.startswith(f"{tag} ")
    }


def _loaded(folder: Path) -> dict[str, np.ndarray]:
    """The weights as transformers loads them (its save_pretrained writes Mixtral's experts one by one, ndparallel's
    fused: both load to the same tensors)."""
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float64)
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def _params(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    import torch

    path = tmp_path_factory.mktemp("trainer-llama")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).double().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    """A tiny float64 Mixtral whose outputs.loss carries the router aux loss (coefficient 0.1)."""
    import torch

    from ndparallel.hf import tiny_config

    path = tmp_path_factory.mktemp("trainer-mixtral")
    config = tiny_config("mixtral", output_router_logits=True, router_aux_loss_coef=0.1, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).double().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def plain_runs(model_dir, moe_dir, tmp_path_factory) -> tuple[Path, str]:
    """transformers' own Trainer in one process: the training run, one with evaluation (``eval``), one MoE."""
    root = tmp_path_factory.mktemp("plain")
    runs = json.dumps([
        {"out": str(root / "train"), "steps": STEPS},
        {"out": str(root / "eval"), "steps": STEPS, "eval": True},
        {"out": str(root / "moe"), "steps": STEPS, "model": str(moe_dir)},
        {"out": str(root / "padded"), "steps": STEPS, "data": "padded"},
    ])  # fmt: skip
    done = subprocess.run(
        [sys.executable, JOB, str(model_dir), runs, "--plain"], capture_output=True, text=True, timeout=300,
        cwd=REPO, env=clean_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return root, done.stdout


@pytest.fixture(scope="module")
def reference(plain_runs) -> tuple[list, dict]:
    root, printed = plain_runs
    return _runs(printed)[str(root / "train")], _params(root / "train" / "final")


@pytest.fixture(scope="module")
def launched(model_dir, moe_dir, tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("ndp")
    runs = [
        {"out": str(root / name), "sizes": sizes, "steps": STEPS, "accumulation": ACCUMULATION.get(name, 1)}
        for name, sizes in MESHES.items()
    ]
    runs[2]["save_steps"] = 2  # dp2_tp2 saves checkpoint-2: resumed below on two other meshes
    checkpoint = str(root / "dp2_tp2" / "checkpoint-2")
    runs.append(
        {"out": str(root / "resumed_tp2_cp2"), "sizes": MESHES["tp2_cp2"], "steps": STEPS, "resume": checkpoint}
    )
    runs.append({"out": str(root / "resumed_dp4"), "sizes": MESHES["dp_shard4"], "steps": STEPS, "resume": checkpoint})
    runs[5]["save_steps"] = 2  # pp2_dp2_acc2: its stages' DCP checkpoint, resumed on the same mesh
    pp_checkpoint = str(root / "pp2_dp2_acc2" / "checkpoint-2")
    runs.append({**runs[5], "out": str(root / "resumed_pp2_dp2"), "resume": pp_checkpoint, "save_steps": None})
    runs.append({"out": str(root / "moe_dp4"), "sizes": MESHES["dp_shard4"], "steps": STEPS, "model": str(moe_dir)})
    for name in EVAL_MESHES:  # evaluation, predict() and load_best_model_at_end (trainer_job.py: "eval")
        spec = {"out": str(root / f"eval_{name}"), "sizes": MESHES[name], "steps": STEPS, "eval": True}
        runs.append({**spec, "predict": MESHES[name].get("cp_size", 1) == 1})
    for name, sizes in PADDED.items():  # padded rows: the valid tokens differ per rank, shard and micro-batch
        runs.append({"out": str(root / name), "sizes": sizes, "steps": STEPS, "data": "padded"})
        runs[-1]["accumulation"] = 2 if name == "padded_dp2_cp2_acc2" else 1
    pp = {"out": str(root / "eval_pp2_dp2"), "sizes": MESHES["pp2_dp2_acc2"], "steps": STEPS, "eval": "loss"}
    pp["accumulation"] = 2  # micro-batches of 2 rows, as the eval batches: torch's schedule fixes the shape
    runs.append({**pp, "predict": False})  # under pp: the eval loss through the schedule, forward only
    done = run_ndparallel("launch", "--cpu-ranks", "4", "--", JOB, str(model_dir), json.dumps(runs), timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return root, {**_runs(done.stdout), **{f"EVAL {k}": v for k, v in _runs(done.stdout, "EVAL").items()}}


def _worst(logs: list, ref: list, first_step: int = 1) -> float:
    """The largest loss or relative grad-norm difference from step ``first_step`` on (a resumed run's history
    also holds the steps its checkpoint logged)."""
    logs, ref = [r for r in logs if r[0] >= first_step], [r for r in ref if r[0] >= first_step]
    assert [step for step, *_ in logs] == [step for step, *_ in ref], (logs, ref)
    return max(max(abs(a[1] - b[1]), abs(a[2] - b[2]) / b[2]) for a, b in zip(logs, ref, strict=True))


@pytest.mark.slow
@pytest.mark.jobs
def test_trainer_on_every_mesh_equals_transformers_trainer_in_one_process(reference, launched):
    ref_logs, ref_params = reference
    root, runs = launched
    assert len(ref_logs) == STEPS and max(r[2] for r in ref_logs) > 0.5  # clipping at 0.5 is active
    for name in MESHES:
        assert _worst(runs[str(root / name)], ref_logs) < TOL, name
        params = _params(root / name / "final")
        assert sorted(params) == sorted(ref_params), name  # transformers' own key layout
        worst = max(float(np.abs(params[k] - ref_params[k]).max()) for k in ref_params)
        assert worst < TOL, (name, worst)


@pytest.mark.slow
@pytest.mark.jobs
def test_trainer_resumes_its_checkpoint_on_other_meshes_exactly(reference, launched):
    """checkpoint-2 of dp_shard 2 x tp 2 (full weights, DCP optimizer, scheduler, trainer state), resumed on
    tp 2 x cp 2 and on dp_shard 4, and pp 2 x dp_shard 2's own (its stages' state) on that mesh: steps 3-4 and
    the final weights are the uninterrupted one process's."""
    ref_logs, ref_params = reference
    root, runs = launched
    checkpoint = root / "dp2_tp2" / "checkpoint-2"
    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "ndp_state").is_dir()
    for name in ("resumed_tp2_cp2", "resumed_dp4", "resumed_pp2_dp2"):
        assert _worst(runs[str(root / name)], ref_logs, first_step=3) < TOL, name
        params = _params(root / name / "final")
        assert max(float(np.abs(params[k] - ref_params[k]).max()) for k in ref_params) < TOL, name
    # transformers' from_pretrained reads what save_model wrote
    model = transformers.AutoModelForCausalLM.from_pretrained(str(root / "tp2_cp2" / "final"))
    assert model.config.vocab_size == 64


@pytest.mark.slow
@pytest.mark.jobs
def test_evaluation_predict_and_load_best_model_equal_transformers_trainer(plain_runs, launched):
    """Eval losses every 2 steps, ``predict()`` in the dataset's order (hsdp: dp 4 interleaves the rows), and
    ``load_best_model_at_end`` (the worst checkpoint by design: checkpoint-2, not the last weights), against
    transformers' Trainer in one process."""
    plain_root, printed = plain_runs
    ref = _runs(printed, "EVAL")[str(plain_root / "eval")]
    ref_final = _params(plain_root / "eval" / "final")
    root, runs = launched
    assert [step for step, _ in ref["losses"]] == [2, 4] and ref["losses"][0][1] > ref["losses"][1][1]
    for name in EVAL_MESHES:
        got = runs[f"EVAL {root / f'eval_{name}'}"]
        assert [s for s, _ in got["losses"]] == [2, 4], name
        assert max(abs(a - b) for (_, a), (_, b) in zip(got["losses"], ref["losses"], strict=True)) < TOL, name
        final = _params(root / f"eval_{name}" / "final")
        assert max(float(np.abs(final[k] - ref_final[k]).max()) for k in ref_final) < TOL, name  # checkpoint-2's
        last = _params(root / name / "final")  # the same mesh's run without evaluation: the last weights
        assert max(float(np.abs(final[k] - last[k]).max()) for k in last) > 1e-6, name  # loading really happened
        if "argmax" in got:
            assert got["label_ids"] == ref["label_ids"] and got["argmax"] == ref["argmax"], name
            assert max(abs(a - b) for a, b in zip(got["logits_sum"], ref["logits_sum"], strict=True)) < 1e-9, name
    # pp 2 x dp_shard 2: the eval losses (each eval step's 4 rows of 16 valid tokens: the mean of the batches')
    got = runs[f"EVAL {root / 'eval_pp2_dp2'}"]["losses"]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, ref["losses"], strict=True)) < TOL, got


@pytest.mark.slow
@pytest.mark.jobs
def test_padded_rows_average_the_loss_over_real_tokens_as_one_process(plain_runs, launched):
    """Rows padded on the left or the right (attention_mask 0, label -100): the loss is the mean over the real
    tokens of the global batch, across dp x cp ranks, cp shards, accumulation steps and pipeline micro-batches,
    as transformers' Trainer computes it in one process (num_items_in_batch)."""
    plain_root, printed = plain_runs
    ref_logs, ref_params = _runs(printed)[str(plain_root / "padded")], _params(plain_root / "padded" / "final")
    root, runs = launched
    for name in PADDED:
        assert _worst(runs[str(root / name)], ref_logs) < TOL, name
        params = _params(root / name / "final")
        assert max(float(np.abs(params[k] - ref_params[k]).max()) for k in ref_params) < TOL, name


@pytest.mark.slow
@pytest.mark.jobs
def test_an_moe_with_its_router_aux_loss_equals_transformers_trainer(plain_runs, launched):
    """Mixtral with output_router_logits on dp_shard 4: outputs.loss carries the global batch's aux loss, which
    the Trainer's dp x cp loss scaling (meant for per-rank token sums) would multiply by 4; it is taken back out."""
    plain_root, printed = plain_runs
    ref_logs, ref_final = _runs(printed)[str(plain_root / "moe")], _loaded(plain_root / "moe" / "final")
    root, runs = launched
    logs, final = runs[str(root / "moe_dp4")], _loaded(root / "moe_dp4" / "final")
    worst = _worst(logs, ref_logs)
    params = max(float(np.abs(final[k] - ref_final[k]).max()) for k in ref_final)
    print("moe dp_shard4", worst, params)
    assert worst < MOE_TOL and params < MOE_TOL, (worst, params)


def test_trainer_refusals_at_trainer_init_and_the_dp_row_order():
    from types import SimpleNamespace

    from ndparallel.accelerator.trainer_checks import loss_owners
    from ndparallel.accelerator.trainer_checks import refuse_shard_blind_losses as _refuse_loss_overrides
    from ndparallel.accelerator.trainer_eval import check_eval_size as _check_eval_size
    from ndparallel.accelerator.trainer_eval import dataset_order
    from ndparallel.config.parallelism import ParallelismConfig
    from ndparallel.errors import ConfigError

    cp2, tp2, pp2 = ParallelismConfig(cp_size=2), ParallelismConfig(tp_size=2), ParallelismConfig(pp_size=2)
    plain = {"compute_loss_func": None, "compute_metrics": None, "args": SimpleNamespace(label_smoothing_factor=0)}
    custom = SimpleNamespace(**{**plain, "compute_loss_func": lambda *a, **k: 0})
    smooth = SimpleNamespace(**{**plain, "args": SimpleNamespace(label_smoothing_factor=0.1)})
    metrics = SimpleNamespace(**{**plain, "compute_metrics": lambda p: {}})
    with pytest.raises(ConfigError, match="compute_loss_func under cp_size=2 would see this rank's shard"):
        _refuse_loss_overrides(custom, cp2)
    with pytest.raises(ConfigError, match="label_smoothing_factor=0.1 under tp_size=2"):
        _refuse_loss_overrides(smooth, tp2)
    with pytest.raises(ConfigError, match="compute_loss_func under pp_size=2 .* under pp no logits"):
        _refuse_loss_overrides(custom, pp2)
    _refuse_loss_overrides(smooth, ParallelismConfig(dp_shard_size=2))  # one rank's logits are whole: allowed
    with pytest.raises(ConfigError, match="compute_metrics under cp_size > 1"):  # item 7: at Trainer(...)
        _refuse_loss_overrides(metrics, cp2)
    _refuse_loss_overrides(metrics, tp2)  # under tp the logits are gathered for compute_metrics

    class OwnLoss(transformers.Trainer):  # a user's compute_loss: unknown to ndparallel
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    from ndparallel.accelerator.trainer import NDParallelTrainerMixin
    from ndparallel.hf import trainer_class

    assert loss_owners(trainer_class(transformers.Trainer)) == []  # transformers' own loss and the mixin's
    assert loss_owners(trainer_class(OwnLoss)) == [OwnLoss]
    subclass = type("Sub", (trainer_class(transformers.Trainer),), {"compute_loss": OwnLoss.compute_loss})
    assert loss_owners(subclass) == [subclass] and NDParallelTrainerMixin in subclass.__mro__
    own = object.__new__(trainer_class(OwnLoss))
    own.__dict__.update(plain)
    for config in (cp2, tp2, pp2):
        with pytest.raises(ConfigError, match="OwnLoss.compute_loss under .* computes the loss outside ndparallel"):
            _refuse_loss_overrides(own, config)
    _refuse_loss_overrides(own, ParallelismConfig(dp_shard_size=2))  # on data ranks it sees whole rows: allowed
    with pytest.raises(ConfigError, match="has 10 samples, which dp=4 data ranks do not divide: the last 2"):
        _check_eval_size(list(range(10)), 4, "the eval dataset")
    _check_eval_size(list(range(12)), 4, "the eval dataset")
    with pytest.raises(ConfigError, match="dataloader_drop_last drops each rank's last 1 samples"):
        _check_eval_size(list(range(12)), 4, "the eval dataset", batch=2, drop_last=True)
    _check_eval_size(list(range(16)), 4, "the eval dataset", batch=2, drop_last=True)
    # 10 samples on dp 2 in batches of 2: rank 0 holds 0 2 4 6 8, rank 1 1 3 5 7 9; each step gathers both
    assert dataset_order(10, 2, 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7, 8, 9]
    from ndparallel.accelerator.trainer_eval import in_dataset_order as _in_dataset_order

    inverse = np.argsort(dataset_order(4, 2, 1))
    rows = np.arange(4)[dataset_order(4, 2, 1)]  # as gathered
    assert _in_dataset_order((rows, rows * 10), inverse)[1].tolist() == [0, 10, 20, 30]
    with pytest.raises(ConfigError, match="returned an output of 8 rows for 4 samples"):
        _in_dataset_order((rows, np.zeros((8, 3))), inverse)  # router_logits: a row per token


_ACCELERATE_SAVE_STATE = """
import os, socket, sys
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2)
model = LlamaForCausalLM(config)
plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
# Accelerate enables FSDP only on accelerator devices: on this CPU its state is set to FSDP by hand
accelerator.state.distributed_type, accelerator.state.fsdp_plugin = DistributedType.FSDP, plugin
optimizer = torch.optim.AdamW(model.parameters())
model, optimizer = accelerator.prepare(model, optimizer)
x = torch.randint(0, 64, (2, 8))
accelerator.backward(model(input_ids=x, labels=x).loss)
optimizer.step()
accelerator.state.distributed_type = DistributedType.FSDP
accelerator.save_state(sys.argv[1])
"""


@pytest.mark.slow
def test_a_checkpoint_of_accelerates_save_state_is_refused_by_name(tmp_path):
    """Accelerate's FSDP2 ``save_state`` folder (``pytorch_model_fsdp_0/``, ``optimizer_0/``, a pickled
    ``random_states_0.pkl``), written by accelerate itself: ndparallel's load names it and the way out, and
    never unpickles its random states."""
    from ndparallel import checkpoint as ckpt
    from ndparallel.checkpoint import CheckpointError

    folder = tmp_path / "accelerate-state"
    done = subprocess.run(
        [sys.executable, "-c", _ACCELERATE_SAVE_STATE, str(folder)], capture_output=True, text=True, timeout=300,
        cwd=REPO, env=clean_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (folder / "pytorch_model_fsdp_0" / ".metadata").is_file() and (folder / "optimizer_0").is_dir()
    with pytest.raises(
        CheckpointError, match=r"written by 🤗 Accelerate's save_state \(optimizer_0, pytorch_model_fsdp_0"
    ):
        ckpt.validate(folder)
