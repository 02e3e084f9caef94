"""Shared helpers for parity tests: one training function that runs on any mesh or in one process.

``train_steps(parallel, steps, ...)`` builds the tiny reference Transformer from a seed,
parallelises it with ``parallel`` (a dict of ParallelismConfig fields; ``None`` = plain
single-process model, no process group), trains ``steps`` AdamW steps on deterministic
random batches and returns what a parity test compares::

    ref = train_steps(None, 5)                                   # in the pytest process
    out = run_distributed(train_steps, 4, {"dp_shard_size": 2, "tp_size": 2}, 5)
    assert_parity(out[0], ref)

Data: every step has one global batch of ``global_batch`` sequences; the rank with
``mesh.coordinate["dp"] == d`` takes slice ``d`` of it, so ranks of one tp/cp group see the
same tokens. ``loss_fn(model, tokens, labels, mesh)`` replaces the forward + loss (context
parallel passes one that shards the sequence); the reported loss is averaged over
``mesh["dp_cp"]``, i.e. it is the global-batch loss on every rank.

Precision: ``dtype="float64"`` (parameters, activations, gradients, reductions and the reference all
in float64) is the exactness proof, held to ``FLOAT64_TOL`` (1e-10; measured ~1e-15). ``float32``
is a smoke check held to ``FP32_TOL``, a bound measured on several CPU capabilities: fp32 round-off
(~1e-7) that AdamW turns into lr-sized updates of near-zero gradient entries, not a correctness bound.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import math
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from ndparallel.distributed.buckets import local_tensor
from ndparallel.distributed.reduce import average_over
from ndparallel.models import Transformer, TransformerConfig
from ndparallel.parallel.clip import clip_grad_norm_, total_grad_norm
from ndparallel.parallel.loss import cross_entropy_loss

__all__ = [
    "FLOAT64_TOL",
    "FP32_TOL",
    "ShardwiseAdamW",
    "adamw",
    "assert_parity",
    "build_model",
    "context_parallel_loss_fn",
    "default_loss_fn",
    "full_grads",
    "local_bytes",
    "make_batches",
    "train_steps",
]

NO_CLIP = 1e9  # max_norm that never clips, so the norm is still measured

# float64: the proof. Every shape agrees with one process to ~1e-15 (docs/parallelize.md, "Numerical
# guarantees"); 1e-10 leaves room for the AdamW steps' amplification and still catches any fp32 step
# (a single fp32 rounding in a reduction shows as ~1e-8).
FLOAT64_TOL = dict(loss_tol=1e-10, norm_rtol=1e-10, grad_tol=1e-10)
# fp32: a smoke check. Measured max over the smoke shapes (tests/parallel/test_fp32_smoke.py), ATEN_CPU_CAPABILITY
# default and avx2 (AMD EPYC), and the AVX-512 Xeon figures of issue 10; see docs/parallelize.md.
FP32_TOL = dict(loss_tol=1e-4, norm_rtol=1e-4, grad_tol=1e-6)
TOLERANCES = {"float64": FLOAT64_TOL, "float32": FP32_TOL}


def build_model(model: dict[str, Any] | None = None, seed: int = 0, dtype: str = "float32") -> Transformer:
    """The reference Transformer (``tiny`` preset unless ``model`` says otherwise), weights from ``seed``,
    parameters in ``dtype``."""
    fields = {"preset": "tiny", "dtype": dtype, **(model or {}), "seed": seed}
    return Transformer(TransformerConfig.from_dict(fields))


def make_batches(
    steps: int, global_batch: int, seq_len: int, vocab_size: int, seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of ``(tokens, labels)``, each ``[global_batch, seq_len]``; labels are next tokens."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        data = torch.randint(0, vocab_size, (global_batch, seq_len + 1), generator=generator)
        batches.append((data[:, :-1].contiguous(), data[:, 1:].contiguous()))
    return batches


def default_loss_fn(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor, mesh: Any) -> torch.Tensor:
    return cross_entropy_loss(model(tokens), labels)


def context_parallel_loss_fn(
    model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor, mesh: Any
) -> torch.Tensor:
    """Forward + loss on this rank's sequence shard (cp ranks split the sequence; positions follow)."""
    from ndparallel.parallel.context_parallel import context_parallel, make_positions

    tokens, labels = tokens.clone(), labels.clone()
    positions = make_positions(tokens)
    buffers = [tokens, labels, positions]
    # no_restore: backward runs after the block and the embedding saved the sharded token tensor.
    with context_parallel(mesh, buffers, seq_dims=[1, 1, 0], no_restore=buffers):
        return cross_entropy_loss(model(tokens, positions), labels)


