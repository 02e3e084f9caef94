"""Experiment trackers for ``Accelerator(log_with=...)``: JSONL built in, TensorBoard through the optional
``tensorboard`` package, or any object with Accelerate's tracker methods. Trackers run on the main process.
As in Accelerate, a tracker whose package is missing is skipped with a warning (Accelerate's other
integrations, ``wandb``..., have no ndparallel tracker: always skipped, with a warning); a name that is no
tracker at all raises.

Files go to ``<project_dir>/<project_name>/``: ``metrics.jsonl`` (one ``{"step": s, ...values}`` line per
``log`` call) and ``config.json`` for the JSONL tracker; TensorBoard event files for ``tensorboard``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import numbers
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from ndparallel.config.paths import check_writable_folder
from ndparallel.distributed.agree import agree, rank
from ndparallel.errors import ConfigError

__all__ = [
    "BUILT_IN",
    "BlankTracker",
    "GeneralTracker",
    "JSONLTracker",
    "TensorBoardTracker",
    "TrackerNames",
    "check_logging_dir",
    "make_trackers",
    "tracker_names",
]

BUILT_IN = ("jsonl", "tensorboard")
# Accelerate's other integrations: named so the error can say what to use instead.
_ACCELERATE_ONLY = ("wandb", "comet_ml", "mlflow", "aim", "clearml", "dvclive", "swanlab", "trackio")
_TRACKER_METHODS = ("log", "store_init_configuration", "finish")


def _scalar(key: str, value: Any) -> float | int | str:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(f"log: {key!r} is a tensor of {value.numel()} elements; log a number (tensor.item())")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (numbers.Number, str)):
        raise ConfigError(f"log: {key!r}={value!r} must be an int, float, str or a one-element tensor")
    if isinstance(value, numbers.Integral):
        return int(value)
    return value if isinstance(value, str) else float(value)


class JSONLTracker:
    """Appends one JSON line per ``log`` call to ``<logging_dir>/<project_name>/metrics.jsonl``."""

    name = "jsonl"

    def __init__(self, project_name: str, logging_dir: str | os.PathLike):
        self.directory = Path(logging_dir) / project_name
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / "metrics.jsonl"
        self._file = self.path.open("a", encoding="utf-8")

    @property
    def tracker(self) -> Any:
        return self._file

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        (self.directory / "config.json").write_text(json.dumps(values, indent=2, sort_keys=True, default=str) + "\n")

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        record: dict[str, Any] = {} if step is None else {"step": int(step)}
        for key, value in values.items():
            number = _scalar(key, value)
            record[key] = None if isinstance(number, float) and not math.isfinite(number) else number
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def finish(self) -> None:
        self._file.close()


class TensorBoardTracker:
    """Scalars (``add_scalar``) and strings (``add_text``) through ``torch.utils.tensorboard.SummaryWriter``."""

    name = "tensorboard"

    def __init__(self, project_name: str, logging_dir: str | os.PathLike, **kwargs: Any):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ConfigError(
                f"log_with='tensorboard' needs the tensorboard package ({err}): pip install 'ndparallel[tensorboard]'"
            ) from None
        self.logging_dir = Path(logging_dir) / project_name
        self.writer = SummaryWriter(str(self.logging_dir), **kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.writer.add_text("config", json.dumps(values, indent=2, sort_keys=True, default=str))
        self.writer.flush()

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            number = _scalar(key, value)
            if isinstance(number, str):
                self.writer.add_text(key, number, global_step=step, **kwargs)
            else:
                self.writer.add_scalar(key, number, global_step=step, **kwargs)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class BlankTracker:
    """What ``get_tracker`` returns on the processes that log nothing: every call is a no-op."""

    name = "blank"
    tracker = None

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        pass

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        pass

    def finish(self) -> None:
        pass


def tracker_names(log_with: Any, logging_dir: str | os.PathLike | None) -> list[Any]:
    """``log_with`` as a list, checked on every rank before any tracker starts: built-in names (they write
    files: ``logging_dir`` must be set), or objects with ``log``, ``store_init_configuration`` and ``finish``.
    Other names raise a ConfigError naming the fix."""
    if log_with is None:
        return []
    entries = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    if "all" in entries:
        entries = [e for e in entries if e != "all"] + [n for n in BUILT_IN if n not in entries]
    kept = []
    for entry in entries:
        if isinstance(entry, str):
            name = entry.lower()
            skipped = _skip_reason(name)
            if skipped is not None:
                warnings.warn(f"Accelerator(log_with={entry!r}): {skipped}; this tracker is skipped", stacklevel=3)
                continue
            if name not in BUILT_IN:
                raise ConfigError(f"log_with={entry!r} is not a tracker; ndparallel has {list(BUILT_IN)}")
            if logging_dir is None:
                raise ConfigError(f"log_with={entry!r} writes files: pass Accelerator(project_dir=...)")
        elif not all(callable(getattr(entry, m, None)) for m in _TRACKER_METHODS):
            raise ConfigError(f"log_with entry {entry!r} is not a tracker: it needs {', '.join(_TRACKER_METHODS)}")
        kept.append(entry.lower() if isinstance(entry, str) else entry)
    return kept


def _skip_reason(name: str) -> str | None:
    """Why the tracker ``name`` is skipped (Accelerate skips a tracker whose package is absent), or None."""
    if name in _ACCELERATE_ONLY:
        return (
            f"ndparallel has no {name} tracker (use 'jsonl' or 'tensorboard', or pass your own tracker object "
            f"with {', '.join(_TRACKER_METHODS)})"
        )
    if name == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        return "the tensorboard package is not installed (pip install 'ndparallel[tensorboard]')"
    return None


def check_logging_dir(entries: list[Any], logging_dir: str | os.PathLike | None) -> None:
    """Collective (every rank, when a built-in tracker is asked for): the main process, which writes the files,
    checks that ``logging_dir`` is a writable folder, and every rank raises the same one-line error if not,
    before any tracker starts (not an ``OSError`` on the main process and a lost connection on the others)."""
    if not any(isinstance(entry, str) for entry in entries):
        return
    error = None
    if rank() == 0:
        try:
            check_writable_folder(logging_dir, "project_dir")
        except ConfigError as e:  # raised on every rank by agree
            error = e
    agree(error, "Accelerator(log_with=...) cannot write its logs", error_type=ConfigError)


def make_trackers(
    entries: list[Any], project_name: str, logging_dir: str | None, init_kwargs: dict[str, dict]
) -> list[Any]:
    """Start the trackers of ``entries`` (from :func:`tracker_names`) for ``project_name``."""
    trackers = []
    for entry in entries:
        if not isinstance(entry, str):
            trackers.append(entry)
            continue
        kind = JSONLTracker if entry == "jsonl" else TensorBoardTracker
        trackers.append(kind(project_name, logging_dir, **init_kwargs.get(entry, {})))
    return trackers


class TrackerNames:
    """The Accelerator's tracker methods. Needs ``self._tracker_entries``, ``self.logging_dir``."""

    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        """Start the ``log_with`` trackers on the main process (files under ``project_dir/project_name``); a
        tracker object with ``main_process_only = False`` runs on every process (as Accelerate's)."""
        entries = self._tracker_entries
        if not self.is_main_process:
            entries = [e for e in entries if getattr(e, "main_process_only", True) is False]
        self.trackers = make_trackers(entries, project_name, self.logging_dir, init_kwargs or {})
        for tracker in self.trackers:
            if callable(getattr(tracker, "start", None)):
                tracker.start()
            if config is not None:
                tracker.store_init_configuration(config)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker ``name``; on the other processes a tracker that does nothing (as Accelerate)."""
        for tracker in self.trackers:
            if getattr(tracker, "name", None) == name:
                return tracker.tracker if unwrap else tracker
        if not self.is_main_process:
            return BlankTracker()
        raise ConfigError(f"no tracker named {name!r}: log_with has {[getattr(t, 'name', t) for t in self.trackers]}")

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Log ``values`` to every tracker (main process only)."""
        for tracker in self.trackers:
            tracker.log(values, step=step, **(log_kwargs or {}).get(getattr(tracker, "name", ""), {}))


class GeneralTracker:
    """Accelerate's base class of a custom tracker (``accelerate.tracking.GeneralTracker``): subclasses define
    ``name``, ``requires_logging_directory`` and ``tracker``, and ``store_init_configuration``, ``log`` and
    ``finish``; ``main_process_only = False`` makes the Accelerator use it on every process."""

    main_process_only = True

    def __init__(self, _blank: bool = False):
        missing = [a for a in ("name", "requires_logging_directory", "tracker") if not _blank and a not in dir(self)]
        if missing:
            raise ConfigError(
                f"{type(self).__name__} is missing {', '.join(missing)}: define them in the class, as Accelerate's "
                "GeneralTracker requires"
            )

    def start(self) -> None:
        """Called by ``init_trackers`` before the first ``store_init_configuration``."""

    def store_init_configuration(self, values: dict) -> None:
        """Record ``values`` as the run's hyperparameters."""

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` at ``step``."""

    def finish(self) -> None:
        """Flush and close."""
