"""The transformers Trainer as its users write it, with ndparallel's engine: ``ndparallel.hf.Trainer`` and a
``parallelism_config``. Run under ``ndparallel launch`` (real torchrun) by tests/accelerator/test_trainer.py, or
in one process with ``--plain`` for transformers' own Trainer (the reference, Accelerate's engine).

``python trainer_job.py MODEL_DIR RUNS_JSON``: each run ``{"out", "sizes", "steps", "save_steps", "resume", "eval",
"model", "accumulation", "data"}`` (``model``: another model folder than MODEL_DIR, e.g. a tiny MoE; ``accumulation``:
gradient accumulation steps, the same global batch in as many micro-batches; ``"data": "padded"``: padded rows)
trains the float64 tiny Llama in ``MODEL_DIR`` on the same 64 sequences (global batch 8, sequential order),
then ``save_model(out/final)``; rank 0 prints ``RUN <out> <json log history>`` (loss, grad norm per step).
``eval``: 16 other sequences evaluated every 2 steps (``"eval": "loss"``: only that), a checkpoint every 2
steps, the *worst* one loaded at the end (``load_best_model_at_end`` with ``greater_is_better``: the last
weights are not the best, so loading shows); then ``EVAL <out> <json>``: every eval loss, and unless
``"predict": false`` the predictions' argmax and label ids of ``predict()`` on the eval sequences.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F

torch.set_default_dtype(torch.float64)  # the Trainer's loss accumulator follows it: float64 logs

GLOBAL_BATCH, VOCAB, SEQ, SAMPLES = 8, 64, 16, 64


def float64_loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **_):
    """transformers' causal-LM loss (sum / num_items_in_batch, labels shifted) without its float32 upcast: a float64
    model then has no float32 step in its loss, so layouts are compared to 1e-10 (under tp / cp ndparallel
    installs its own loss, float64 for float64 logits)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(logits.device)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets, ignore_index=ignore_index, reduction="sum")
    count = (targets != ignore_index).sum() if num_items_in_batch is None else num_items_in_batch
    return total / count


def dataset(padded: bool = False) -> list[dict[str, torch.Tensor]]:
    """``SAMPLES`` rows of ``SEQ`` tokens; ``padded``: each row holds 5 to 16 real tokens, padded on the right
    (even rows) or the left (odd rows): ``attention_mask`` 0 and label -100 there, so the valid tokens differ
    between rows, ranks, micro-batches and cp shards."""
    generator = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, VOCAB, (SEQ,), generator=generator) for _ in range(SAMPLES)]
    if not padded:
        return [{"input_ids": row, "labels": row.clone()} for row in rows]
    samples = []
    for i, row in enumerate(rows):
        real = int(torch.randint(5, SEQ + 1, (1,), generator=generator))
        mask = torch.zeros(SEQ, dtype=torch.long)
        if i % 2:
            mask[SEQ - real :] = 1  # padded on the left
        else:
            mask[:real] = 1
        row = row.masked_fill(mask == 0, 0)
        samples.append({"input_ids": row, "attention_mask": mask, "labels": row.masked_fill(mask == 0, -100)})
    return samples


def eval_dataset() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(6)
    rows = [torch.randint(0, VOCAB, (SEQ,), generator=generator) for _ in range(EVAL_SAMPLES)]
    return [{"input_ids": row, "labels": row.clone()} for row in rows]


EVAL_SAMPLES, EVAL_BATCH = 16, 2  # per device: 4 ranks x 2 = 8 a step, 2 steps; one process: 8 steps of 2


def arguments(
    out: str, per_device: int, steps: int, save_steps: int | None, evaluate: bool | str = False, accumulation: int = 1
):
    from transformers import TrainingArguments

    every = {}
    if evaluate == "loss":  # the eval loss every 2 steps, nothing else (pp: no best-checkpoint loading)
        every = dict(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=EVAL_BATCH)
    elif evaluate:
        save_steps = 2
        every = dict(
            eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=EVAL_BATCH, load_best_model_at_end=True,
            metric_for_best_model="eval_loss", greater_is_better=True,
        )  # fmt: skip
    return TrainingArguments(
        output_dir=out, per_device_train_batch_size=per_device, max_steps=steps, learning_rate=1e-2,
        weight_decay=0.1, lr_scheduler_type="linear", warmup_steps=1, max_grad_norm=0.5, logging_steps=1,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, report_to=[], use_cpu=True,
        train_sampling_strategy="sequential", dataloader_drop_last=True, seed=0,
        gradient_accumulation_steps=accumulation, **every,
    )  # fmt: skip


def run(model_dir: str, spec: dict, plain: bool) -> tuple[list, dict | None]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec.get("model", model_dir), dtype=torch.float64)
    model.loss_function = float64_loss
    model.config._experts_implementation = "eager"  # an MoE's: grouped_mm has no float64 kernel
    evaluate = spec.get("eval") if spec.get("eval") == "loss" else bool(spec.get("eval"))
    train = dataset(padded=spec.get("data") == "padded")
    data = {"train_dataset": train, "eval_dataset": eval_dataset() if evaluate else None}
    if plain:
        from transformers import Trainer

        args = arguments(spec["out"], GLOBAL_BATCH, spec["steps"], None, evaluate)
        trainer = Trainer(model=model, args=args, **data)
    else:
        import ndparallel as ndp
        from ndparallel.hf import Trainer

        sizes, accumulation = spec["sizes"], spec.get("accumulation", 1)
        inner = sizes.get("tp_size", 1) * sizes.get("cp_size", 1) * sizes.get("pp_size", 1)
        per_device = GLOBAL_BATCH // (int(os.environ["WORLD_SIZE"]) // inner) // accumulation
        args = arguments(spec["out"], per_device, spec["steps"], spec.get("save_steps"), evaluate, accumulation)
        trainer = Trainer(model=model, args=args, parallelism_config=ndp.ParallelismConfig(**sizes), **data)
    trainer.train(resume_from_checkpoint=spec.get("resume"))
    trainer.save_model(os.path.join(spec["out"], "final"))
    logs = [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    if not evaluate:
        return logs, None
    evals = {"losses": [(h["step"], h["eval_loss"]) for h in trainer.state.log_history if "eval_loss" in h]}
    if spec.get("predict", True):
        out = trainer.predict(eval_dataset())
        evals["argmax"] = out.predictions.argmax(-1).tolist()
        evals["logits_sum"] = out.predictions.sum(axis=(1, 2)).tolist()
        evals["label_ids"] = out.label_ids.tolist()
    return logs, evals


def main() -> None:
    plain = "--plain" in sys.argv
    model_dir, runs = [a for a in sys.argv[1:] if a != "--plain"]
    for spec in json.loads(runs):
        logs, evals = run(model_dir, spec, plain)
        if int(os.environ.get("RANK", "0")) == 0:
            print("RUN", spec["out"], json.dumps(logs), flush=True)
            if evals is not None:
                print("EVAL", spec["out"], json.dumps(evals), flush=True)


if __name__ == "__main__":
    from ndparallel.launch.exit_collections import skip_collections_at_exit

    skip_collections_at_exit()  # a test's own process, as the ndparallel command's
    main()