def full_grads(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Every parameter's full gradient by FQN, as numpy arrays in fp32 or wider (float64 stays float64;
    tensors do not survive the trip back from a rank process through ``run_distributed``'s queue).
    A collective under DTensor."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        full = grad.full_tensor() if isinstance(grad, DTensor) else grad
        grads[name] = full.detach().to(torch.promote_types(full.dtype, torch.float32)).cpu().numpy().copy()
    return grads


def full_params(named) -> dict[str, np.ndarray]:
    """Full values of ``named`` parameters (name, param) as numpy arrays in fp32 or wider (a collective under
    DTensor)."""
    out = {}
    for name, param in named:
        full = param.full_tensor() if isinstance(param, DTensor) else param
        out[name] = full.detach().to(torch.promote_types(full.dtype, torch.float32)).cpu().numpy().copy()
    return out


class ShardwiseAdamW:
    """torch's AdamW stepping each parameter's local shard (``to_local()``: the same storage), for the parity runs.

    AdamW is elementwise, so this is the update torch's AdamW makes on the DTensor parameters themselves: a gradient
    held with other placements than its parameter (a replicated parameter's Partial gradient, in test_moe_parity's
    layouts) is first redistributed to the parameter's, as DTensor does inside each of AdamW's ops. What it leaves
    out is DTensor's sharding propagation, which on each layout's first step takes most of a parity rank's CPU
    (docs/architecture.md, "Tests"). The training loop, Accelerator, Trainer and TRL tests step AdamW on the DTensor
    parameters themselves.
    """

    def __init__(self, params, **options: Any):
        self.params = list(params)
        self.options = options
        self.inner: torch.optim.AdamW | None = None  # built at the first step, once FSDP has laid out its shards
        self.shards: list[torch.Tensor] = []

    @property
    def state(self) -> dict:
        return self.inner.state if self.inner is not None else {}

    def step(self) -> None:
        with torch.no_grad():
            if self.inner is None:
                self.shards = [local_tensor(p).detach() for p in self.params]
                self.inner = torch.optim.AdamW(self.shards, **self.options)
            for param, shard in zip(self.params, self.shards, strict=True):
                if local_tensor(param).data_ptr() != shard.data_ptr():
                    raise RuntimeError("a parameter's local shard moved after the first step: re-create the optimizer")
                grad = param.grad
                if isinstance(grad, DTensor) and grad.placements != param.placements:
                    grad = grad.redistribute(param.device_mesh, param.placements)
                shard.grad = None if grad is None else local_tensor(grad).detach()
            self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none:
            raise ValueError("ShardwiseAdamW sets gradients to None")
        for tensor in (*self.params, *self.shards):
            tensor.grad = None


def adamw(params, **options: Any) -> torch.optim.AdamW | ShardwiseAdamW:
    """The parity runs' AdamW: torch's on plain parameters (the one-process reference), :class:`ShardwiseAdamW` on
    DTensor ones."""
    params = list(params)
    if any(isinstance(p, DTensor) for p in params):
        return ShardwiseAdamW(params, **options)
    return torch.optim.AdamW(params, **options)


def record_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, result: dict, step: int) -> None:
    """After a backward: keep step 1's gradients and the grad norm (not clipped), then step and zero."""
    if step == 0:
        result["grads"] = full_grads(model)
    result["grad_norms"].append(clip_grad_norm_(model.parameters(), NO_CLIP).item())
    optimizer.step()
    optimizer.zero_grad()


