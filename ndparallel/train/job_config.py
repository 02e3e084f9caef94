"""TrainConfig: one YAML file = parallelism + model + data + optimisation + checkpointing + logging.

Sections and their defaults are the dataclasses below. ``key=value`` overrides address a field
as ``section.field`` (``train.steps=50``, ``model.n_layers=4``); parallelism fields may be given
bare (``tp_size=2``). Unknown keys raise ``ConfigError`` with a did-you-mean suggestion.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import yaml

from ndparallel.config.parallelism import (
    CPU_RANKS_ENV,
    SIZE_FIELDS,
    ParallelismConfig,
    environment_note,
    is_parallelism_key,
)
from ndparallel.config.preflight import JobShape, check_job, check_seq_fits, split_batch
from ndparallel.config.sources import coerce_fields, load_yaml_mapping, parse_overrides
from ndparallel.distributed.memory import check_fits_in_memory as fits_in_memory
from ndparallel.distributed.memory import ranks_on_this_machine
from ndparallel.distributed.process import check_device_type
from ndparallel.errors import ConfigError, brief_repr
from ndparallel.models import TransformerConfig

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "LoopConfig",
    "TrainConfig",
    "check_fits_in_memory",
    "job_device",
]


@dataclass
class DataConfig:
    path: str | None = None
    """A text file, a JSONL file (each line's ``text_field``) or a folder of them; default: the Python standard
    library's source (exists everywhere)."""
    seq_len: int = 128
    max_bytes: int = 4_000_000
    """Read at most this much of the corpus."""
    documents: bool = False
    """Pack documents with document masks: each file (each JSONL line) is one document, and attention stays inside
    it (docs/training.md#data). False: one byte stream, windows cut anywhere, attention across files."""
    text_field: str = "text"
    """The field of a JSONL line that holds its text."""


@dataclass
class LoopConfig:
    steps: int = 100
    global_batch: int = 16
    """Sequences per optimizer step, summed over data-parallel ranks and micro-batches."""
    micro_batch: int | None = None
    """Sequences per rank per forward; default global_batch / dp (no accumulation)."""
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = 1.0
    """0 disables clipping."""
    router_bias_rate: float = 0.001
    """A sigmoid router's balancing bias (``model.router: sigmoid``) moves this much per optimizer step towards
    its under-loaded experts, from the step's global tokens per expert (DeepSeek-V3's auxiliary-loss-free
    balancing, whose rate this default is); 0: the bias stays. No effect on other routers."""
    seed: int = 0
    log_every: int = 10
    metrics_file: str | None = None
    """JSONL file of per-step metrics (rank 0); default: none."""
    device: str | None = None
    """cpu or cuda; default cuda when available (``NDP_DEVICE`` overrides)."""
    peak_tflops: float | None = None
    """Per-device peak for the MFU estimate; default: bf16 dense peak of known GPUs, none on CPU."""
    timeout_s: float = 600.0
    """A rank that waits this long for its peers ends the job, naming the rank(s) behind (``--timeout``)."""
    max_nonfinite_steps: int = 1
    """Stop the job after this many steps in a row whose loss or gradient norm is NaN/inf (such a step
    applies no update and is not saved); 1: at the first."""
    defer_grad_sync: bool | None = None
    """Under FSDP with several micro-batches, keep unsharded gradients until the last micro-batch and
    reduce-scatter once per step (less communication, much more memory); false: reduce-scatter every
    micro-batch. Unset: false, except under pipeline parallelism with FSDP, where torch's pipeline stage always
    defers (an explicit false is refused there). Pure data parallel always defers. Same field as
    ``TrainingSpec.defer_grad_sync``."""


@dataclass
class CheckpointConfig:
    dir: str | None = None
    """Root folder of step-numbered checkpoints; none disables checkpointing."""
    every: int = 0
    """Save every N steps (0: only at the end, when dir is set)."""
    keep_last: int = 3
    resume: bool | str = False
    """true: continue from the newest complete checkpoint under dir; a path: from that checkpoint."""
    verify: bool = True
    """Check every file of the checkpoint resumed from against its SHA-256 (false: sizes only)."""


_SECTIONS = {
    "model": TransformerConfig,
    "data": DataConfig,
    "train": LoopConfig,
    "checkpoint": CheckpointConfig,
}


@dataclass
class TrainConfig:
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    model: TransformerConfig = field(default_factory=lambda: TransformerConfig.from_preset("tiny"))
    data: DataConfig = field(default_factory=DataConfig)
    train: LoopConfig = field(default_factory=LoopConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, host_checks: bool = True) -> TrainConfig:
        """``host_checks=False``: leave out the rules about this machine's memory (a dry run builds nothing)."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"a training config must be a mapping of sections, got {type(data).__name__}")
        known = {"parallelism", *_SECTIONS}
        unknown = sorted(set(data) - known)
        if unknown:
            hint = difflib.get_close_matches(unknown[0], sorted(known), n=1)
            raise ConfigError(
                f"unknown config section(s) {unknown}; sections are {sorted(known)}"
                + (f"; did you mean {hint[0]!r}?" if hint else "")
            )
        _check_known_fields(data)
        kwargs: dict[str, Any] = {"parallelism": ParallelismConfig.from_dict(data.get("parallelism") or {})}
        for name, section_cls in _SECTIONS.items():
            values = data.get(name) or {}
            if not isinstance(values, Mapping):
                raise ConfigError(f"section {name!r} must be a mapping, got {type(values).__name__}")
            if section_cls is TransformerConfig:
                kwargs[name] = TransformerConfig.from_dict(values)
            else:
                kwargs[name] = _build(section_cls, name, values)
        cfg = cls(**kwargs)
        cfg.validate(host_checks=host_checks)
        return cfg

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: Iterable[str] = ()) -> TrainConfig:
        data = load_yaml_mapping(path)
        return cls.from_dict(apply_overrides(data, overrides))

    @classmethod
    def from_sources(
        cls,
        path: str | os.PathLike | None,
        overrides: Iterable[str] = (),
        environ: Mapping[str, str] | None = None,
        *,
        host_checks: bool = True,
    ) -> TrainConfig:
        """What ``ndparallel train`` reads: the YAML (or defaults), then the environment's parallelism
        variables (default ``os.environ``), then the command-line overrides
        (:meth:`ndparallel.ParallelismConfig.from_sources` orders the parallelism fields)."""
        data = load_yaml_mapping(path) if path else {}
        if not isinstance(data.get("parallelism") or {}, Mapping):
            return cls.from_dict(data, host_checks=host_checks)  # the section's own error
        parallel, rest = _split_parallel_overrides(overrides)
        data = {
            **data,
            "parallelism": ParallelismConfig.from_sources(data.get("parallelism"), environ, parallel).to_dict(),
        }
        return cls.from_dict(apply_overrides(data, rest), host_checks=host_checks)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(_plain(self.to_dict()), sort_keys=False)

    def validate(self, *, host_checks: bool = True) -> None:
        """Ranges and cross-field rules (types were checked when the sections were built); ``host_checks``: also
        that the corpus and the model fit this machine's memory."""
        t, d, c = self.train, self.data, self.checkpoint
        rules = [
            ("train.steps", t.steps >= 1, "must be >= 1"),
            ("train.global_batch", t.global_batch >= 1, "must be >= 1"),
            ("train.micro_batch", t.micro_batch is None or t.micro_batch >= 1, "must be >= 1 (or null)"),
            ("train.log_every", t.log_every >= 1, "must be >= 1"),
            ("train.lr", t.lr > 0, "must be > 0"),
            ("train.min_lr_ratio", 0 <= t.min_lr_ratio <= 1, "must be between 0 and 1"),
            ("train.warmup_steps", t.warmup_steps >= 0, "must be >= 0"),
            ("train.weight_decay", t.weight_decay >= 0, "must be >= 0"),
            ("train.betas", all(0 <= b < 1 for b in t.betas), "must be two numbers in [0, 1)"),
            ("train.max_grad_norm", t.max_grad_norm >= 0, "must be >= 0 (0 disables clipping)"),
            ("train.router_bias_rate", 0 <= t.router_bias_rate < math.inf, "must be a finite number >= 0 (0: off)"),
            ("train.device", t.device in (None, "cpu", "cuda"), "must be cpu, cuda or null"),
            ("train.peak_tflops", t.peak_tflops is None or t.peak_tflops > 0, "must be > 0 (or null)"),
            ("train.timeout_s", math.isfinite(t.timeout_s) and t.timeout_s > 0, "must be a number of seconds > 0"),
            ("train.max_nonfinite_steps", t.max_nonfinite_steps >= 1, "must be >= 1"),
            ("data.seq_len", d.seq_len >= 1, "must be >= 1"),
            ("data.max_bytes", d.max_bytes >= 1, "must be >= 1"),
            ("checkpoint.every", c.every >= 0, "must be >= 0 (0: only at the end)"),
            ("checkpoint.keep_last", c.keep_last >= 1, "must be >= 1"),
        ]
        for name, ok, message in rules:
            if not ok:
                section, field_name = name.split(".")
                raise ConfigError(f"{name}={brief_repr(getattr(getattr(self, section), field_name))} {message}")
        ranks = ranks_on_this_machine()
        fits_in_memory(
            0 if not host_checks else d.max_bytes, 1, holders=ranks, what=f"data.max_bytes={d.max_bytes} needs",
            held=f"on this machine's {ranks} rank(s) (every rank holds what it reads)", fix="lower data.max_bytes",
        )  # fmt: skip
        check_seq_fits(d.seq_len, self.model.max_seq_len)
        if (c.every or c.resume is True) and not c.dir:
            raise ConfigError("checkpoint.every / checkpoint.resume=true need checkpoint.dir (where to save and look)")
        if d.path is None and self.model.vocab_size < 256:
            raise ConfigError(f"model.vocab_size={self.model.vocab_size} must be >= 256 for byte-level data")
        if host_checks:
            check_fits_in_memory(self.model)

    def accumulation_steps(self, dp_size: int) -> int:
        """Micro-batches per optimizer step on each rank, checked against the data-parallel size."""
        return split_batch(self.train.global_batch, self.train.micro_batch, dp_size)

    def job_shape(self) -> JobShape:
        """The batch and sequence of one step, as the shared pre-flight reads them."""
        return JobShape(self.train.global_batch, self.data.seq_len, self.train.micro_batch, self.train.defer_grad_sync)

    def check_mesh(self, sizes: ParallelismConfig) -> int:
        """Everything that depends on the resolved mesh sizes (:func:`ndparallel.config.preflight.check_job`,
        the rule ``ndparallel bench`` and ``ndparallel plan`` apply too); returns the accumulation steps.

        Called before any rank starts (``ndparallel train --cpu-ranks``) and again inside ``train``. An error
        says which sizes an environment variable set (``NDP_TP_SIZE=3 in the environment sets tp_size``).
        """
        try:
            return check_job(sizes, self.job_shape(), self.model.preflight_shape())
        except ConfigError as err:
            note = environment_note(SIZE_FIELDS, sizes)
            if not note:
                raise
            raise ConfigError(f"{err}{note}") from None


def check_fits_in_memory(model: TransformerConfig, memory: int | None = None) -> None:
    """Refuse a model whose construction alone needs more than this machine's physical memory: each
    rank builds the whole model on the host (weights and rotary tables in ``model.dtype``) before sharding it.
    The rule is :func:`ndparallel.distributed.memory.check_fits_in_memory`; this counts the elements."""
    weights = model.num_params()
    rotary = 3 * model.max_seq_len * (model.head_dim // 2)  # cos and sin tables, and the angles behind them
    if rotary > weights:
        what, held = f"model.max_seq_len={model.max_seq_len} needs", "of rotary tables and weights"
        fix = "lower model.max_seq_len"
    else:
        what = f"the model ({weights / 1e9:,.1f}B parameters) needs"
        held, fix = f"of {model.dtype} weights and rotary tables", "choose a smaller model"
    ranks = ranks_on_this_machine()
    fits_in_memory(
        weights + rotary, model.torch_dtype.itemsize, what=what, fix=fix, memory=memory, holders=ranks,
        held=f"{held} to build on each of this machine's {ranks} rank(s)",
    )  # fmt: skip


def refuse_cuda_on_cpu_ranks(requested: str | None, source: str) -> None:
    """``--cpu-ranks`` runs gloo ranks on this CPU (it sets ``NDP_DEVICE=cpu``): an explicit cuda request
    beside it would silently train on the CPU instead, so it is refused."""
    if requested == "cuda":
        raise ConfigError(
            f"{source}=cuda but --cpu-ranks runs CPU (gloo) ranks; drop --cpu-ranks to use CUDA "
            "(torchrun or `ndparallel launch --nproc-per-node N`), or ask for cpu"
        )


def job_device(cfg: TrainConfig) -> str:
    """The device type of the job: ``NDP_DEVICE``, else ``train.device``, else cuda when available;
    an unknown name, or cuda without CUDA, is a ConfigError naming where it came from. ``train.device`` is
    checked even where ``NDP_DEVICE`` wins: a config asking for cuda on a machine without it is refused,
    not run on the CPU, and so is one asking for cuda on ranks ``launch --cpu-ranks`` started."""
    if os.environ.get(CPU_RANKS_ENV):
        refuse_cuda_on_cpu_ranks(cfg.train.device, "train.device")
    configured = check_device_type(cfg.train.device, "train.device") if cfg.train.device else None
    if os.environ.get("NDP_DEVICE"):
        return check_device_type(os.environ["NDP_DEVICE"], "NDP_DEVICE")
    return configured or ("cuda" if torch.cuda.is_available() else "cpu")


def _section_fields(section: str) -> set[str]:
    if section == "model":
        return {f.name for f in dataclasses.fields(TransformerConfig)} | {"preset"}
    return {f.name for f in dataclasses.fields(_SECTIONS[section])}


def _check_known_fields(data: Mapping[str, Any]) -> None:
    """Every unknown field of every section in one error (it took one run per typo), each with a did-you-mean, or
    the section that has it (``model.ep_size`` is ``parallelism.ep_size``)."""
    homes = {name: _section_fields(name) for name in _SECTIONS}
    unknown = []
    for section, values in data.items():
        if not isinstance(values, Mapping):
            continue  # the section's own error
        for key in map(str, values):
            if is_parallelism_key(key) if section == "parallelism" else key in homes[section]:
                continue
            home = [f"{name}.{key}" for name, fields in homes.items() if key in fields and name != section]
            home += [f"parallelism.{key}"] if section != "parallelism" and is_parallelism_key(key) else []
            options = homes.get(section) or {f.name for f in dataclasses.fields(ParallelismConfig)}
            close = difflib.get_close_matches(key, sorted(options), n=1, cutoff=0.6)
            hint = f" (it belongs in {home[0]})" if home else f" (did you mean {close[0]!r}?)" if close else ""
            unknown.append(f"{section}.{key}{hint}")
    if unknown:
        raise ConfigError(
            f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: fix or remove "
            f"{'them' if len(unknown) > 1 else 'it'} (the fields of each section: docs/configuration.md)"
        )


def _build(section_cls: type, name: str, values: Mapping[str, Any]) -> Any:
    return section_cls(**coerce_fields(section_cls, values, name))


def _split_parallel_overrides(overrides: Iterable[str]) -> tuple[dict[str, Any], list[str]]:
    """``(parallelism field -> value, the other overrides)``: bare fields and ``parallelism.field`` go first."""
    parallel_fields = {f.name for f in dataclasses.fields(ParallelismConfig)}
    parallel, rest = {}, []
    for item in overrides:
        key = item.partition("=")[0].strip()
        name = key.removeprefix("parallelism.")
        if name in parallel_fields and (key == name or key.startswith("parallelism.")):
            parallel[name] = next(iter(parse_overrides([item]).values()))
        else:
            rest.append(item)
    return parallel, rest


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply ``section.field=value`` (or bare parallelism ``field=value``) overrides to a config mapping."""
    result = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in data.items()}
    parallel_fields = {f.name for f in dataclasses.fields(ParallelismConfig)}
    for key, value in parse_overrides(overrides).items():
        section, dot, name = key.partition(".")
        if not dot:
            if key not in parallel_fields:
                raise ConfigError(
                    f"override {key!r}: write section.field=value (e.g. train.steps=50), or a parallelism field"
                )
            section, name = "parallelism", key
        result.setdefault(section, {})
        if not isinstance(result[section], dict):
            raise ConfigError(f"override {key!r}: section {section!r} is not a mapping")
        result[section][name] = value
    return result


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
