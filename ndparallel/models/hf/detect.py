"""What a Hugging Face model is and holds, duck-typed (no ``transformers`` import): whether a module is one, how
many routed experts its config declares, which modules hold fused expert weights, a submodule's FQN, a norm leaf.

Lookups only, no plan: ``tp_plan`` and the translation of its entries ask them, and so do the families, the
Accelerator and the cost model (through ``ndparallel.models.hf.tp_plan``'s names).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

__all__ = ["FAMILY_NAME", "expert_count", "is_hf_model", "is_norm", "module_fqn", "packed_experts"]

FAMILY_NAME = "huggingface"  # HFFamily.name, here for the cost model, which names a family without importing it


def is_hf_model(model: nn.Module) -> bool:
    """True for a ``transformers`` PreTrainedModel (duck-typed: no import of transformers)."""
    config = getattr(model, "config", None)
    return isinstance(getattr(config, "model_type", None), str) and hasattr(model, "base_model_prefix")


def module_fqn(model: nn.Module, module: nn.Module | None) -> str | None:
    """The name of ``module`` inside ``model`` (``""`` for the model itself), or None when it is not in it."""
    for name, mod in model.named_modules():
        if mod is module:
            return name
    return None


def is_norm(module: nn.Module) -> bool:
    """A leaf module whose parameters are a 1-D ``weight`` and maybe a 1-D ``bias`` (RMSNorm, LayerNorm)."""
    params = dict(module.named_parameters())
    if list(module.children()) or "weight" not in params or not set(params) <= {"weight", "bias"}:
        return False
    return all(p.dim() == 1 for p in params.values())


_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def expert_count(config: object) -> int | None:
    """The routed experts per MoE layer a config (a transformers config, or a ``config.json`` dict) declares, or
    None for a dense model."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in _EXPERT_COUNT_KEYS:
        value = text.get(key) if isinstance(text, Mapping) else getattr(text, key, None)
        if isinstance(value, int) and value > 1:
            return value
    return None


def packed_experts(model: nn.Module) -> list[str]:
    """Modules holding experts fused into one ``[n_experts, out, in]`` weight (a convolution's is 3-D too)."""
    n_experts = expert_count(model.config)
    found = []
    for name, param in model.named_parameters():
        owner = name.rpartition(".")[0]
        if param.dim() == 3 and param.shape[0] == n_experts and owner not in found:
            if not isinstance(model.get_submodule(owner), _CONVOLUTIONS):
                found.append(owner)
    return found