def local_bytes(tensors) -> int:
    """Bytes this rank holds for ``tensors`` (a DTensor counts its local shard)."""
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if isinstance(t, DTensor) else t
            total += local.numel() * local.element_size()
    return total


def _memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.ndim > 0]
    return {
        "param_bytes": local_bytes(params),
        "grad_bytes": local_bytes(p.grad for p in params),
        "optim_bytes": local_bytes(states),
    }


def train_steps(
    parallel: dict[str, Any] | None,
    steps: int = 5,
    *,
    model: dict[str, Any] | None = None,
    seed: int = 0,
    data_seed: int = 1,
    global_batch: int = 8,
    seq_len: int = 32,
    lr: float = 1e-3,
    max_norm: float | None = None,
    grad_accum: int = 1,
    loss_fn: Callable[..., torch.Tensor] = default_loss_fn,
    parallelize_kwargs: dict[str, Any] | None = None,
    dtype: str = "float32",
    final_params: bool = False,
    batch_order: list[int] | None = None,
    router_bias_rate: float = 0.0,
) -> dict[str, Any]:
    """Train and report ``losses``, ``grad_norms`` (pre-clip, every step), ``grads`` (full, after step 1's
    backward), ``memory`` (this rank's bytes of params/grads/optimizer state after the last step),
    ``coordinate``, ``dtypes`` (parameter dtype by FQN), ``all_dtensor`` and, when ``max_norm`` is
    given, ``clipped_norms`` (the norm after clipping).

    ``parallel=None`` runs the plain model in this process with no process group (the reference).
    ``max_norm=None`` measures the norm without clipping. ``grad_accum`` splits each rank's slice
    into that many micro-batches (gradients synchronised only on the last one). ``dtype``: the
    parameters' dtype (``float64`` for the exactness tables); ``result["dtype"]`` echoes it. ``final_params``:
    also ``params``, every full parameter by FQN after the last step (a collective under DTensor). ``batch_order``:
    the global batch's sequences in this order (a one-process reference whose micro-batches are the dp ranks'
    micro-batches put together, for a per-micro-batch statistic such as an MoE router's token fractions).
    ``router_bias_rate``: after each optimizer step, ``update_router_biases(model, rate)`` (an MoE model's
    sigmoid routers); ``result["router_loads"]`` holds each step's tokens per expert by router, and with
    ``final_params`` ``result["biases"]`` every ``expert_bias`` buffer by FQN.
    """
    from ndparallel.models.transformer.moe import router_loads, update_router_biases

    torch.manual_seed(seed)
    net = build_model(model, seed, dtype)
    mesh = None
    dp_size, dp_rank = 1, 0
    if parallel is not None:
        import ndparallel as ndp
        from ndparallel.parallel.parallelize import parallelize

        mesh = ndp.init_distributed(ndp.ParallelismConfig.from_dict(parallel))
        net = parallelize(net, mesh.config, mesh, **(parallelize_kwargs or {}))
        dp_size, dp_rank = mesh.size("dp"), mesh.local_rank("dp")
    if global_batch % (dp_size * grad_accum):
        raise ValueError(f"global_batch={global_batch} must divide by dp size {dp_size} x grad_accum {grad_accum}")
    optimizer = adamw(net.parameters(), lr=lr, weight_decay=0.1)
    batches = make_batches(steps, global_batch, seq_len, net.config.vocab_size, data_seed)
    per_rank = global_batch // dp_size
    micro = per_rank // grad_accum
    result: dict[str, Any] = {"losses": [], "grad_norms": [], "dtype": dtype}
    for step, (tokens, labels) in enumerate(batches):
        if batch_order is not None:
            tokens, labels = tokens[batch_order], labels[batch_order]
        tokens = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        labels = labels[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        step_loss = 0.0
        for m in range(grad_accum):
            last = m == grad_accum - 1
            with contextlib.nullcontext() if last else _no_sync(net, mesh):
                part = slice(m * micro, (m + 1) * micro)
                loss = loss_fn(net, tokens[part], labels[part], mesh) / grad_accum
                loss.backward()
            step_loss += loss.detach()
        result["losses"].append(average_over(mesh["dp_cp"] if mesh else None, step_loss))
        if step == 0:
            result["grads"] = full_grads(net)
        norm = clip_grad_norm_(net.parameters(), NO_CLIP if max_norm is None else max_norm)
        result["grad_norms"].append(norm.item())
        if max_norm is not None:  # what clipping left: min(norm, max_norm) when it works on every mesh
            result.setdefault("clipped_norms", []).append(total_grad_norm(net.parameters()).item())
        optimizer.step()
        result.setdefault("router_loads", []).append([load.numpy() for load in router_loads(net)])
        update_router_biases(net, router_bias_rate)
        if step == steps - 1:
            result["memory"] = _memory(net, optimizer)
        optimizer.zero_grad()
    if final_params:
        result["params"] = {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().numpy().copy()
            for name, p in net.named_parameters()
        }
        result["biases"] = {n: b.cpu().numpy().copy() for n, b in net.named_buffers() if n.endswith("expert_bias")}
    result["layouts"] = {  # how each parameter is held: mesh dims, placements, local shape
        name: (p.device_mesh.mesh_dim_names, tuple(map(str, p.placements)), tuple(p.to_local().shape))
        if isinstance(p, DTensor)
        else ((), (), tuple(p.shape))
        for name, p in net.named_parameters()
    }
    result["coordinate"] = mesh.coordinate if mesh else {}
    result["dtypes"] = {n: str(p.dtype) for n, p in net.named_parameters()}
    result["all_dtensor"] = all(isinstance(p, DTensor) for p in net.parameters())
    return result


def _no_sync(model: torch.nn.Module, mesh: Any):
    """Skip gradient communication on a non-final micro-batch (FSDP, HSDP or replicate)."""
    if mesh is None:
        return contextlib.nullcontext()
    from ndparallel.parallel.grad_sync import no_sync

    return no_sync(model)


def parity_error(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    """The measured differences: max |dloss|, max relative grad-norm difference, max |step-1 gradient diff|."""
    return {
        "dloss": max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True)),
        "dnorm": max(abs(a - b) / abs(b) for a, b in zip(got["grad_norms"], ref["grad_norms"], strict=True)),
        "dgrad": max(float(np.abs(got["grads"][k] - v).max()) for k, v in ref["grads"].items()),
    }


