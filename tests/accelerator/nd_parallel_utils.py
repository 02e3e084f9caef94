"""Stand-in for the ``utils.py`` beside Accelerate's examples/torch_native_parallelism/nd_parallel.py: the same
helper names and return shapes, offline (synthetic packed token windows instead of TinyStories, no tokenizer,
no GPU memory statistics)."""

from __future__ import annotations

import time

import torch

NUM_SAMPLES, VOCAB_SIZE, DATA_SEED = 48, 256, 0  # the test sets these


def packed_windows(seq_len: int) -> torch.Tensor:
    """``NUM_SAMPLES`` random token windows of ``seq_len + 1`` (what packing TinyStories gives, in shape)."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    return torch.randint(0, VOCAB_SIZE, (NUM_SAMPLES, seq_len + 1), generator=generator)


def get_dataset(tokenizer, seq_len: int, accelerator=None) -> list[dict]:
    """Packed samples as Accelerate's helper returns them: inputs, next-token labels (as ``shift_labels`` and as
    ``labels``) and positions, as lists."""
    rows = packed_windows(seq_len).tolist()
    return [
        {
            "input_ids": row[:-1],
            "shift_labels": row[1:],
            "position_ids": list(range(seq_len)),
            "labels": row[1:],
        }
        for row in rows
    ]


def create_collate_fn():
    """Accelerate's collate: ``labels`` is the same tensor as ``shift_labels`` (not a copy)."""

    def collate_fn(batch):
        input_ids = torch.tensor([item["input_ids"] for item in batch], dtype=torch.long)
        shift_labels = torch.tensor([item["shift_labels"] for item in batch], dtype=torch.long)
        return {"input_ids": input_ids, "shift_labels": shift_labels, "labels": shift_labels}

    return collate_fn


def setup_tokenizer(model_id: str):
    return None  # the synthetic dataset needs none


def get_model_flops_per_token(model, seq_len: int) -> float:
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_layer = 18 * cfg.hidden_size * cfg.intermediate_size
    per_layer += 12 * head_dim * (cfg.num_attention_heads + cfg.num_key_value_heads + cfg.num_attention_heads * seq_len)
    return per_layer * cfg.num_hidden_layers


class PerformanceTracker:
    """Steps and tokens per second after ``warmup_steps`` (no device memory statistics on CPU)."""

    def __init__(self, warmup_steps: int = 10):
        self.warmup_steps, self.step_count, self.num_tokens, self.start_time = warmup_steps, 0, 0, None

    def step(self, batch_tokens: int, model_flops_per_token: float | None = None) -> dict:
        self.step_count += 1
        if self.step_count == self.warmup_steps:
            self.start_time, self.num_tokens = time.perf_counter(), 0
            return {"warmup_completed": True}
        if self.start_time is None:
            return {}
        self.num_tokens += batch_tokens
        elapsed = time.perf_counter() - self.start_time
        metrics = {"tokens_per_second": self.num_tokens / elapsed, "steps_per_second": 0.0, "tflops_per_device": 0.0}
        metrics["steps_per_second"] = (self.step_count - self.warmup_steps) / elapsed
        if model_flops_per_token is not None:
            metrics["tflops_per_device"] = model_flops_per_token * self.num_tokens / (elapsed * 1e12)
        return metrics

    def get_print_message(self, metrics: dict, with_memory: bool = False) -> str:
        return (
            f" | steps/s: {metrics['steps_per_second']:.2f} | tokens/s: {metrics['tokens_per_second']:.2f}"
            f" | TFLOPS: {metrics['tflops_per_device']:.2f}"
        )
