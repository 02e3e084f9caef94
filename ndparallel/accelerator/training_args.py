"""``ndparallel.hf.TrainingArguments``: transformers' ``TrainingArguments`` that refuses ``deepspeed=`` first.

transformers checks for the deepspeed package while it builds the arguments, so ``deepspeed=...`` failed with its
``PackageNotFoundError`` (deepspeed not installed) or, installed, went on to a Trainer that ndparallel refuses
anyway: ndparallel shards the model itself (``parallelism_config``)."""

from __future__ import annotations

from typing import Any

from ndparallel.errors import ConfigError

__all__ = ["training_arguments_class"]

_CLASS: list[type] = []


def training_arguments_class() -> type:
    """The class (built once, on first use: transformers is imported then)."""
    if not _CLASS:
        from transformers import TrainingArguments as Base

        class TrainingArguments(Base):  # no new fields: transformers' dataclass __init__ calls this __post_init__
            def __post_init__(self) -> Any:
                if self.deepspeed:
                    raise ConfigError(
                        f"TrainingArguments(deepspeed={self.deepspeed!r}): DeepSpeed is not ndparallel's engine; "
                        "drop it and shard with Trainer(..., parallelism_config=ParallelismConfig(dp_shard_size=-1))"
                    )
                return super().__post_init__()

        TrainingArguments.__module__, TrainingArguments.__qualname__ = "ndparallel.hf", "TrainingArguments"  # pickles
        _CLASS.append(TrainingArguments)
    return _CLASS[0]