def assert_parity(
    got: dict[str, Any],
    ref: dict[str, Any],
    loss_tol: float | None = None,
    norm_rtol: float | None = None,
    grad_tol: float | None = None,
    label: str = "",
    max_norm: float | None = None,
) -> None:
    """Losses within ``loss_tol`` (absolute) at every step, grad norms within ``norm_rtol`` (relative) and
    step-1 full gradients within ``grad_tol`` (max abs difference, per parameter); with ``max_norm``,
    the norm after clipping is ``norm * min(1, max_norm / (norm + 1e-6))`` at every step.

    Tolerances default to ``TOLERANCES[got["dtype"]]`` (float64: 1e-10; fp32: the measured smoke bound);
    ``got`` and ``ref`` must have been trained in the same dtype.
    """
    dtype = got.get("dtype", "float32")
    assert dtype == ref.get("dtype", "float32"), f"{label}: {dtype} run compared with a {ref.get('dtype')} reference"
    default = TOLERANCES[dtype]
    loss_tol = default["loss_tol"] if loss_tol is None else loss_tol
    norm_rtol = default["norm_rtol"] if norm_rtol is None else norm_rtol
    grad_tol = default["grad_tol"] if grad_tol is None else grad_tol
    assert len(got["losses"]) == len(ref["losses"]), label
    dloss = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True))
    assert dloss <= loss_tol, f"{label}: max |dloss| = {dloss:.3g} > {loss_tol}: {got['losses']} vs {ref['losses']}"
    for a, b in zip(got["grad_norms"], ref["grad_norms"], strict=True):
        assert math.isclose(a, b, rel_tol=norm_rtol, abs_tol=norm_rtol * 1e-2), f"{label}: grad norm {a} vs {b}"
    for a, b in zip(got.get("clipped_norms", []), got["grad_norms"], strict=False):
        expected = b * min(1.0, max_norm / (b + 1e-6))  # torch's clip coefficient (its 1e-6 guards a zero norm)
        assert math.isclose(a, expected, rel_tol=norm_rtol), f"{label}: norm {a} after clipping {b} to {max_norm}"
    assert got["grads"].keys() == ref["grads"].keys(), f"{label}: parameter names differ"
    for name, grad in ref["grads"].items():
        assert got["grads"][name].dtype == grad.dtype, f"{label}: {name} gradient dtype differs"
        diff = float(np.abs(got["grads"][name] - grad).max())
        assert diff <= grad_tol, f"{label}: step-1 gradient of {name} differs by {diff:.3g}"


