"""Hugging Face ``transformers`` models on ndparallel meshes (optional extra: ``pip install 'ndparallel[hf]'``).

The public names of the Hugging Face family, whose code lives in ``ndparallel/models/hf/`` (docs/huggingface.md)::

    family.py      what ndparallel.parallelize asks of an HF model (a ndparallel.parallel.family.ModelFamily)
    tp_plan.py     the TP + SP table and FSDP units, translated from the config's base_model_tp_plan
    styles.py      GatherSequence, TiedColwiseParallel, ReplicatedCompute, PerShardNorm: the styles beyond torch's
    tiny.py        tiny_config: a tiny random config of any causal-LM model type (tests, the zoo)
    attention.py   the attention seam under tp/cp (registry functions) and its pre-flight refusals
    inputs.py      forward inputs under tp/cp: collective refusals, global position_ids
    loss.py        outputs.loss under tp/cp, exactly as in one process
    pretrained.py  load_pretrained / save_pretrained: sharded safetensors straight into / out of a mesh;
                   load_pretrained_pipeline: the same for pp_size > 1 (a rank reads only its stages)
    stage.py       HFCausalLMStage: a pipeline stage under the unsplit names
    init.py        seeded_init: HF's init rule, seeded per module name (what a meta-built stage gets)

``ndparallel.parallelize(hf_model, cfg, mesh)`` recognises a PreTrainedModel by itself; load and save::

    from ndparallel.hf import load_pretrained, save_pretrained
    model = load_pretrained("path/to/folder", cfg, mesh)   # meta init, each rank reads its shards
    save_pretrained(model, "path/to/out")                 # full tensors gathered on rank 0

The transformers ``Trainer`` on ndparallel's engine (``ndparallel/accelerator/trainer.py``; needs accelerate, as
the Trainer does)::

    from ndparallel.hf import Trainer, TrainingArguments
    Trainer(model, TrainingArguments(...), train_dataset=data, parallelism_config=cfg).train()
    SFTTrainer = ndparallel.hf.trainer_class(trl.SFTTrainer)   # any Trainer subclass
    from ndparallel.hf import SFTTrainer                       # the same, for TRL's (docs/fine-tuning.md)
"""

from ndparallel.models.hf.attention import apply_hf_attention
from ndparallel.models.hf.detect import is_hf_model
from ndparallel.models.hf.init import seeded_init
from ndparallel.models.hf.pretrained import load_pretrained, load_pretrained_pipeline, local_region, save_pretrained
from ndparallel.models.hf.styles import GatherSequence, PerShardNorm, ReplicatedCompute, TiedColwiseParallel
from ndparallel.models.hf.tiny import tiny_config
from ndparallel.models.hf.tp_plan import hf_fsdp_groups, hf_tp_plan
from ndparallel.models.hf.tp_translate import REFUSED, STYLES

__all__ = [
    "REFUSED",
    "STYLES",
    "GatherSequence",
    "PerShardNorm",
    "ReplicatedCompute",
    "TiedColwiseParallel",
    "apply_hf_attention",
    "hf_fsdp_groups",
    "hf_tp_plan",
    "is_hf_model",
    "load_pretrained",
    "load_pretrained_pipeline",
    "local_region",
    "save_pretrained",
    "seeded_init",
    "tiny_config",
    "trainer_class",
    "SFTTrainer",
    "Trainer",
    "TrainingArguments",
]

_TRAINERS: dict[str, type] = {}


def trainer_class(base: type, name: str | None = None) -> type:
    """``base`` (``transformers.Trainer`` or a subclass such as ``trl.SFTTrainer``) with ndparallel's engine."""
    from ndparallel.accelerator.trainer import trainer_class as make

    return make(base, name)


def __getattr__(name: str):
    """``Trainer`` / ``TrainingArguments`` / ``SFTTrainer``: imported on first use (transformers' Trainer imports
    accelerate; ``SFTTrainer`` is TRL's, the ``trl`` extra)."""
    if name == "TrainingArguments":  # transformers' own, refusing deepspeed= before transformers looks for it
        from ndparallel.accelerator.training_args import training_arguments_class

        return training_arguments_class()
    if name in ("Trainer", "SFTTrainer"):
        if name not in _TRAINERS:
            if name == "Trainer":
                from transformers import Trainer as base
            else:
                from trl import SFTTrainer as base
            _TRAINERS[name] = trainer_class(base)
        return _TRAINERS[name]
    raise AttributeError(f"module 'ndparallel.hf' has no attribute {name!r}")
