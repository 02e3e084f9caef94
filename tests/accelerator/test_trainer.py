"""``ndparallel.hf.Trainer``: the transformers Trainer on ndparallel's engine equals transformers' own Trainer in
one process (float64), on five meshes, resumes from its checkpoint on other meshes, and saves transformers' layout.

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
MESHES = {
    "dp_shard4": {"dp_shard_size": 4},
    "hsdp": {"dp_replicate_size": 2, "dp_shard_size": 2},
    "dp2_tp2": {"dp_shard_size": 2, "tp_size": 2},
    "dp2_cp2": {"dp_shard_size": 2, "cp_size": 2},
    "tp2_cp2": {"tp_size": 2, "cp_size": 2},
}


def _runs(printed: str) -> dict[str, list]:
    return {
        line.split()[1]: json.loads(line.split(" ", 2)[2]) for line in printed.splitlines() if line.startswith("RUN ")
    }


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
def reference(model_dir, tmp_path_factory) -> tuple[list, dict]:
    out = tmp_path_factory.mktemp("plain")
    runs = json.dumps([{"out": str(out), "steps": STEPS}])
    done = subprocess.run(
        [sys.executable, JOB, str(model_dir), runs, "--plain"], capture_output=True, text=True, timeout=300,
        cwd=REPO, env=clean_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return _runs(done.stdout)[str(out)], _params(out / "final")


@pytest.fixture(scope="module")
def launched(model_dir, tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("ndp")
    runs = [{"out": str(root / name), "sizes": sizes, "steps": STEPS} for name, sizes in MESHES.items()]
    runs[2]["save_steps"] = 2  # dp2_tp2 saves checkpoint-2: resumed below on two other meshes
    checkpoint = str(root / "dp2_tp2" / "checkpoint-2")
    runs.append(
        {"out": str(root / "resumed_tp2_cp2"), "sizes": MESHES["tp2_cp2"], "steps": STEPS, "resume": checkpoint}
    )
    runs.append({"out": str(root / "resumed_dp4"), "sizes": MESHES["dp_shard4"], "steps": STEPS, "resume": checkpoint})
    done = run_ndparallel("launch", "--cpu-ranks", "4", "--", JOB, str(model_dir), json.dumps(runs), timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return root, _runs(done.stdout)


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
    tp 2 x cp 2 and on dp_shard 4: steps 3-4 and the final weights are the uninterrupted one process's."""
    ref_logs, ref_params = reference
    root, runs = launched
    checkpoint = root / "dp2_tp2" / "checkpoint-2"
    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "ndp_state").is_dir()
    for name in ("resumed_tp2_cp2", "resumed_dp4"):
        assert _worst(runs[str(root / name)], ref_logs, first_step=3) < TOL, name
        params = _params(root / name / "final")
        assert max(float(np.abs(params[k] - ref_params[k]).max()) for k in ref_params) < TOL, name
    # transformers' from_pretrained reads what save_model wrote
    model = transformers.AutoModelForCausalLM.from_pretrained(str(root / "tp2_cp2" / "final"))
    assert model.config.vocab_size == 64


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
