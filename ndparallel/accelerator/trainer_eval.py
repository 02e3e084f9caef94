"""Evaluation and prediction with the Trainer on several data ranks: datasets the dp sampler would cut short are
refused, gathered rows are put back in the dataset's order, vocabulary-sharded logits (tp) become full tensors.
docs/accelerate-migration.md#the-transformers-trainer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torch.distributed.tensor import DTensor

from ndparallel.accelerator.trainer_accelerator import rebuilt
from ndparallel.errors import ConfigError

__all__ = ["check_eval_size", "dataset_order", "full_tensors", "in_dataset_order"]


def check_eval_size(dataset: Any, dp: int, what: str, batch: int = 1, drop_last: bool = False) -> None:
    """The dp sampler drops the last ``len % dp`` samples of a pass, and ``dataloader_drop_last`` each rank's
    last partial batch: refused for evaluation and prediction (those samples would not be evaluated)."""
    if dataset is None or dp == 1 or not hasattr(dataset, "__len__"):
        return
    datasets = dataset.values() if isinstance(dataset, dict) else [dataset]
    for data in datasets:
        if len(data) % dp:
            raise ConfigError(
                f"{what} has {len(data)} samples, which dp={dp} data ranks do not divide: the last {len(data) % dp} "
                f"would not be evaluated; use a multiple of {dp} samples"
            )
        if drop_last and (len(data) // dp) % batch:
            raise ConfigError(
                f"{what}: dataloader_drop_last drops each rank's last {(len(data) // dp) % batch} samples (of "
                f"{len(data) // dp} per rank in batches of {batch}); use a multiple of dp x eval batch = {dp * batch} "
                "samples, or dataloader_drop_last=False"
            )


def dataset_order(samples: int, dp: int, batch: int) -> np.ndarray:
    """The dataset index of each row the evaluation loop gathers: step by step, each dp rank's batch in rank
    order, rank ``r`` holding samples ``r, r + dp, ...`` (the prepared loader's sampler)."""
    per_rank = samples // dp
    order = []
    for start in range(0, per_rank, batch):
        for rank in range(dp):
            order += [rank + dp * i for i in range(start, min(start + batch, per_rank))]
    return np.asarray(order)


def in_dataset_order(value: Any, inverse: np.ndarray) -> Any:
    """``value``'s rows (one per sample) in the dataset's order; an array whose rows are not the samples (an MoE's
    ``router_logits``, one row per token) cannot be put back and is refused."""
    if isinstance(value, (tuple, list)):
        return rebuilt(value, [in_dataset_order(v, inverse) for v in value])
    if isinstance(value, np.ndarray) and value.ndim:
        if value.shape[0] != len(inverse):
            raise ConfigError(
                f"predict() on several data ranks returned an output of {value.shape[0]} rows for {len(inverse)} "
                "samples (e.g. router_logits, one row per token): its rows cannot be put back in the dataset's order; "
                "leave it out of the outputs (output_router_logits=False), or predict on one data rank"
            )
        return value[inverse]
    return value


def full_tensors(value: Any) -> Any:
    """Vocabulary-sharded logits (tp) as full tensors, inside the Trainer's nested outputs."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, (tuple, list)):
        return rebuilt(value, [full_tensors(v) for v in value])
    return value
