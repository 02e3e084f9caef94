"""Read a bench YAML into :class:`BenchCase` lists and run them.

File layout (``benchmarks/scaling.yaml`` is the reference)::

    defaults:                  # every case starts from these
      model: {preset: small}   # a TransformerConfig preset and/or fields
      seq_len: 256
      warmup: 2
      steps: 5
      device: cpu              # or cuda (run it through `ndparallel launch`)
      micro_batch: 2           # optional: sequences per rank per forward (accumulation, as train.micro_batch)
      defer_grad_sync: false   # optional: as train.defer_grad_sync
      parallelism: {}          # ParallelismConfig knobs shared by all shapes (mixed_precision, ...)
    sweeps:
      - name: strong           # fixed global batch: time per step should fall as ranks are added
        global_batch: 16
        shapes:
          - {dp_shard_size: 2}
          - {dp_shard_size: 2, tp_size: 2, label: fsdp2_tp2}
      - name: weak             # fixed batch per data-parallel rank: global batch grows with dp
        batch_per_dp_rank: 2
        models: [tiny, small]  # optional: cartesian product with the shapes
        shapes: [...]

A shape is a mapping of ParallelismConfig fields (explicit sizes) plus an optional ``label``; any
default or sweep-level key (``seq_len``, ``steps``, ``model``, ...) may also be set per shape.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ndparallel.bench.case import BenchCase
from ndparallel.config.dims import SIZE_FIELDS
from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.config.sources import load_yaml_mapping
from ndparallel.errors import ConfigError

__all__ = ["cases_from_config", "load_cases"]

_CASE_KEYS = ("seq_len", "warmup", "steps", "device", "compute_twin", "micro_batch", "defer_grad_sync")
_SWEEP_KEYS = {"name", "global_batch", "batch_per_dp_rank", "models", "shapes", "model", "parallelism", *_CASE_KEYS}


def _label(shape: Mapping[str, Any]) -> str:
    parts = [f"{k.removesuffix('_size')}{v}" for k in SIZE_FIELDS[1:] if (v := shape.get(k, 1)) != 1]
    if shape.get("pp_size", 1) != 1:
        parts.insert(0, f"pp{shape['pp_size']}_{shape.get('pp_schedule', '1f1b')}")
        if shape.get("pp_microbatches"):
            parts.insert(1, f"m{shape['pp_microbatches']}")
    return "_".join(parts) or "single"


def _model(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, str):
        return {"preset": value}
    if isinstance(value, Mapping):
        return dict(value)
    raise ConfigError(f"{where}: model must be a preset name or a mapping of model fields, got {value!r}")


def _cases_of_sweep(sweep: Mapping[str, Any], defaults: Mapping[str, Any], index: int) -> list[BenchCase]:
    name = sweep.get("name", f"sweep{index}")
    unknown = sorted(set(sweep) - _SWEEP_KEYS)
    if unknown:
        raise ConfigError(f"sweep {name!r}: unknown key(s) {unknown}; known: {sorted(_SWEEP_KEYS)}")
    has_global, has_local = "global_batch" in sweep, "batch_per_dp_rank" in sweep
    if has_global == has_local:
        raise ConfigError(
            f"sweep {name!r}: set exactly one of global_batch (strong scaling) or batch_per_dp_rank (weak scaling)"
        )
    shapes = sweep.get("shapes")
    if not isinstance(shapes, list) or not shapes:
        raise ConfigError(f"sweep {name!r}: shapes must be a non-empty list of mesh shapes")
    models = sweep.get("models") or [sweep.get("model", defaults.get("model", {"preset": "tiny"}))]
    if not isinstance(models, list):
        raise ConfigError(f"sweep {name!r}: models must be a list of presets or model mappings")
    base_parallel = {**dict(defaults.get("parallelism", {})), **dict(sweep.get("parallelism", {}))}
    cases = []
    for model_value in models:
        model = _model(model_value, f"sweep {name!r}")
        for shape in shapes:
            if not isinstance(shape, Mapping):
                raise ConfigError(f"sweep {name!r}: each shape must be a mapping such as {{dp_shard_size: 2}}")
            shape = dict(shape)
            label = str(shape.pop("label", _label(shape)))
            if len(models) > 1:
                label = f"{model.get('preset', 'model')}/{label}"
            settings = {k: shape.pop(k, sweep.get(k, defaults.get(k))) for k in _CASE_KEYS}
            case_model = _model(shape.pop("model"), f"sweep {name!r}") if "model" in shape else model
            parallel = {**base_parallel, **shape}
            sizes = ParallelismConfig.from_dict(parallel).sizes
            dp = sizes["dp_replicate"] * sizes["dp_shard"]
            if has_global:
                global_batch = sweep["global_batch"]
            else:
                per_rank = sweep["batch_per_dp_rank"]
                if not isinstance(per_rank, int) or isinstance(per_rank, bool) or per_rank < 1:
                    raise ConfigError(f"sweep {name!r}: batch_per_dp_rank={per_rank!r} must be a positive integer")
                global_batch = per_rank * dp
            kwargs = {k: v for k, v in settings.items() if v is not None}
            cases.append(BenchCase(name, label, case_model, parallel, global_batch=global_batch, **kwargs))
    return cases


def cases_from_config(data: Mapping[str, Any], device: str | None = None) -> list[BenchCase]:
    """All cases of a bench config mapping, in file order; ``device`` overrides every case's device."""
    if not isinstance(data, Mapping) or not isinstance(data.get("sweeps"), list):
        raise ConfigError("a bench config needs a `sweeps:` list (see benchmarks/scaling.yaml)")
    defaults = data.get("defaults", {}) or {}
    if not isinstance(defaults, Mapping):
        raise ConfigError("bench config: `defaults:` must be a mapping")
    defaults = {"seq_len": 128, **defaults}
    cases = []
    for i, sweep in enumerate(data["sweeps"]):
        if not isinstance(sweep, Mapping):
            raise ConfigError(f"bench config: sweep {i} must be a mapping with name, shapes and a batch")
        cases += _cases_of_sweep(sweep, defaults, i)
    if device:
        for case in cases:
            case.device = device
    for case in cases:
        case.validate()
    return cases


def load_cases(
    path: str | os.PathLike, only: list[str] | None = None, device: str | None = None, max_ranks: int | None = None
) -> list[BenchCase]:
    """Cases from a YAML file; ``only`` keeps sweeps by name, ``max_ranks`` drops larger worlds."""
    data = load_yaml_mapping(path)
    cases = cases_from_config(data, device=device)
    if only:
        names = {c.sweep for c in cases}
        missing = sorted(set(only) - names)
        if missing:
            raise ConfigError(f"--sweep {missing} not in {path}; its sweeps are {sorted(names)}")
        cases = [c for c in cases if c.sweep in only]
    if max_ranks:
        cases = [c for c in cases if c.world_size <= max_ranks]
    return cases
