"""Random init of a Hugging Face model that any part of it reproduces: HF's rule, seeded per module name.

``transformers`` initialises a model by calling ``model._init_weights(module)`` on every module in order, all
drawing from the global RNG, so a pipeline stage that holds blocks 4-7 cannot know what the RNG state would
have been at block 4 without building blocks 0-3. :func:`seeded_init` keeps HF's rule (``_init_weights``:
the distributions, stds, ones for norms, zeros for biases, the rotary tables) and changes only where the
random numbers come from: each module draws from the RNG seeded by :func:`ndparallel.models.seed.name_seed`
(the reference Transformer's per-name rule, docs/pipeline-parallel.md#hugging-face-models). A module holding
part of the model under the unsplit names (a stage) then gets exactly the values the whole model gets, on
any pp size. The values differ from ``LlamaForCausalLM(config)``'s (same distributions, other draws).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ndparallel.distributed.buckets import local_tensor
from ndparallel.errors import ConfigError
from ndparallel.models.seed import name_seed

__all__ = ["init_buffers", "seeded_init", "seeded_init_module"]


def _owns_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


@torch.no_grad()
def seeded_init(model: nn.Module, seed: int = 0, init_module: Callable[[nn.Module], None] | None = None) -> None:
    """Initialise every module of ``model`` that holds tensors with HF's ``init_module`` (default
    ``model._init_weights``), the RNG seeded per ``(seed, module FQN)``; the caller's RNG state is restored.

    ``model``: a ``PreTrainedModel`` or a part of one under its names
    (:class:`ndparallel.models.hf.stage.HFCausalLMStage`
    passes its model's ``_init_weights``). Plain tensors only (call it before ``parallelize``).
    """
    sharded = next((name for name, p in model.named_parameters() if isinstance(p, DTensor)), None)
    if sharded is not None:  # HF's init draws each DTensor shard by DTensor's own RNG: not one process's values
        raise ConfigError(
            f"seeded_init on a parallelised model ({sharded} is a DTensor): its shards would not get one process's "
            "values; call seeded_init before ndparallel.parallelize"
        )
    init_module = init_module or model._init_weights
    cuda = sorted({t.device.index or 0 for t in [*model.parameters(), *model.buffers()] if t.device.type == "cuda"})
    for fqn, module in model.named_modules():
        if _owns_tensors(module):
            seeded_init_module(module, seed, fqn, init_module, cuda)


@torch.no_grad()
def seeded_init_module(
    module: nn.Module,
    seed: int,
    fqn: str,
    init_module: Callable[[nn.Module], None],
    cuda: list[int] | None = None,
) -> None:
    """``init_module(module)`` with the RNG seeded by ``(seed, fqn)`` (the caller's RNG state restored): what
    :func:`seeded_init` gives the module named ``fqn``. ``cuda``: the CUDA devices whose RNG to fork (default:
    those of the module's tensors)."""
    if cuda is None:
        cuda = sorted(
            {t.device.index or 0 for t in [*module.parameters(), *module.buffers()] if t.device.type == "cuda"}
        )
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(name_seed(seed, fqn))
        init_module(module)


@torch.no_grad()
def init_buffers(model: nn.Module, init_module: Callable[[nn.Module], None] | None = None) -> None:
    """Recompute every non-persistent buffer of ``model`` (rotary ``inv_freq``, Gemma's ``embed_scale``) with HF's
    per-module ``init_module`` (default ``model._init_weights``); parameters are left as they are.

    Why: a model built on the meta device and ``to_empty``'d holds uninitialised memory in every tensor, and a
    checkpoint never stores non-persistent buffers. transformers' own ``from_pretrained`` relies on the same rule
    (``_init_weights`` sets them). One rule for ``load_pretrained`` and a checkpoint's pipeline stages. A buffer
    the init leaves unset (it is filled with NaN, or the dtype's max, first) is refused by name: ConfigError.
    """
    init_module = init_module or model._init_weights
    unset = []
    for prefix, module in model.named_modules():
        names = sorted(n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None)
        if not names:
            continue
        for name in names:
            _fill_sentinel(module._buffers[name])
        with _parameters_kept(module):
            init_module(module)
        unset += [f"{prefix}.{n}" if prefix else n for n in names if _is_sentinel(module._buffers[n])]
    if unset:
        raise ConfigError(
            f"{type(model).__name__}: the non-persistent buffers {unset[:4]} are in no checkpoint and its "
            "_init_weights does not recompute them after a meta-device build; load the model with "
            "from_pretrained and pass it to ndparallel.parallelize"
        )


def _sentinel(tensor: torch.Tensor) -> float | int | None:
    if tensor.is_floating_point() or tensor.is_complex():
        return float("nan")
    if tensor.dtype == torch.bool:
        return None  # no value marks a bool as unset
    return torch.iinfo(tensor.dtype).max


def _fill_sentinel(tensor: torch.Tensor) -> None:
    value = _sentinel(tensor)
    if value is not None:
        local_tensor(tensor).fill_(value)
    if hasattr(tensor, "_is_hf_initialized"):  # transformers' init.* skips a tensor flagged initialised
        del tensor._is_hf_initialized


def _is_sentinel(tensor: torch.Tensor) -> bool:
    local, value = local_tensor(tensor), _sentinel(tensor)
    if value is None or not local.numel():
        return False
    return bool(torch.isnan(local).all()) if value != value else bool((local == value).all())


@contextlib.contextmanager
def _parameters_kept(module: nn.Module) -> Iterator[None]:
    """transformers' ``init.*`` functions skip a tensor flagged ``_is_hf_initialized``: flag ``module``'s own
    parameters for the call (a full redraw of a sharded embedding costs time and its values are discarded)."""
    params = [p for p in module.parameters(recurse=False) if not getattr(p, "_is_hf_initialized", False)]
    for param in params:
        param._is_hf_initialized = True
    try:
        yield
    finally:
        for param in params:
            del param._is_hf_initialized
