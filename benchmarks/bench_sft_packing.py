"""TRL's SFTTrainer on ndparallel: real tokens per second with padded rows against padding-free (packed) batches.

    ndparallel launch --cpu-ranks 2 -- benchmarks/bench_sft_packing.py --tp 2
    ndparallel launch --cpu-ranks 2 -- benchmarks/bench_sft_packing.py --dp-shard 2

The same documents (random lengths, uniform between ``--min-len`` and ``--max-len``), the same model (a Llama of
``--dim`` built in memory, float32) and the same global batch, trained ``--steps`` steps twice per round, padded
(each row padded to the longest of its batch) then padding-free (each batch one row of its documents end to end,
the documents masked apart); ``--rounds`` rounds alternate them, so a drifting machine load slows both alike.
Real tokens per second = the batches' non-padding tokens over the time of steps 2.. (the first step builds
caches). Rank 0 prints one markdown row per mode with the padding fraction and the expected ratio
``1 / (1 - padding fraction)``. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch


def tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    core = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def model(dim: int, layers: int, vocab: int, max_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
        num_attention_heads=max(1, dim // 64), num_key_value_heads=max(1, dim // 64), max_position_embeddings=max_len,
        pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def documents(count: int, low: int, high: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(low, high + 1, (count,), generator=generator).tolist()
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


class StepTimer:
    """Wall time of each optimizer step (a transformers TrainerCallback, built lazily)."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Timer(TrainerCallback):
            def __init__(self):
                self.times: list[float] = []
                self._start = 0.0

            def on_step_begin(self, args, state, control, **kwargs):
                self._start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                self.times.append(time.perf_counter() - self._start)

        return _Timer()


def train(args, docs: list[list[int]], padding_free: bool) -> tuple[float, float]:
    """(real tokens per second over steps 2.., padding fraction of the padded layout)."""
    from datasets import Dataset
    from trl import SFTConfig

    import ndparallel as ndp
    from ndparallel.hf import SFTTrainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = world // (args.tp * args.cp)
    per_device = args.batch // dp
    config = SFTConfig(
        output_dir="/tmp/bench_sft_packing", max_steps=args.steps, per_device_train_batch_size=per_device,
        learning_rate=1e-3, logging_steps=1000, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        train_sampling_strategy="sequential", dataloader_drop_last=True, shuffle_dataset=False,
        padding_free=padding_free, max_length=None, pad_to_multiple_of=2 * args.cp * args.tp,
        disable_tqdm=True,
    )  # fmt: skip
    timer = StepTimer()
    trainer = SFTTrainer(
        model=model(args.dim, args.layers, args.vocab, args.max_len), args=config,
        train_dataset=Dataset.from_list([{"input_ids": d} for d in docs]), processing_class=tokenizer(args.vocab),
        parallelism_config=ndp.ParallelismConfig(dp_shard_size=args.dp_shard, tp_size=args.tp, cp_size=args.cp),
        callbacks=[timer],
    )  # fmt: skip
    trainer.train()
    real = padded = 0
    for step in range(1, args.steps):  # the batches of steps 2.. (sequential order, global batch args.batch)
        batch = docs[step * args.batch : (step + 1) * args.batch]
        real += sum(len(d) for d in batch)
        for start in range(0, args.batch, per_device):  # each data rank pads its rows to its longest
            rows = batch[start : start + per_device]
            padded += len(rows) * max(len(d) for d in rows)
    return real / sum(timer.times[1:]), 1 - real / padded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp-shard", type=int, default=-1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="global batch (documents per step)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    args = parser.parse_args()
    docs = documents(args.batch * args.steps, args.min_len, args.max_len, args.vocab)
    rates: dict[bool, list[float]] = {False: [], True: []}
    fraction = 0.0
    for _ in range(args.rounds):
        for padding_free in (False, True):
            rate, fraction = train(args, docs, padding_free)
            rates[padding_free].append(rate)
    if int(os.environ.get("RANK", "0")) == 0:
        load = os.getloadavg()[0]
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load average {load:.1f}, torch "
              f"{torch.__version__}; dp_shard {args.dp_shard} tp {args.tp} cp {args.cp}, dim {args.dim}")  # fmt: skip
        padded, packed = statistics.median(rates[False]), statistics.median(rates[True])
        print("| padded tokens/s | padding-free tokens/s | ratio | padding fraction | 1 / (1 - fraction) |")
        print("|---:|---:|---:|---:|---:|")
        print(f"| {padded:.0f} | {packed:.0f} | {packed / padded:.2f} | {fraction:.2f} | {1 / (1 - fraction):.2f} |")


if __name__ == "__main__":
    main()
