"""ParallelismConfig: how the world of ranks is cut, and the knobs of each parallelism.

The five sizes multiply to the world size, outer to inner ``pp x dp_replicate x dp_shard x cp x tp``.
Exactly one of them may be ``-1``: it is filled with whatever the others leave. Every check
lives here, and every error names the field and a fix::

    cfg = ParallelismConfig(dp_shard_size=-1, tp_size=2).resolve(world_size=8)   # dp_shard 4
    cfg = ParallelismConfig.from_yaml("configs/2d.yaml").with_overrides(["tp_size=4"])
    cfg = ParallelismConfig.from_env()            # NDP_TP_SIZE=2 ... (or accelerate's names)
    cfg = ParallelismConfig.from_sources(file_mapping, os.environ, ["tp_size=4"])   # what the CLI does

Precedence, defined once (``from_sources``): defaults < file < environment < command line. An
``NDP_<FIELD>`` and a ``PARALLELISM_CONFIG_<FIELD>`` variable that set one field to different values
are an error (never "whichever the environment lists last").
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ndparallel.config.accelerate import AccelerateNames, accelerate_settings, is_accelerate_file
from ndparallel.config.dims import MESH_DIMS, SIZE_FIELDS, ep_mesh_problem, is_size
from ndparallel.config.pipeline import check_pipeline_fields
from ndparallel.config.sources import did_you_mean, load_yaml_mapping, parse_overrides, parse_scalar
from ndparallel.errors import ConfigError, brief_repr

__all__ = ["ParallelismConfig", "environment_fields", "is_parallelism_key"]


# Allowed values of the string knobs (the planner offers the same: ndparallel/estimate/training.py).
CHOICES: dict[str, tuple[str, ...]] = {
    "mixed_precision": ("no", "bf16", "fp16"),
    "activation_checkpointing": ("none", "full", "selective"),
    "cp_rotate_method": ("ring", "allgather", "alltoall"),
    "cp_backend": ("ndparallel", "torch"),
    "compile": ("none", "blocks", "model"),
}

# Section names a combined YAML file may keep the parallelism settings under.
_SECTION_KEYS = ("parallelism", "parallelism_config")
# Accelerate writes `parallelism_config_tp_size`; its env variables are `PARALLELISM_CONFIG_TP_SIZE`.
_ACCELERATE_PREFIX = "parallelism_config_"
_ENV_PREFIXES = ("NDP_", "PARALLELISM_CONFIG_")
# Accelerate's names for the knobs that differ from ours.
_ALIASES = {"cp_comm_strategy": "cp_rotate_method"}
CPU_RANKS_ENV = "NDP_CPU_RANKS"  # set by ``launch --cpu-ranks N`` for its ranks (with NDP_DEVICE=cpu)
OTHER_NDP_SETTINGS = frozenset({"NDP_DEVICE", "NDP_STORE_PATH", "NDP_LAUNCHER_PID", CPU_RANKS_ENV})
"""``NDP_*`` variables that are not parallelism fields (the device, the test store, the worker guard, simulated
CPU ranks): any other
``NDP_*`` close to a field name is taken for a misspelled field and refused (:func:`environment_fields`)."""


@dataclass
class ParallelismConfig(AccelerateNames):
    """Mesh sizes and parallelism knobs. ``resolve(world_size)`` fills ``-1`` and validates.

    Accelerate's read-only names (``dp_shard_enabled``, ``dp_cp_dim_names``, ``non_data_parallel_size`` ...)
    come from :class:`ndparallel.config.accelerate.AccelerateNames`."""

    pp_size: int = 1
    """Pipeline-parallel stages across ranks (outermost: stages talk point-to-point over the slowest links)."""
    dp_replicate_size: int = 1
    """Data-parallel replicas (each holds a full copy, or a full FSDP group under HSDP)."""
    dp_shard_size: int = 1
    """FSDP2 shard group size: parameters, gradients and optimizer state are split this many ways."""
    cp_size: int = 1
    """Context-parallel size: the sequence is split this many ways (ring attention)."""
    tp_size: int = 1
    """Tensor-parallel size: weights of each layer are split this many ways (innermost, fastest links)."""
    ep_size: int = 1
    """Expert-parallel size: each rank owns ``n_experts / ep_size`` routed experts, tokens reach them by all-to-all.
    Not a mesh dim of its own: ep borrows its ranks from dp_shard x cp (the inner ones), the experts' FSDP shards
    over what remains (``ndparallel.config.dims.ep_mesh_problem``; docs/expert-parallel.md)."""

    mixed_precision: str = "no"
    """Compute/parameter dtype under FSDP: ``no`` (fp32), ``bf16`` or ``fp16``; gradients reduce in fp32."""
    reshard_after_forward: bool = True
    """FSDP: free gathered parameters after forward (saves memory, costs a second all-gather in backward)."""
    cpu_offload: bool = False
    """FSDP: keep sharded parameters and optimizer state in CPU memory."""
    activation_checkpointing: str = "none"
    """``none``, ``full`` (recompute each block in backward) or ``selective`` (every other block)."""
    compile: str = "none"
    """``none``, ``blocks`` (per transformer block) or ``model`` (whole-model torch.compile)."""
    dp_bucket_mb: float = 25.0
    """Pure data parallel: gradient all-reduce bucket cap, MB."""
    cp_rotate_method: str = "ring"
    """Context parallel: ``ring`` (send/recv K/V around the ring), ``allgather`` (gather all K/V) or ``alltoall``
    (Ulysses: two all-to-alls swap sequence shards for head shards; query heads / tp must divide by cp)."""
    cp_load_balance: bool = True
    """Context parallel: head-tail (zig-zag) sequence split so causal attention costs the same on each rank."""
    cp_backend: str = "ndparallel"
    """Context parallel: ``ndparallel`` (own ring attention, CPU and CUDA) or ``torch`` (CUDA only)."""
    pp_schedule: str = "1f1b"
    """Schedule: gpipe, 1f1b, interleaved_1f1b, looped_bfs, interleaved_zb, zbv, dualpipev (V: torch >= 2.12)."""
    pp_microbatches: int | None = None
    """Micro-batches per step through the pipeline; None: the accumulation steps of ``train.micro_batch``, or
    without one the smallest count the schedule accepts that divides the per-rank batch (1F1B on 2 stages: 2;
    ``ndparallel.config.preflight.default_pipeline_microbatches``)."""
    pp_stages_per_rank: int | None = None
    """Stages each pp rank holds; None: 1 for gpipe/1f1b, 2 for the others (V schedules: exactly 2)."""
    pp_split: list[list[int]] | None = None
    """Explicit ``[first, last)`` block range per stage; None: balanced by parameter count."""

    def __post_init__(self) -> None:
        if self.mixed_precision is False:  # YAML 1.1 reads a bare `no` as false
            self.mixed_precision = "no"
        self.validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParallelismConfig:
        """Build from a mapping; accepts our names, accelerate's ``parallelism_config_*`` names,
        a mapping that holds the settings under a ``parallelism:`` section, and a whole
        ``accelerate config`` file (its keys honoured or refused by name: ndparallel/config/accelerate.py)."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"parallelism config must be a mapping of field: value, got {type(data).__name__}")
        if is_accelerate_file(data):
            data = accelerate_settings(data)
        for section in _SECTION_KEYS:
            if isinstance(data.get(section), Mapping):
                data = data[section]
                break
        values = {}
        for key, value in data.items():
            if _refuse_sequence_parallel(str(key), value):
                continue
            values[_canonical_key(str(key))] = value
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> ParallelismConfig:
        """Read a YAML file (safe loader): the whole file, or its ``parallelism:`` section."""
        return cls.from_dict(load_yaml_mapping(path))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, base: ParallelismConfig | None = None):
        """Override ``base`` (default: defaults) with ``NDP_<FIELD>`` or ``PARALLELISM_CONFIG_<FIELD>`` variables
        (see :func:`environment_fields`)."""
        return dataclasses.replace(base or cls(), **environment_fields(environ))

    @classmethod
    def from_sources(
        cls,
        file: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
        overrides: Iterable[str] | Mapping[str, Any] = (),
    ) -> ParallelismConfig:
        """The one precedence rule: defaults < ``file`` (a mapping, as :meth:`from_dict` reads it) <
        environment (``environ``, default ``os.environ``) < command-line ``overrides``."""
        cfg = cls.from_dict(file or {})
        try:
            cfg = cls.from_env(environ, base=cfg)
        except ConfigError as err:  # e.g. NDP_PP_SIZE=0: say the environment set it
            raise ConfigError(f"{err}{environment_note(_fields_named(str(err)), None, environ)}") from None
        return cfg.with_overrides(overrides)

    def with_overrides(self, overrides: Iterable[str] | Mapping[str, Any]) -> ParallelismConfig:
        """A copy with ``["tp_size=2", "mixed_precision=bf16"]`` (or a dict) applied."""
        items = overrides.items() if isinstance(overrides, Mapping) else parse_overrides(overrides).items()
        return dataclasses.replace(self, **{_canonical_key(k): v for k, v in items})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self, path: str | os.PathLike | None = None) -> str:
        """YAML text of this config under a ``parallelism:`` section; also written to ``path`` if given."""
        text = yaml.safe_dump({"parallelism": self.to_dict()}, sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    # ------------------------------------------------------------------ validation
    @property
    def sizes(self) -> dict[str, int]:
        """Mesh dimension name -> size, outer to inner (may contain one -1 before ``resolve``)."""
        return {dim: getattr(self, f"{dim}_size") for dim in MESH_DIMS}

    @property
    def world_size(self) -> int:
        """Product of the sizes; only meaningful once resolved."""
        return math.prod(self.sizes.values())

    def validate(self) -> None:
        """Check types, ranges and choices (not the world size: see ``resolve``)."""
        autos = []
        for name in SIZE_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(
                    f"{name}={brief_repr(value)} must be an integer (>= 1, or -1 to fill the rest of the world)"
                )
            if value == -1:
                autos.append(name)
            elif value < 1:
                raise ConfigError(f"{name}={value} is invalid: sizes are >= 1, or -1 to fill the rest of the world")
        if len(autos) > 1:
            raise ConfigError(
                f"only one size may be -1, got {' and '.join(autos)} = -1; set all but one of them explicitly"
            )
        ep = self.ep_size
        if not is_size(ep):
            raise ConfigError(f"ep_size={brief_repr(ep)} must be an integer >= 1 (ep borrows ranks; it is never -1)")
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                hint = did_you_mean(str(value), choices)
                raise ConfigError(f"{name}={brief_repr(value)} is not one of {list(choices)}{hint}")
        if self.cp_backend == "torch" and self.cp_rotate_method == "alltoall":
            raise ConfigError(
                "cp_rotate_method='alltoall' (Ulysses) needs cp_backend='ndparallel': torch's experimental context "
                "parallel only has ring attention (its own 'alltoall' rotate method passes K/V around a ring); use "
                "cp_backend='ndparallel', or cp_rotate_method='ring' with cp_backend='torch'"
            )
        for name in ("reshard_after_forward", "cpu_offload", "cp_load_balance"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={brief_repr(getattr(self, name))} must be true or false")
        bucket = self.dp_bucket_mb
        if isinstance(bucket, bool) or not isinstance(bucket, (int, float)) or not 0 < bucket < math.inf:
            raise ConfigError(f"dp_bucket_mb={brief_repr(bucket)} must be a positive number of megabytes")
        if self.cpu_offload and self.dp_shard_size == 1 and self.cp_size == 1:
            raise ConfigError("cpu_offload=true needs FSDP: set dp_shard_size > 1 (or -1)")
        check_pipeline_fields(self)  # ndparallel/config/pipeline.py

    def resolve(self, world_size: int) -> ParallelismConfig:
        """A copy with ``-1`` filled in, checked against ``world_size``. A size error names the ``NDP_*`` /
        ``PARALLELISM_CONFIG_*`` variable in ``os.environ`` that set a size to the value it has here."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world size {brief_repr(world_size)} must be a positive integer")
        sizes = self.sizes
        auto = [f"{d}_size" for d, s in sizes.items() if s == -1]
        fixed = math.prod(s for s in sizes.values() if s != -1)
        if auto:
            if world_size % fixed:
                raise ConfigError(
                    f"{auto[0]}=-1 cannot fill world size {world_size}: the other sizes multiply to {fixed}, "
                    f"which does not divide {world_size}{environment_note(SIZE_FIELDS, self)}. "
                    f"{_suggest(sizes, world_size)}"
                )
            return dataclasses.replace(self, **{auto[0]: world_size // fixed})._check_ep()
        if fixed != world_size:
            desc = " x ".join(f"{d}_size={s}" for d, s in sizes.items() if s != 1) or "all sizes = 1"
            raise ConfigError(
                f"mesh sizes multiply to {fixed} ({desc}) but the world size is {world_size}"
                f"{environment_note(SIZE_FIELDS, self)}. "
                f"{_suggest(sizes, world_size)}"
            )
        return dataclasses.replace(self)._check_ep()

    def _check_ep(self) -> ParallelismConfig:
        problem = ep_mesh_problem(self)
        if problem:
            raise ConfigError(problem)
        return self

    def describe(self) -> str:
        """``pp=2 x dp_shard=2 x tp=2`` (sizes > 1 only)."""
        parts = [f"{d}={s}" for d, s in self.sizes.items() if s != 1]
        ep = f" (ep={self.ep_size})" if self.ep_size > 1 else ""
        return (" x ".join(parts) or "single rank (all sizes 1)") + ep


def _field_names() -> set[str]:
    return {f.name for f in dataclasses.fields(ParallelismConfig)}


def is_parallelism_key(key: str) -> bool:
    """Whether a ``parallelism:`` section may hold ``key``: a field, an alias, Accelerate's prefixed name, or one
    of Accelerate's sequence-parallel keys (:meth:`ParallelismConfig.from_dict` refuses those with their own
    reason)."""
    name = key.removeprefix(_ACCELERATE_PREFIX)
    return _ALIASES.get(name, name) in _field_names() or name in _SEQUENCE_PARALLEL_KEYS


# Accelerate's DeepSpeed-Ulysses sequence-parallel settings: a dimension ndparallel does not have.
_SEQUENCE_PARALLEL_KEYS = (
    "sp_size",
    "sp_backend",
    "sp_seq_length",
    "sp_seq_length_is_variable",
    "sp_attn_implementation",
)


def _refuse_sequence_parallel(key: str, value: Any, source: str | None = None) -> bool:
    """True for an Accelerate ``sp_*`` key that has no effect (sp_size 1, or a companion of it); ConfigError
    for ``sp_size > 1``, naming the key and the ndparallel way to get the same split."""
    name = key.lower()
    name = name[len(_ACCELERATE_PREFIX) :] if name.startswith(_ACCELERATE_PREFIX) else name
    if name not in _SEQUENCE_PARALLEL_KEYS:
        return False
    if name == "sp_size" and value not in (None, 1, "1"):
        raise ConfigError(
            f"{source or key}={brief_repr(value)}: Accelerate's sp_size is DeepSpeed-Ulysses sequence parallelism, "
            "which ndparallel does not run as a separate dimension; split the sequence with "
            f"cp_size={brief_repr(value)} and cp_rotate_method=alltoall instead "
            "(Accelerate: parallelism_config_cp_size + cp_comm_strategy: alltoall)"
        )
    return True  # sp_size 1 and the sp_* companions change nothing, as in Accelerate without sp


def environment_fields(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Parallelism fields set by ``NDP_<FIELD>`` / ``PARALLELISM_CONFIG_<FIELD>`` variables (default ``os.environ``).

    Every ``PARALLELISM_CONFIG_*`` variable is honoured or refused by name: our field names, Accelerate's
    aliases (``CP_COMM_STRATEGY``), ``SP_SIZE`` 1 (and its ``SP_*`` companions, which then do nothing);
    ``SP_SIZE > 1`` and unknown names raise ConfigError. ``NDP_*`` variables that are not parallelism fields
    belong to other settings (:data:`OTHER_NDP_SETTINGS`), except one a typo away from a field (``NDP_TP_SIZ``):
    refused with a did-you-mean, as a misspelled size must not be silently ignored. Two variables that set one
    field to different values raise ConfigError naming both.
    """
    return {field: value for field, (_, value) in _environment_sources(environ).items()}


def _environment_sources(environ: Mapping[str, str] | None = None) -> dict[str, tuple[str, Any]]:
    """Field -> (the variable that sets it, its value): :func:`environment_fields` with the names kept."""
    environ = os.environ if environ is None else environ
    found: dict[str, tuple[str, Any]] = {}
    for name in sorted(environ):
        prefix = next((p for p in _ENV_PREFIXES if name.startswith(p)), None)
        if prefix is None:
            continue
        key = name[len(prefix) :].lower()
        try:
            value = parse_scalar(environ[name])
        except ConfigError as err:
            raise ConfigError(f"environment variable {name}: {err}") from None
        if _refuse_sequence_parallel(key, value, source=name):
            continue
        if key not in _field_names() and key not in _ALIASES:
            if prefix == "NDP_" and (name in OTHER_NDP_SETTINGS or not _close_to_a_field(key)):
                continue
            raise ConfigError(
                f"environment variable {name} is not a parallelism setting ndparallel knows"
                f"{did_you_mean(key, sorted(_field_names() | set(_ALIASES)))}; unset it"
            )
        field = _canonical_key(key)
        if field in found and found[field][1] != value:
            other, before = found[field]
            raise ConfigError(
                f"environment variables {other}={brief_repr(before)} and {name}={brief_repr(value)} both set {field}; "
                "unset one"
            )
        found[field] = (name, value)
    return found


def _close_to_a_field(key: str) -> bool:
    """True for a key one typo away from a parallelism field or alias (``tp_siz``), not for an unrelated name."""
    return bool(difflib.get_close_matches(key, sorted(_field_names() | set(_ALIASES)), n=1, cutoff=0.8))


def environment_note(
    fields: Iterable[str], cfg: ParallelismConfig | None = None, environ: Mapping[str, str] | None = None
) -> str:
    """``" (NDP_PP_SIZE=1 in the environment sets pp_size, over the config file)"`` for those of ``fields`` that
    an environment variable sets (and, given ``cfg``, to the value ``cfg`` holds): an error about a size must
    say where the size came from. Empty when none (or when the environment is itself malformed)."""
    try:
        sources = _environment_sources(environ)
    except ConfigError:
        return ""
    named = [
        (variable, value, field)
        for field, (variable, value) in sources.items()
        if field in set(fields) and (cfg is None or getattr(cfg, field) == value)
    ]
    if not named:
        return ""
    said = "; ".join(
        f"{variable}={brief_repr(value)} in the environment sets {field}" for variable, value, field in named
    )
    return f" ({said}, over the config file)"


def _fields_named(message: str) -> list[str]:
    """The parallelism fields a message names (``pp_size=0 is invalid`` -> ``["pp_size"]``)."""
    return [name for name in sorted(_field_names()) if re.search(rf"\b{name}\b", message)]


def _canonical_key(key: str) -> str:
    """Map accelerate-style and aliased keys to our field names; unknown keys raise with a suggestion."""
    name = key[len(_ACCELERATE_PREFIX) :] if key.startswith(_ACCELERATE_PREFIX) else key
    name = _ALIASES.get(name, name)
    if name not in _field_names():
        raise ConfigError(f"unknown parallelism field {key!r}{did_you_mean(name, sorted(_field_names()))}")
    return name


def _suggest(sizes: Mapping[str, int], world_size: int) -> str:
    """A valid alternative: keep what fits and let dp_shard (or dp_replicate) fill the rest."""
    kept = [d for d in ("pp", "cp", "tp") if sizes.get(d, 1) not in (1, -1)] or ["cp", "tp"]
    inner = math.prod(sizes.get(d, 1) for d in kept)
    if world_size % inner == 0:
        return (
            f"For example set dp_shard_size=-1 (it becomes {world_size // inner}), or choose sizes "
            f"whose product is {world_size}."
        )
    return (
        f"{' x '.join(f'{d}_size' for d in kept)} = {inner} must divide the world size {world_size}; "
        f"choose sizes whose product is {world_size}."
    )
