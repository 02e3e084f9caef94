"""Tensor-parallel styles the Hugging Face plan needs beyond torch's: gather the sequence, tie lm_head.

:class:`GatherSequence` is the all-gather before attention / MLP under sequence parallel, however the
decoder layer calls the module (positionally or ``hidden_states=``). :class:`TiedColwiseParallel` shards
``lm_head`` like ``ColwiseParallel`` and then hands it the embedding's DTensor weight back, so tied word
embeddings stay one parameter.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from ndparallel.errors import ConfigError

__all__ = ["GatherSequence", "TiedColwiseParallel"]


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
    DTensor parameter (RowwiseParallel on an embedding shards its weight on dim 0 too)."""

    def __init__(self, embedding: nn.Module, **kwargs: Any):
        super().__init__(**kwargs)
        self.embedding = embedding

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        shared = self.embedding.weight
        if not isinstance(shared, DTensor) or shared.placements != module.weight.placements:
            raise ConfigError(
                "tied lm_head/embedding: the embedding must be sharded on the vocabulary (RowwiseParallel) "
                "before lm_head in the plan; or untie them (config.tie_word_embeddings=False)"
            )
        module.weight = shared
        return module
