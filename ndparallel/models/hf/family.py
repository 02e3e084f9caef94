"""Hugging Face causal LMs (any with a ``base_model_tp_plan``) as a model family: what ``parallelize`` asks of them.

The answers live beside this file: the TP + SP table and FSDP units in :mod:`ndparallel.models.hf.tp_plan` (its
entries translated in :mod:`ndparallel.models.hf.tp_translate`; lookups such as ``is_hf_model`` in
:mod:`ndparallel.models.hf.detect`), the attention seam, position handling and input checks in
:mod:`ndparallel.models.hf.attention` / :mod:`ndparallel.models.hf.inputs`, ``outputs.loss`` in
:mod:`ndparallel.models.hf.loss`. Models are recognised by ``config.model_type`` without importing ``transformers``.
Decoder layers are the first ``nn.ModuleList``. For the jobs: a prepared model's ``save_pretrained`` gathers its
shards, and the Trainer saves and checks ``model.safetensors`` folders through :mod:`ndparallel.models.hf.pretrained`;
routers keep no counts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.distributed.mesh import Mesh
from ndparallel.errors import ConfigError
from ndparallel.models.hf.attention import apply_hf_attention, check_attention, route_hf_attention
from ndparallel.models.hf.detect import FAMILY_NAME, is_hf_model
from ndparallel.models.hf.moe import adapt_experts, hf_moe_layers, install_global_router_loss
from ndparallel.models.hf.pretrained import save_pretrained as gather_and_save
from ndparallel.models.hf.pretrained import unreadable_weights
from ndparallel.models.hf.stage import HFCausalLMStage
from ndparallel.models.hf.tp_plan import hf_fsdp_groups, hf_tp_plan
from ndparallel.parallel.expert_parallel import apply_expert_parallel
from ndparallel.parallel.family import ModelFamily

__all__ = ["FAMILY", "HuggingFaceFamily", "hf_parallelize_kwargs"]


class HuggingFaceFamily(ModelFamily):
    """A ``transformers`` PreTrainedModel: its TP plan translated from its own ``base_model_tp_plan``."""

    name = FAMILY_NAME
    split_fields = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
    heads_field = "num_attention_heads"
    pipeline_cp = True  # stages route their attention through ring attention (tests/models/test_pipeline_hf.py)
    # tested under pp: ring cp, tp, FSDP (tests/models/test_pipeline_hf.py); not Ulysses / all-gather cp, AC, compile
    pipeline_untested = ("cp_rotate_method", "activation_checkpointing", "compile")
    label = "Hugging Face model"

    def matches(self, model: nn.Module) -> bool:
        return is_hf_model(model) or isinstance(model, HFCausalLMStage)

    def tp_plan(self, model: nn.Module) -> dict[str, ParallelStyle]:
        return hf_tp_plan(model)  # refuses, naming the module, what it cannot place

    def check(self, model: nn.Module, cfg: ParallelismConfig, mesh: Mesh) -> None:
        check_attention(model, cfg, mesh)  # an attention the seam cannot route, cp_backend, dynamic rope

    def fsdp_groups(self, model: nn.Module) -> list[list[str]]:
        return hf_fsdp_groups(model)

    def moe_layers(self, model: nn.Module) -> list[nn.Module]:
        return hf_moe_layers(model)  # every sparse MoE block of transformers 5 (ndparallel/models/hf/moe.py)

    def expert_count(self, layer: nn.Module) -> tuple[str, int]:
        return "num_experts", layer.experts.num_experts

    def apply_moe(self, model: nn.Module, moe_layers: Sequence[nn.Module], mesh: Mesh) -> None:
        """The router aux loss of the global batch (the model's own function on every rank's logits), and the
        experts over ep through the expert-parallel contract."""
        install_global_router_loss(model, mesh)
        if mesh.size("ep") > 1:
            for layer in moe_layers:
                adapt_experts(layer.experts)
        apply_expert_parallel(moe_layers, mesh)

    def apply_attention(self, model: nn.Module, mesh: Mesh, cfg: ParallelismConfig) -> nn.Module:
        if isinstance(model, HFCausalLMStage):  # the pipeline runtime shards tokens, labels, position_ids
            route_hf_attention(model, mesh, cfg)
            return model
        return apply_hf_attention(model, mesh, cfg)  # tp or cp > 1: registry function, input hook, loss

    def pipeline_stage(self, model: nn.Module, block_ids: Sequence[int], first: bool, last: bool) -> nn.Module:
        return HFCausalLMStage(model, block_ids, first, last)

    def on_prepared(self, model: nn.Module) -> None:
        """A prepared model's ``save_pretrained`` gathers its shards (:func:`ndparallel.hf.save_pretrained`):
        transformers' own cannot read sharded DTensor storage."""
        if is_hf_model(model):  # not a pipeline stage: the Accelerator saves a pipeline with save_model
            _install_save_pretrained(model)

    def save_pretrained(self, model: nn.Module, folder: str | os.PathLike) -> str | None:
        return gather_and_save(model, folder)  # model.safetensors + config.json, full tensors, rank 0 writes

    def unreadable_weights(self, folder: str | os.PathLike) -> str | None:
        return unreadable_weights(folder)  # a truncated or corrupt model.safetensors, named


FAMILY = HuggingFaceFamily()


def _install_save_pretrained(model: nn.Module) -> None:
    """Give a prepared Hugging Face model a ``save_pretrained`` that gathers its shards."""

    def save_pretrained(save_directory: str | os.PathLike, is_main_process: bool = True, **kwargs: Any):
        """Every rank calls it; rank 0 writes ``model.safetensors`` and ``config.json``."""
        extra = {k: v for k, v in kwargs.items() if not (k == "safe_serialization" and v is True)}
        if extra:
            raise ConfigError(
                f"save_pretrained({', '.join(sorted(extra))}=...) is not supported on a model prepared by ndparallel: "
                "call model.save_pretrained(dir) on every rank, or ndparallel.hf.save_pretrained(model, dir)"
            )
        return gather_and_save(model, save_directory)

    model.save_pretrained = save_pretrained


def hf_parallelize_kwargs(
    model: nn.Module,
    cfg: ParallelismConfig,
    mesh: Mesh,
    *,
    tp_plan: dict[str, ParallelStyle] | None = None,
    fsdp_groups: list[list[str]] | None = None,
) -> dict[str, Any]:
    """``plan`` and ``fsdp_groups`` as :func:`ndparallel.parallelize` picks them for an HF model: the caller's
    where given, else the family's (the plan only when tp > 1), after the family's pre-flight refusals."""
    if tp_plan is None and mesh.size("tp") > 1:
        tp_plan = FAMILY.tp_plan(model)
    FAMILY.check(model, cfg, mesh)
    return {"plan": tp_plan, "fsdp_groups": FAMILY.fsdp_groups(model) if fsdp_groups is None else fsdp_groups}
