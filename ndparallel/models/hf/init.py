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

from collections.abc import Callable

import torch
from torch import nn

from ndparallel.models.seed import name_seed

__all__ = ["init_buffers", "seeded_init"]


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
    init_module = init_module or model._init_weights
    cuda = sorted({t.device.index or 0 for t in [*model.parameters(), *model.buffers()] if t.device.type == "cuda"})
    for fqn, module in model.named_modules():
        if not _owns_tensors(module):
            continue
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(name_seed(seed, fqn))
            init_module(module)


@torch.no_grad()
def init_buffers(
    model: nn.Module, init_module: Callable[[nn.Module], None] | None = None, redraw_params: bool = False
) -> None:
    """Recompute the buffers of modules that hold buffers and no parameters (rotary ``inv_freq``, which
    ``to_empty`` leaves uninitialised) with HF's ``init_module`` (default ``model._init_weights``).
    ``redraw_params``: also every module with a non-persistent buffer beside its parameters (Gemma's
    ``embed_scale``), whose parameters the init redraws: plain tensors a checkpoint read overwrites."""
    init_module = init_module or model._init_weights
    for module in model.modules():
        has_buffers = next(module.buffers(recurse=False), None) is not None
        no_params = next(module.parameters(recurse=False), None) is None
        if (has_buffers and no_params) or (redraw_params and module._non_persistent_buffers_set):
            init_module(module)  # HF's per-module init recomputes the rotary frequencies from the config
