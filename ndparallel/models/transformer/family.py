"""The reference Transformer as a model family: everything ``parallelize`` needs to know about it.

This module is the worked example of docs/parallelize.md#model-families: a family is one
:class:`~ndparallel.parallel.family.ModelFamily` in the model's own folder. It sits on the planners' floor (it uses
torch's ParallelStyle classes and ndparallel's planners), so ``ndparallel.models`` does not import it and
:mod:`ndparallel.models.transformer.model` never imports a planner. It is also the default family: a model that
no registered family claims gets these answers (they fit Llama-shaped models named like ours).

The TP + SP table (``*`` matches inside one path atom: :mod:`ndparallel.parallel.fqn`)::

    tok_embeddings              RowwiseParallel, output Shard(1)       (vocab split; output sequence-sharded)
    layers.*.attention_norm     SequenceParallel                        (norm runs on seq/tp tokens)
    layers.*.attention          PrepareModuleInput Shard(1) -> Replicate (all-gather the sequence)
    layers.*.attention.wq/wk/wv ColwiseParallel                         (heads split)
    layers.*.attention.wo       RowwiseParallel, output Shard(1)        (reduce-scatter back to seq shards)
    layers.*.ffn_norm           SequenceParallel
    layers.*.feed_forward       PrepareModuleInput Shard(1) -> Replicate
    layers.*.feed_forward.w1/w3 ColwiseParallel
    layers.*.feed_forward.w2    RowwiseParallel, output Shard(1)
    norm                        SequenceParallel
    output                      ColwiseParallel, input Shard(1), output Shard(-1) as a DTensor (loss parallel)

In a mixture of experts the ``feed_forward`` rows give way to :data:`MOE_TENSOR_PARALLEL`: the block gathers its
tokens, runs the router whole, splits every expert's (and the shared experts') hidden width over tp and
reduce-scatters its output (:mod:`ndparallel.parallel.moe_tensor_parallel`).

Blocks are ``layers`` (the first ``nn.ModuleList``); FSDP units besides them are ``[tok_embeddings]`` and
``[norm, output]``; under cp, ``CoreAttention`` (the one attention seam) becomes ring attention and the
``positions`` argument of ``forward`` gets each rank's global positions. For the training step: the routers'
counts, non-finite flags and balancing biases (:mod:`ndparallel.models.transformer.moe`), and ``loss_in_forward``
(the model's own flag, set by :meth:`TransformerFamily.compile_loss_head`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from ndparallel.errors import ConfigError
from ndparallel.models.transformer.model import CoreAttention, Transformer
from ndparallel.models.transformer.moe import MoE, nonfinite_routers, router_loads, update_router_biases
from ndparallel.models.transformer.presets import FAMILY_NAME, TP_SPLIT_FIELDS
from ndparallel.models.transformer.stage import TransformerStage
from ndparallel.parallel.family import ModelFamily
from ndparallel.parallel.fully_shard import default_shard_groups
from ndparallel.parallel.moe_tensor_parallel import MoETensorParallel

__all__ = ["FAMILY", "MOE_TENSOR_PARALLEL", "TransformerFamily", "transformer_tp_plan"]


MOE_TENSOR_PARALLEL = MoETensorParallel(
    expert_hidden_dims={"w1": 1, "w3": 1, "w2": 2},  # [E, F, D], [E, F, D], [E, D, F]: F is the hidden width
    replicated=("router.gate",),
    colwise=("shared_experts.w1", "shared_experts.w3"),
    rowwise=("shared_experts.w2",),
)
"""How tp splits the reference :class:`~ndparallel.models.transformer.moe.MoE` (paths inside it)."""


def transformer_tp_plan(moe: bool = False) -> dict[str, ParallelStyle]:
    """The TP + SP plan for :class:`ndparallel.models.Transformer` (and Llama-shaped models named alike); ``moe``:
    without the dense feed-forward rows (the MoE block is split by :data:`MOE_TENSOR_PARALLEL`)."""
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
        ),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
        ),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    if moe:
        plan = {pattern: style for pattern, style in plan.items() if not pattern.startswith("layers.*.feed_forward")}
    return plan


# Model config fields that tensor parallelism splits, in our names and in Hugging Face's.


class TransformerFamily(ModelFamily):
    """:class:`ndparallel.models.Transformer`, and the default for models no other family claims."""

    name = FAMILY_NAME
    split_fields = TP_SPLIT_FIELDS
    heads_field = "n_heads"
    cp_attention = (CoreAttention,)
    moe_modules = (MoE,)
    positions_arg = "positions"

    def matches(self, model: nn.Module) -> bool:
        return isinstance(model, Transformer)

    def tp_plan(self, model: nn.Module) -> dict[str, ParallelStyle]:
        return transformer_tp_plan(moe=bool(self.moe_layers(model)))

    def moe_tensor_parallel(self, model: nn.Module) -> MoETensorParallel:
        return MOE_TENSOR_PARALLEL

    def fsdp_groups(self, model: nn.Module) -> list[list[str]]:
        """``[[tok_embeddings], [norm, output]]``, each where the model has it (FSDP's default units)."""
        return default_shard_groups(model)

    def compile_loss_head(self, model: nn.Module) -> None:
        """A :class:`Transformer`'s :class:`~ndparallel.models.transformer.model.OutputProjection` compiles its
        projection + cross entropy; a pipeline stage's head stays eager (the schedule takes its logits)."""
        if isinstance(model, Transformer):
            model.output.compile_loss()

    def pipeline_stage(self, model: nn.Module, block_ids: Sequence[int], first: bool, last: bool) -> nn.Module:
        """A :class:`~ndparallel.models.transformer.stage.TransformerStage` (only of a :class:`Transformer`)."""
        if not isinstance(model, Transformer):
            raise ConfigError(
                f"pp_size > 1 cannot find the blocks of {type(model).__name__}: pipeline stages are built for "
                "ndparallel.models.Transformer and the Hugging Face families; register a ModelFamily with "
                "pipeline_stage for another model, or use pp_size=1"
            )
        return TransformerStage(model, block_ids, first, last)

    # What the training step asks after each step (ndparallel/models/transformer/moe.py): every Router under
    # ``model``, a Transformer, one of its pipeline stages or any model whose routers are the reference Router.

    def router_loads(self, model: nn.Module) -> list[torch.Tensor]:
        return router_loads(model)

    def nonfinite_routers(self, model: nn.Module) -> list[str]:
        return nonfinite_routers(model)

    def update_router_biases(self, model: nn.Module, rate: float) -> None:
        update_router_biases(model, rate)


FAMILY = TransformerFamily()