# ------------------------------------------------------------------------------ packed multi-rank runs
Run = tuple[dict[str, Any] | None, dict[str, Any]]  # (parallel config fields, train_steps keyword arguments)


def run_many(runs: list[Run]) -> list[dict[str, Any]]:
    """On every rank: ``train_steps`` for each ``(parallel, kwargs)`` in turn, sharing one process group."""
    return [train_steps(parallel, **kwargs) for parallel, kwargs in runs]


_CACHE: dict[tuple[int, str], list[list[dict[str, Any]]]] = {}
SHARED_CACHE_DIR: Path | None = None
"""Set by tests/conftest.py under pytest-xdist: a folder every worker of this run sees, so that a group two test
files share (test_parallelize's and test_memory's, on different workers) is spawned once, not once per worker."""


def _runs_key(world_size: int, runs: list[Run]) -> str:
    """The same text in every process for the same runs (functions by name, not by address)."""

    def named(o: Any) -> str:
        if not callable(o) or not hasattr(o, "__qualname__"):
            return repr(o)  # a partial's repr holds an address: such runs are computed per process
        line = getattr(getattr(o, "__code__", None), "co_firstlineno", "")  # two lambdas of one module differ
        return f"{o.__module__}.{o.__qualname__}:{line}"

    return json.dumps([world_size, runs], default=named, sort_keys=True)


def run_cached(world_size: int, runs: list[Run], timeout: float = 600.0) -> list[list[dict[str, Any]]]:
    """``run_distributed(run_many, world_size, runs)`` once per pytest run: ``[rank][run] -> result``.

    Parity and memory tests share the same spawned runs through this cache: in this process, and under xdist
    through pickles in ``SHARED_CACHE_DIR`` (the first worker to ask spawns, the others wait on its lock).
    """
    from ndparallel.testing import run_distributed

    key = (world_size, _runs_key(world_size, runs))
    if key in _CACHE:
        return _CACHE[key]
    if SHARED_CACHE_DIR is None:
        _CACHE[key] = run_distributed(run_many, world_size, runs, timeout=timeout)
        return _CACHE[key]
    SHARED_CACHE_DIR.mkdir(parents=True, exist_ok=True)
    stem = SHARED_CACHE_DIR / hashlib.sha256(key[1].encode()).hexdigest()[:24]
    with open(stem.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this worker dies
        done = stem.with_suffix(".pkl")
        if done.exists():
            _CACHE[key] = pickle.loads(done.read_bytes())
        else:
            _CACHE[key] = run_distributed(run_many, world_size, runs, timeout=timeout)
            partial = stem.with_suffix(".tmp")
            partial.write_bytes(pickle.dumps(_CACHE[key]))
            partial.replace(done)
    return _CACHE[key]


@functools.cache
def reference(**kwargs: Any) -> dict[str, Any]:
    """Single-process ``train_steps(None, **kwargs)``, computed once per pytest process."""
    return train_steps(None, **kwargs)
