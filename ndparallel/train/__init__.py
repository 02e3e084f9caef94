"""The training job behind ``ndparallel train``: config, data, loop, progress."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ndparallel.lazy import lazy_names

# Public name -> its module, imported on first use (PEP 562): ``ndparallel train``'s front process reads the
# config (``job_config``) without the loop's DTensor and checkpoint imports.
_EXPORTS: dict[str, str] = {
    "BatchLoader": "ndparallel.train.data",
    "ByteCorpus": "ndparallel.train.data",
    "TrainConfig": "ndparallel.train.job_config",
    "TrainResult": "ndparallel.train.loop",
    "train": "ndparallel.train.loop",
}

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ imports each on first use
    from ndparallel.train.data import BatchLoader, ByteCorpus
    from ndparallel.train.job_config import TrainConfig
    from ndparallel.train.loop import TrainResult, train


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)


__all__ = ["BatchLoader", "ByteCorpus", "TrainConfig", "TrainResult", "train"]
