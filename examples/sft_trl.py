"""Supervised fine-tuning with TRL's ``SFTTrainer`` on ndparallel's engine (docs/fine-tuning.md).

The script is TRL's usual one, with two changes: the trainer class goes through ``ndparallel.hf.trainer_class``
and the Trainer gets a ``parallelism_config``. Run it on 4 simulated CPU ranks (or GPUs, with torchrun)::

    ndparallel launch --cpu-ranks 4 -- examples/sft_trl.py --tp 2            # dp_shard 2 x tp 2
    ndparallel launch --cpu-ranks 4 -- examples/sft_trl.py --cp 2 --padding-free
    ndparallel launch --cpu-ranks 4 -- examples/sft_trl.py --pp 2
    python examples/sft_trl.py                                                 # one process

Without ``--model`` it builds a tiny Llama and a word-level tokenizer in memory (nothing downloads) and learns to
reverse short word sequences: prompt-completion pairs, the loss on the completions only. With ``--model PATH``
it loads a Hugging Face causal LM and its tokenizer from a local folder.
"""

from __future__ import annotations

import argparse
import random

import torch


def tiny_model_and_tokenizer(vocab: int = 64):
    """A tiny random Llama and a word-level tokenizer over ``w3`` .. ``w{vocab-1}``, built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    core = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)  # every rank builds the same weights
    return LlamaForCausalLM(config), tokenizer


def reversal_dataset(samples: int, vocab: int = 64, seed: int = 0):
    """Prompt-completion pairs: a few words, then the same words reversed."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for _ in range(samples):
        words = [f"w{rng.randrange(3, vocab)}" for _ in range(rng.randint(3, 10))]
        rows.append({"prompt": " ".join(words) + " ", "completion": " ".join(reversed(words))})
    return Dataset.from_list(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local Hugging Face causal-LM folder (default: a tiny model in memory)")
    parser.add_argument("--dp-shard", type=int, default=-1, help="FSDP ranks (-1: what the others leave)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16, help="global batch (split over the data ranks)")
    parser.add_argument("--padding-free", action="store_true", help="one flattened row per batch, documents apart")
    parser.add_argument("--bf16", action="store_true", help="one process's bf16: autocast, fp32 weights")
    parser.add_argument("--output-dir", default="out/sft_trl")
    args = parser.parse_args()

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    import ndparallel as ndp
    from ndparallel.hf import trainer_class

    parallel = ndp.ParallelismConfig(dp_shard_size=args.dp_shard, tp_size=args.tp, cp_size=args.cp, pp_size=args.pp)
    if args.model:
        model, tokenizer = AutoModelForCausalLM.from_pretrained(args.model), AutoTokenizer.from_pretrained(args.model)
    else:
        model, tokenizer = tiny_model_and_tokenizer()
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    data_ranks = world // (args.tp * args.cp * args.pp)
    config = SFTConfig(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch // data_ranks,
        learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=2, max_grad_norm=1.0, logging_steps=5,
        save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), bf16=args.bf16, seed=0,
        completion_only_loss=True, padding_free=args.padding_free,
        max_length=None if args.padding_free else 64,
        # rows a multiple of 2 x cp and of tp; under pp of one length (torch's schedule fixes shapes)
        pad_to_multiple_of=64 if args.pp > 1 else 2 * args.cp * args.tp,
        dataloader_drop_last=True,
    )  # fmt: skip
    trainer = trainer_class(SFTTrainer)(
        model=model, args=config, train_dataset=reversal_dataset(args.batch * args.steps),
        processing_class=tokenizer, parallelism_config=parallel,
    )  # fmt: skip
    trainer.train()
    trainer.save_model(f"{args.output_dir}/final")
    losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"losses every 5 steps: {losses}; weights in {args.output_dir}/final")


if __name__ == "__main__":
    main()
