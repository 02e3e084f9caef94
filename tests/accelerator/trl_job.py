"""TRL's ``SFTTrainer`` as its users write it, on ndparallel's engine (``ndparallel.hf.trainer_class``) or, with
``--plain``, TRL's own run in one process (the reference). Run under ``ndparallel launch`` by
tests/accelerator/test_trl.py.

``python trl_job.py RUNS_JSON [--plain]``: each run ``{"out", "sizes", "data", "steps", "accumulation",
"sft": {config fields}, "subclass", "bf16", "dtype", "ndp_mixed_precision", "trainer"}`` trains a tiny Llama (float64
unless ``dtype`` says otherwise, built from seed 0 in every process) for ``steps`` steps on pre-tokenized
samples of varied lengths (global batch 8, sequential order), then ``save_model(out/final)``; rank 0 prints
``RUN <out> <json>``: per logged step the loss, grad norm, TRL's mean token accuracy, entropy and token count
(``{"error": ...}`` instead for a run with ``"expect_error"``).

``data``: ``"text"`` (every token a label, padded rows), ``"full"`` (rows of 32 tokens: no padding),
``"completion"`` (``completion_mask``: prompt tokens ignored, ``completion_only_loss``),
``"assistant"`` (``assistant_masks``: only assistant turns are labels), ``"prepacked"`` (the text rows packed
by ``trl.data_utils.pack_dataset`` into rows of 32 before the trainer sees them). ``"trainer": "dpo"``: TRL's
``DPOTrainer`` instead, on prompt / chosen / rejected text (its reference model: a copy of the initial one).
"""

from __future__ import annotations

import json
import os
import sys

import torch

VOCAB, SAMPLES, GLOBAL_BATCH = 64, 32, 8
PAD, EOS = 0, 1


def tokenizer():
    """A word-level tokenizer built in memory (``w3`` .. ``w63``): nothing downloads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, "<unk>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def samples(kind: str) -> list[dict]:
    """Pre-tokenized rows of 6 to 24 tokens, with the mask column ``kind`` asks for."""
    generator = torch.Generator().manual_seed(11)
    rows = []
    for _ in range(SAMPLES):
        length = int(torch.randint(6, 25, (1,), generator=generator)) if kind != "full" else 32
        ids = torch.randint(3, VOCAB, (length,), generator=generator).tolist()
        row = {"input_ids": ids}
        if kind == "completion":
            prompt = int(torch.randint(2, length - 2, (1,), generator=generator))
            row["completion_mask"] = [0] * prompt + [1] * (length - prompt)
        elif kind == "assistant":  # two turns: user, assistant, user, assistant
            cut = sorted(torch.randperm(length - 2, generator=generator)[:3].add(1).tolist())
            bounds = [0, *cut, length]
            row["assistant_masks"] = [k % 2 for k in range(4) for _ in range(bounds[k + 1] - bounds[k])]
        rows.append(row)
    return rows


def model(dtype: str = "float64"):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=PAD,
        eos_token_id=EOS, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(getattr(torch, dtype))


def preferences() -> list[dict]:
    """DPO's data: a prompt and a chosen and a rejected completion, as text of the in-memory vocabulary."""
    generator = torch.Generator().manual_seed(12)

    def words(low: int, high: int) -> str:
        count = int(torch.randint(low, high, (1,), generator=generator))
        return " ".join(f"w{int(i)}" for i in torch.randint(3, VOCAB, (count,), generator=generator))

    return [{"prompt": words(3, 9), "chosen": words(2, 8), "rejected": words(2, 8)} for _ in range(SAMPLES)]


def config(spec: dict, per_device: int):
    from trl import DPOConfig, SFTConfig

    fields = dict(
        output_dir=spec["out"], per_device_train_batch_size=per_device, max_steps=spec.get("steps", 3),
        gradient_accumulation_steps=spec.get("accumulation", 1), optim="sgd", learning_rate=0.5,
        lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=0.5, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, train_sampling_strategy="sequential", dataloader_drop_last=True, seed=0,
        max_length=32, shuffle_dataset=False, bf16=bool(spec.get("bf16")),
    )  # fmt: skip
    fields.update(spec.get("sft", {}))
    if spec.get("trainer") == "dpo":
        fields.pop("shuffle_dataset")
        return DPOConfig(**fields, beta=0.1)
    return SFTConfig(**fields)


def run(spec: dict, plain: bool) -> dict:
    from datasets import Dataset
    from trl import DPOTrainer, SFTTrainer

    dpo = spec.get("trainer") == "dpo"
    kind = spec.get("data", "text")
    data = Dataset.from_list(preferences() if dpo else samples("text" if kind == "prepacked" else kind))
    if kind == "prepacked":  # packed by the user with TRL's own function: the alternative to packing=True under cp
        from trl.data_utils import pack_dataset

        data = pack_dataset(data, 32, "bfd")
    per_device_steps = spec.get("accumulation", 1)
    base = DPOTrainer if dpo else SFTTrainer
    if spec.get("subclass"):  # a user's compute_loss override (refused under tp/cp)

        class Custom(SFTTrainer):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        base = Custom
    kwargs = dict(model=model(spec.get("dtype", "float64")), train_dataset=data, processing_class=tokenizer())
    if dpo:  # the reference model: the initial weights again (TRL would load it from the model's hub path)
        kwargs["ref_model"] = model(spec.get("dtype", "float64"))
    if plain:
        args = config(spec, GLOBAL_BATCH // per_device_steps)
        trainer = base(args=args, **kwargs)
    else:
        import ndparallel as ndp
        import ndparallel.hf

        sizes = spec["sizes"]
        world = int(os.environ["WORLD_SIZE"])
        dp = world // (sizes.get("tp_size", 1) * sizes.get("cp_size", 1) * sizes.get("pp_size", 1))
        args = config(spec, GLOBAL_BATCH // per_device_steps // dp)
        parallel = ndp.ParallelismConfig(**sizes, mixed_precision=spec.get("ndp_mixed_precision", "no"))
        # TRL's SFTTrainer as the docs write it; a subclass or DPOTrainer through trainer_class
        cls = ndparallel.hf.SFTTrainer if base is SFTTrainer else ndparallel.hf.trainer_class(base)
        trainer = cls(args=args, parallelism_config=parallel, **kwargs)
    trainer.train()
    trainer.save_model(os.path.join(spec["out"], "final"))
    logs = [
        [h["step"], h["loss"], h["grad_norm"], h.get("mean_token_accuracy"), h.get("entropy"), h.get("num_tokens")]
        for h in trainer.state.log_history
        if "loss" in h
    ]
    return {"logs": logs}


def main() -> None:
    plain = "--plain" in sys.argv
    (runs,) = [a for a in sys.argv[1:] if a != "--plain"]
    for spec in json.loads(runs):
        try:
            result = run(spec, plain)
        except Exception as err:  # noqa: BLE001 - reported per run, the next runs go on
            if not spec.get("expect_error"):
                raise
            result = {"error": f"{type(err).__name__}: {err}".splitlines()[0]}
        if int(os.environ.get("RANK", "0")) == 0:
            print("RUN", spec["out"], json.dumps(result), flush=True)


if __name__ == "__main__":
    from ndparallel.launch.exit_collections import skip_collections_at_exit

    skip_collections_at_exit()  # a test's own process, as the ndparallel command's
    main()
