"""The first module where a layout leaves the reference (``--localize``), and the first module that is not
deterministic (the reference run twice).

One step is run with a forward hook on every module (its output; DTensors gathered with ``full_tensor()``)
and the parameter gradients gathered after backward, on the ranks and in one process. Each rank's output is
compared with the matching piece of the reference's: its dp rows of the batch, its cp positions of the
sequence (head-tail order under load balancing), its tp slice of a dimension that tp splits. The first
module, in execution order (forward outputs, then gradients in backward order), whose relative error is
beyond the tolerance is named, with the mesh dims active. Pipeline layouts are not localised (their stages
run micro-batches on different ranks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ndparallel.errors import ConfigError
from ndparallel.verify.layouts import Layout
from ndparallel.verify.model import ModelSpec, vocab_size
from ndparallel.verify.run import Settings, build_runner, full_arrays, make_batches

__all__ = ["first_divergence", "first_nondeterministic", "localize"]


@dataclass
class Recording:
    outputs: list[tuple[str, np.ndarray]]  # (module FQN, its output), execution order
    grads: dict[str, np.ndarray]  # full parameter gradients
    order: list[str]  # parameter FQNs in backward order
    coordinate: dict[str, int]


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value:
        return _first_tensor(value[0])
    logits = getattr(value, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else None


@contextlib.contextmanager
def _hooks(model: nn.Module, outputs: list[tuple[str, np.ndarray]]) -> Iterator[None]:
    """Every module's forward output appended to ``outputs`` as float64 numpy (DTensors gathered)."""

    def hook(name: str):
        def record(module, args, output):
            tensor = _first_tensor(output)
            if tensor is not None and tensor.is_floating_point():
                outputs.append((name, full_arrays([(name, tensor)])[name]))

        return record

    handles = [m.register_forward_hook(hook(n or "(model)")) for n, m in model.named_modules()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _backward_order(outputs: list[tuple[str, np.ndarray]], params: list[str]) -> list[str]:
    """Parameters ordered as backward reaches them: the reverse of their modules' first forward."""
    first = {}
    for index, (name, _) in enumerate(outputs):
        first.setdefault(name, index)

    def owner(param: str) -> int:
        parts = param.split(".")[:-1]
        while parts and ".".join(parts) not in first:
            parts.pop()
        return first.get(".".join(parts) or "(model)", -1)

    return sorted(params, key=owner, reverse=True)


def _record(spec: ModelSpec, layout: Layout | None, settings: Settings) -> Recording:
    """One forward/backward of step 1's batch (this rank's piece of it) with every module hooked."""
    model = spec.build()
    if layout is not None and layout.size("pp") > 1:
        raise ConfigError(f"--localize does not follow pipeline stages yet ({layout.name}); localize without pp")
    runner = build_runner(spec, model, layout, settings)  # the same model on the same mesh as training
    torch.manual_seed(settings.runtime_seed)
    tokens, labels = make_batches(settings, vocab_size(model))[0]
    rows = settings.batch // runner.dp_size
    part = slice(runner.dp_rank * rows, (runner.dp_rank + 1) * rows)
    outputs: list[tuple[str, np.ndarray]] = []
    with _hooks(runner.module, outputs):
        runner.step(tokens[part], labels[part])
    named = runner.named_parameters()
    grads = full_arrays([(n, p.grad) for n, p in named])
    coordinate = {dim: runner.mesh.local_rank(dim) for dim in ("dp", "cp", "tp")} if runner.mesh else {}
    return Recording(outputs, grads, _backward_order(outputs, list(grads)), coordinate)


def _record_ranks(spec: ModelSpec, layout: Layout, settings: Settings) -> Recording:
    return _record(spec, layout, settings)


def _piece(ref: np.ndarray, shape: tuple[int, ...], layout: Layout, coord: dict[str, int], settings: Settings):
    """The part of the reference tensor ``ref`` that a rank at ``coord`` holds as a tensor of ``shape``, or
    None when the shapes do not map (then the output is not compared)."""
    from ndparallel.parallel.context_parallel import sequence_indices

    if len(shape) != ref.ndim:
        return None
    dp, cp, tp = layout.size("dp_replicate") * layout.size("dp_shard"), layout.size("cp"), layout.size("tp")
    piece = ref
    for dim, (want, have) in enumerate(zip(shape, ref.shape, strict=True)):
        if want == have:
            continue
        if dim == 0 and have == settings.batch and want * dp == have:
            rows = have // dp
            index = np.arange(coord["dp"] * rows, (coord["dp"] + 1) * rows)
        elif have == settings.seq and want * cp == have:
            index = sequence_indices(have, cp, coord["cp"], True).numpy()
        elif want * tp == have:
            index = np.arange(coord["tp"] * want, (coord["tp"] + 1) * want)
        else:
            return None
        piece = np.take(piece, index, axis=dim)
    return piece


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
    return float(np.abs(got - want).max(initial=0.0)) / scale


def first_divergence(
    ranks: list[Recording], ref: Recording, layout: Layout, settings: Settings, tol: float
) -> dict[str, Any]:
    """The first module (forward output, then parameter gradient) beyond ``tol`` relative, over the ranks."""
    dims = ", ".join(layout.name.split(","))
    compared = skipped = 0
    ref_outputs: dict[str, list[np.ndarray]] = {}
    for name, array in ref.outputs:
        ref_outputs.setdefault(name, []).append(array)
    seen: dict[str, int] = {}
    for index, (name, _) in enumerate(ranks[0].outputs):
        call = seen[name] = seen.get(name, -1) + 1
        refs = ref_outputs.get(name, [])
        if call >= len(refs):
            skipped += 1
            continue
        for rank, recording in enumerate(ranks):
            got = recording.outputs[index][1]
            want = _piece(refs[call], got.shape, layout, recording.coordinate, settings)
            if want is None:
                skipped += 1
                break
            compared += 1
            error = _relative(got, want)
            if not error <= tol:
                return _found(name, "forward output", error, dims, rank, compared, skipped)
    for param in ref.order:
        got = ranks[0].grads.get(param)
        if got is None or got.shape != ref.grads[param].shape:
            return _found(param, "gradient (missing or of another shape)", float("inf"), dims, 0, compared, skipped)
        compared += 1
        error = _relative(got, ref.grads[param])
        if not error <= tol:
            return _found(param, "gradient", error, dims, 0, compared, skipped)
    summary = f"no module beyond {tol:.0e} in one step ({compared} tensors compared, {skipped} not comparable)"
    return {"module": None, "compared": compared, "skipped": skipped, "summary": summary}


def _found(module: str, tensor: str, error: float, dims: str, rank: int, compared: int, skipped: int) -> dict:
    summary = f"{module}: {tensor} off by {error:.1e} relative (rank {rank}; mesh dims active: {dims})"
    return {
        "module": module,
        "tensor": tensor,
        "relative_error": error,
        "mesh_dims": dims,
        "rank": rank,
        "compared": compared,
        "skipped": skipped,
        "summary": summary,
    }


def localize(spec: ModelSpec, layout: Layout, settings: Settings, tol: float) -> dict[str, Any]:
    """Re-run step 1 of ``layout`` with every module hooked; the first divergence from one process."""
    from ndparallel.distributed.spawn import run_distributed

    one = Settings(**{**settings.__dict__, "steps": 1})
    ref = _record(spec, None, one)
    ranks = run_distributed(_record_ranks, layout.ranks, spec, layout, one, timeout=settings.timeout)
    return first_divergence(ranks, ref, layout, one, tol)


def first_nondeterministic(spec: ModelSpec, settings: Settings) -> str | None:
    """The first module whose output changes between two forwards of the same input and weights under two
    RNG states (dropout left on), or None."""
    model = spec.build()
    tokens, _ = make_batches(Settings(**{**settings.__dict__, "steps": 1}), vocab_size(model))[0]
    positions = torch.arange(tokens.shape[1])
    runs = []
    for seed in (settings.runtime_seed, settings.runtime_seed + 1):
        torch.manual_seed(seed)
        outputs: list[tuple[str, np.ndarray]] = []
        with torch.no_grad(), _hooks(model, outputs):
            spec.logits(model, tokens, positions)
        runs.append(outputs)
    for (name, a), (_, b) in zip(*runs, strict=False):
        if a.shape != b.shape or not np.array_equal(a, b):
            return name
    return None
