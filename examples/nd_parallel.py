"""ND-parallel training of a Hugging Face Llama with ndparallel's Accelerator.

This is 🤗 Accelerate's examples/torch_native_parallelism/nd_parallel.py ported to ndparallel: the same
structure (arguments, a forward/backward step under context parallel, the training loop, checkpoints, a
tracker, save_pretrained), on a tiny random Llama and synthetic tokens so that it runs anywhere, e.g. on 4
simulated CPU ranks::

    ndparallel launch --cpu-ranks 4 -- examples/nd_parallel.py --dp-shard-size 2 --tp-size 2
    ndparallel launch --cpu-ranks 4 -- examples/nd_parallel.py --dp-shard-size 2 --cp-size 2

docs/accelerate-migration.md shows the diff against Accelerate's file and the reason for each difference.
"""

import argparse
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, LlamaConfig

from ndparallel import Accelerator, ParallelismConfig
from ndparallel.accelerator import FullyShardedDataParallelPlugin, set_seed

MODEL_NAME = "tiny-random-llama"


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp-replicate-size", type=int, default=1)
    parser.add_argument("--dp-shard-size", type=int, default=1)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--cp-size", type=int, default=1)
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--num-steps", type=int, default=50)
    parser.add_argument("--save-dir", type=str, default="./outputs")
    parser.add_argument("--checkpoint-frequency", type=int, default=20)
    parser.add_argument("--model-name", type=str, default=MODEL_NAME)
    parser.add_argument("--mixed-precision", type=str, default="bf16")
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    return parser.parse_args(argv)


def tiny_llama_config() -> LlamaConfig:
    """A 2-layer Llama with grouped-query attention; every size divides tp 2 and 4."""
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=256,
        max_position_embeddings=1024,
        initializer_range=0.1,
        tie_word_embeddings=False,
        use_cache=False,
    )


def synthetic_dataset(num_samples: int, seq_len: int, vocab_size: int, seed: int = 0) -> list[dict]:
    """Random token windows of ``seq_len + 1``: inputs and next-token labels, as Accelerate's packed dataset."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (num_samples, seq_len + 1), generator=generator)
    return [{"input_ids": row[:-1], "shift_labels": row[1:]} for row in tokens]


def collate(samples: list[dict]) -> dict:
    input_ids = torch.stack([s["input_ids"] for s in samples])
    shift_labels = torch.stack([s["shift_labels"] for s in samples])
    return {"input_ids": input_ids, "shift_labels": shift_labels, "labels": shift_labels.clone()}


class Throughput:
    """Tokens per second per device, after ``warmup_steps``."""

    def __init__(self, warmup_steps: int = 5):
        self.warmup_steps, self.steps, self.tokens, self.start = warmup_steps, 0, 0.0, None

    def step(self, tokens: float) -> str:
        self.steps += 1
        if self.steps == self.warmup_steps:
            self.start, self.tokens = time.perf_counter(), 0.0
        elif self.start is not None:
            self.tokens += tokens
            return f" | tokens/s per device: {self.tokens / (time.perf_counter() - self.start):.0f}"
        return ""


def forward(model, batch, optimizer, accelerator: Accelerator):
    batch["position_ids"] = torch.arange(0, batch["input_ids"].size(1), device=batch["input_ids"].device).unsqueeze(0)
    # labels only switches the model's loss on; shift_labels (already shifted) are the targets. Both are sharded
    # along the sequence with the inputs and positions.
    buffers = [batch["input_ids"], batch["shift_labels"], batch["labels"], batch["position_ids"]]
    with accelerator.maybe_context_parallel(
        buffers=buffers, buffer_seq_dims=[1, 1, 1, 1], no_restore_buffers=set(buffers)
    ):
        # Each data-parallel rank has its own batch and each context-parallel rank its own part of the
        # sequence: the loss of the whole step is the average over the dp_cp ranks.
        loss_reduce_grp = (
            accelerator.torch_device_mesh["dp_cp"].get_group()
            if accelerator.parallelism_config.dp_cp_dim_names
            else None
        )
        outputs = model(**batch)
        loss = outputs.loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=loss_reduce_grp)

    return loss


def train(args):
    parallelism_config = ParallelismConfig(
        dp_replicate_size=args.dp_replicate_size,
        dp_shard_size=args.dp_shard_size,
        tp_size=args.tp_size,
        cp_size=args.cp_size,
    )

    # FSDP settings in Accelerate's names; ndparallel shards every decoder layer (its model's layer list).
    fsdp2_plugin = None
    if parallelism_config.dp_shard_enabled or parallelism_config.cp_enabled:
        fsdp2_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
            state_dict_type="SHARDED_STATE_DICT",
        )

    accelerator = Accelerator(
        log_with=["jsonl"],
        project_dir=args.save_dir,
        mixed_precision=args.mixed_precision,
        parallelism_config=parallelism_config,
        fsdp_plugin=fsdp2_plugin,
    )
    accelerator.init_trackers("nd_parallel_training")

    # prepare() applies tensor parallel (ndparallel's plan for Llama), context parallel and FSDP.
    model = AutoModelForCausalLM.from_config(tiny_llama_config())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
    dataset = synthetic_dataset(args.num_steps * accelerator.mesh.size("dp"), args.sequence_length, 256)
    dataloader = DataLoader(dataset, batch_size=1, collate_fn=collate)

    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)

    total_num_steps = min(args.num_steps, len(dataloader))
    throughput = Throughput(warmup_steps=5)

    accelerator.print("Starting training...")
    for step, batch in enumerate(dataloader):
        if step >= total_num_steps:
            break

        loss = forward(model, batch, optimizer, accelerator)

        # Tokens per device: the ranks of one tp x cp group share one sequence per step.
        print_msg = f"Step {step}/{total_num_steps}, Loss: {loss.item():.4f}"
        print_msg += throughput.step(args.sequence_length / parallelism_config.non_data_parallel_size)

        if step % 10 == 0 or step == total_num_steps - 1:
            accelerator.print(print_msg)

        if step % args.checkpoint_frequency == 0 and step > 0 and parallelism_config.dp_shard_enabled:
            accelerator.print(f"Saving checkpoint at step {step}...")
            accelerator.save_state(args.save_dir + f"/checkpoint-{step}")

        accelerator.log({"loss": loss.item()})

    accelerator.print("Training completed!")

    model.save_pretrained(args.save_dir + f"/{args.model_name}")
    accelerator.print(f"Model saved to {args.save_dir}/{args.model_name}")
    accelerator.end_training()


if __name__ == "__main__":
    set_seed(42)
    args = parse_args()
    train(args)
