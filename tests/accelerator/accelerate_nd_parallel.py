"""🤗 Accelerate's examples/torch_native_parallelism/nd_parallel.py as its users write it, on ndparallel.

Changed from Accelerate's file: the imports (``accelerate`` -> ``ndparallel``; its ``utils`` helpers ->
tests/accelerator/nd_parallel_utils.py, synthetic data offline) and three literals hoisted into constants
(``DTYPE``, ``MIXED_PRECISION``, ``LEARNING_RATE``, Accelerate's values by default) so that the test can also
run it in float64, and the loss average all-reduces ``loss.detach()`` (the same storage): on torch 2.13, gloo's
AVG on a tensor that requires grad races with autograd and segfaulted under load (tests/stress/avg_race.py).
Everything else -- ``log_with=["wandb"]``, the FSDP plugin, ``from_pretrained(tp_plan="auto",
tp_size=, device_mesh=accelerator.torch_device_mesh)``, the collate whose ``labels`` is ``shift_labels``,
``maybe_context_parallel`` with ``no_restore_buffers``, the loss averaged over ``dp_cp``, ``save_state`` and
``save_pretrained`` -- is Accelerate's.
"""

import argparse
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from ndparallel import Accelerator
from ndparallel.parallelism_config import ParallelismConfig
from ndparallel.utils import FullyShardedDataParallelPlugin, set_seed
from tests.accelerator.nd_parallel_utils import (
    PerformanceTracker,
    create_collate_fn,
    get_dataset,
    get_model_flops_per_token,
    setup_tokenizer,
)

MODEL_ID = "NousResearch/Hermes-3-Llama-3.1-8B"
DTYPE, MIXED_PRECISION, LEARNING_RATE = torch.bfloat16, "bf16", 1e-5


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp-replicate-size", type=int, default=1)
    parser.add_argument("--dp-shard-size", type=int, default=1)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--cp-size", type=int, default=1)
    parser.add_argument("--sequence-length", type=int, default=1024)
    parser.add_argument("--num-steps", type=int, default=1000)
    parser.add_argument("--save-dir", type=str, default="./outputs")
    parser.add_argument("--checkpoint-frequency", type=int, default=100)
    parser.add_argument("--model-name", type=str, default=MODEL_ID)
    return parser.parse_args()


def forward(model, batch, optimizer, accelerator: Accelerator):
    batch["position_ids"] = torch.arange(0, batch["input_ids"].size(1), device=batch["input_ids"].device).unsqueeze(0)
    # labels switches the model's loss on; shift_labels, already shifted, are what it uses (correct under cp)
    buffers = [batch["input_ids"], batch["shift_labels"], batch["labels"], batch["position_ids"]]
    with accelerator.maybe_context_parallel(
        buffers=buffers, buffer_seq_dims=[1, 1, 1, 1], no_restore_buffers=set(buffers)
    ):
        # the step's loss is the mean over the ranks that saw different tokens (dp and cp)
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
        # loss.detach(): the same storage, averaged in place, with no autograd history for gloo's AVG to race with
        # (torch 2.13 segfault, docs/troubleshooting.md#exit-time-aborts-and-native-crashes)
        dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG, group=loss_reduce_grp)

    return loss


def train(args):
    parallelism_config = ParallelismConfig(
        dp_replicate_size=args.dp_replicate_size,
        dp_shard_size=args.dp_shard_size,
        tp_size=args.tp_size,
        cp_size=args.cp_size,
    )

    fsdp2_plugin = None
    if parallelism_config.dp_shard_enabled or parallelism_config.cp_enabled:
        fsdp2_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
            state_dict_type="SHARDED_STATE_DICT",
        )

    accelerator = Accelerator(
        log_with=["wandb"],
        mixed_precision=MIXED_PRECISION,
        parallelism_config=parallelism_config,
        fsdp_plugin=fsdp2_plugin,
    )
    accelerator.init_trackers("nd_parallel_training")

    # with tp, the model is loaded for the accelerator's mesh
    model_kwargs = (
        {"tp_size": args.tp_size, "tp_plan": "auto", "device_mesh": accelerator.torch_device_mesh}
        if args.tp_size > 1
        else {}
    )
    model = AutoModelForCausalLM.from_pretrained(
        args.model_name,
        torch_dtype=DTYPE,
        use_cache=False,
        **model_kwargs,
    )
    tokenizer = setup_tokenizer(args.model_name)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    dataset = get_dataset(tokenizer, args.sequence_length, accelerator)
    dataloader = DataLoader(dataset, batch_size=1, collate_fn=create_collate_fn())

    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)

    total_num_steps = min(args.num_steps, len(dataloader))
    performance_tracker = PerformanceTracker(warmup_steps=5)
    model_flops_per_token = get_model_flops_per_token(model, args.sequence_length)

    accelerator.print("Starting training...")
    for step, batch in enumerate(dataloader):
        if step >= total_num_steps:
            break

        loss = forward(model, batch, optimizer, accelerator)

        # tokens per second per device: the ranks outside data parallelism share one sequence
        metrics = performance_tracker.step(
            batch["input_ids"].shape[1] / parallelism_config.non_data_parallel_size, model_flops_per_token
        )

        print_msg = f"Step {step}/{total_num_steps}, Loss: {loss.item():.4f}"
        if "warmup_completed" in metrics:
            accelerator.print("Warm up completed! Starting performance tracking...")
        elif metrics:
            print_msg += performance_tracker.get_print_message(metrics, with_memory=True)

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
    if args.dp_shard_size == 1 and args.tp_size > 1:
        warnings.warn("save_state needs FSDP (dp_shard_size > 1): intermediate checkpoints are skipped", stacklevel=2)
    train(args)
