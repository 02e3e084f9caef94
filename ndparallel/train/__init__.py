"""The training job behind ``ndparallel train``: config, data, loop, progress."""

from ndparallel.train.data import BatchLoader, ByteCorpus
from ndparallel.train.job_config import TrainConfig
from ndparallel.train.loop import TrainResult, train

__all__ = ["BatchLoader", "ByteCorpus", "TrainConfig", "TrainResult", "train"]
