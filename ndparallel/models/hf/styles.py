"""Tensor-parallel styles the Hugging Face plan needs beyond torch's.

:class:`GatherSequence` is the all-gather before attention / MLP under sequence parallel, however the
decoder layer calls the module (positionally or ``hidden_states=``). :class:`TiedColwiseParallel` shards
``lm_head`` like ``ColwiseParallel`` and then hands it the embedding's DTensor weight back, so tied word
embeddings stay one parameter. :class:`ReplicatedCompute` runs a module on replicated inputs (a full-width
norm after gathered projections); :class:`PerShardNorm` is a norm over each rank's heads whose weight
gradient sums over the ranks (transformers' ``replicated_with_grad_allreduce``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from ndparallel.errors import ConfigError

__all__ = ["GatherSequence", "PerShardNorm", "ReplicatedCompute", "TiedColwiseParallel"]


class GatherSequence(ParallelStyle):
    """Input hidden states (first positional argument or ``hidden_states=``) from sequence shards to
    a Replicate DTensor: the all-gather before attention / MLP under sequence parallel (its backward
    reduce-scatters). Works however the parent calls the module, positionally or by keyword."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(x):
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
            return x.redistribute(device_mesh, (Replicate(),))

        def hook(_module, args, kwargs):
            if args:
                return (gather(args[0]), *args[1:]), kwargs
            if "hidden_states" not in kwargs:
                raise ConfigError(
                    f"{type(module).__name__} got no hidden states to gather (positional or hidden_states=)"
                )
            return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class TiedColwiseParallel(ColwiseParallel):
    """``lm_head`` sharing the embedding's weight: shard like ColwiseParallel, then reuse the embedding's
    DTensor parameter (RowwiseParallel on an embedding shards its weight on dim 0 too). Applied to another
    module than ``output`` (a pipeline stage's own copy of the head, whose embedding is on another stage) it is
    plain ColwiseParallel: the pipeline keeps the copies one weight (ndparallel/parallel/pipeline/tied.py)."""

    def __init__(self, embedding: nn.Module, output: nn.Module, **kwargs: Any):
        super().__init__(**kwargs)
        self.embedding, self.output = embedding, output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        if module is not self.output:
            return module  # a pipeline stage's own copy of the head (its embedding is another stage's): untied
        shared = self.embedding.weight
        if not isinstance(shared, DTensor) or shared.placements != module.weight.placements:
            raise ConfigError(
                "tied lm_head/embedding: the embedding must be sharded on the vocabulary (RowwiseParallel) "
                "before lm_head in the plan; or untie them (config.tie_word_embeddings=False)"
            )
        module.weight = shared
        return module


def _replicate_params(module: nn.Module, device_mesh: DeviceMesh) -> None:
    """The module's own parameters as Replicate DTensors (every rank built the same weights, as for
    torch's SequenceParallel, so no broadcast is needed)."""
    for name, param in list(module.named_parameters(recurse=False)):
        if not isinstance(param, DTensor):
            replicated = DTensor.from_local(param.detach(), device_mesh, (Replicate(),), run_check=False)
            module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))


def _to_local(output: Any) -> Any:
    if isinstance(output, DTensor):
        return output.to_local()
    if isinstance(output, tuple):
        return tuple(_to_local(o) for o in output)
    return output


class ReplicatedCompute(ParallelStyle):
    """A module every tp rank runs on the same (replicated) inputs: parameters Replicate DTensors, tensor
    inputs declared Replicate, outputs local. Its gradients are then the one-process gradients on every rank.
    For modules inside a sublayer whose projections gather their outputs (OLMo 2's full-width q_norm/k_norm
    after ``colwise_gather_output``), and ``replicate`` entries there."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _replicate_params(module, device_mesh)

        def replicate(x):
            if isinstance(x, DTensor):
                return x.redistribute(device_mesh, (Replicate(),))
            if isinstance(x, torch.Tensor):
                return DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False)
            return x

        def pre(_module, args, kwargs):
            return tuple(replicate(a) for a in args), {k: replicate(v) for k, v in kwargs.items()}

        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(lambda _m, _args, output: _to_local(output))
        return module


class PerShardNorm(ParallelStyle):
    """A norm over the last dim of a tensor each tp rank holds its own slice of (Qwen3 / Gemma 3's per-head
    ``q_norm`` / ``k_norm`` after colwise q/k projections): transformers' ``replicated_with_grad_allreduce``.
    The weight is a Replicate DTensor; the input is declared sharded on dim 0 (any dim but the normalised
    last one gives the same local arithmetic), so the weight's gradient is the Partial sum over the ranks'
    slices, as in one process. Output local."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _replicate_params(module, device_mesh)

        def pre(_module, args, kwargs):
            if args:
                x = args[0]
                return (DTensor.from_local(x, device_mesh, (Shard(0),), run_check=False), *args[1:]), kwargs
            name = next(iter(kwargs))
            x = DTensor.from_local(kwargs[name], device_mesh, (Shard(0),), run_check=False)
            return args, {**kwargs, name: x}

        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(lambda _m, _args, output: _to_local(output))
        return module
