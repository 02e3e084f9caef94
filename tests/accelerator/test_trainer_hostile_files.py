"""Hostile Trainer input, one process: ``TrainingArguments(deepspeed=...)`` refused by ndparallel before transformers
looks for the deepspeed package, and a checkpoint whose ``model.safetensors`` was truncated: named, and its weights
read from ``ndp_state/`` (the resumed run equals one resumed from the intact checkpoint), or refused by name when
there is no ``ndp_state/``."""

from __future__ import annotations

import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the trainer extra: pip install 'ndparallel[trainer]'")

from ndparallel.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.slow  # three tiny trainings and a resume: ~15 s on 2 loaded cores


def test_deepspeed_is_refused_before_transformers_looks_for_it(tmp_path):
    from ndparallel.hf import TrainingArguments

    with pytest.raises(ConfigError, match=r"TrainingArguments\(deepspeed=.*\): DeepSpeed is not ndparallel's engine"):
        TrainingArguments(output_dir=str(tmp_path), deepspeed={"zero_optimization": {"stage": 2}}, use_cpu=True)


@pytest.fixture
def trainer_job():
    """tests/accelerator/trainer_job.py, whose import sets torch's default dtype to float64 (for its own process):
    restored, so that the tests after this one in the same process build in their own dtype."""
    default = torch.get_default_dtype()
    from tests.accelerator import trainer_job

    torch.set_default_dtype(default)
    yield trainer_job
    torch.set_default_dtype(default)


def _train(trainer_job, model_dir, out, steps, save_steps=None, resume=None):
    import ndparallel as ndp
    from ndparallel.hf import Trainer

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    model.loss_function = trainer_job.float64_loss
    args = trainer_job.arguments(str(out), trainer_job.GLOBAL_BATCH, steps, save_steps)
    trainer = Trainer(
        model=model, args=args, train_dataset=trainer_job.dataset(), parallelism_config=ndp.ParallelismConfig()
    )
    trainer.train(resume_from_checkpoint=resume)
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_a_truncated_checkpoint_weight_file_is_named_and_read_from_ndp_state(tmp_path, trainer_job):
    from ndparallel.distributed.process import destroy_distributed

    model_dir = tmp_path / "llama"
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).double().save_pretrained(model_dir)
    try:
        _train(trainer_job, model_dir, tmp_path / "run", 2, save_steps=2)
        intact = tmp_path / "run" / "checkpoint-2"
        truncated, bare = tmp_path / "truncated" / "checkpoint-2", tmp_path / "bare" / "checkpoint-2"
        for copy in (truncated, bare):
            shutil.copytree(intact, copy)
            weights = copy / "model.safetensors"
            weights.write_bytes(weights.read_bytes()[:100])
        shutil.rmtree(bare / "ndp_state")
        expected = _train(trainer_job, model_dir, tmp_path / "a", 4, resume=str(intact))
        with pytest.warns(
            UserWarning, match=r"model.safetensors' is not a readable safetensors file .* from ndp_state"
        ):
            resumed = _train(trainer_job, model_dir, tmp_path / "b", 4, resume=str(truncated))
        assert all(torch.equal(resumed[k], expected[k]) for k in expected)
        with pytest.raises(ConfigError, match=r"model.safetensors' is not .*; and the checkpoint has no ndp_state/"):
            _train(trainer_job, model_dir, tmp_path / "c", 4, resume=str(bare))
    finally:
        destroy_distributed()
