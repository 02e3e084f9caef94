"""What a dry run builds: the job's reference Transformer, or any model ``ndparallel verify`` takes.

``--model`` is read as ``verify`` reads it (:func:`ndparallel.verify.model.model_spec`): a preset name, a
Hugging Face ``config.json`` or folder (random weights), or ``module:factory``. A preset replaces the job's
``model:`` section (the reference Transformer, the training job's own path); any other model is parallelised
as ``parallelize`` does it for its family and called as ``verify`` calls it, through :class:`CallAsVerify`,
which hands the training step the logits and the model's auxiliary loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ndparallel.config.preflight import ModelShape
from ndparallel.models import PRESETS, Transformer, TransformerConfig
from ndparallel.train.job_config import TrainConfig

__all__ = ["CallAsVerify", "DryRunModel", "dry_run_model"]


@dataclass
class DryRunModel:
    """How to build the model (under FakeTensorMode), its name, and what the job's pre-flight checks of it."""

    build: Callable[[], nn.Module]
    name: str
    shape: ModelShape | None = None
    """The pre-flight's view of a model other than the job's reference Transformer (None: the job config's)."""
    wrap: Callable[[nn.Module], nn.Module] | None = None
    """Applied after ``parallelize`` (not under pp): how the training step calls the model."""


class CallAsVerify(nn.Module):
    """``model(tokens, positions)`` -> logits for the training step, as ``verify`` calls the model (its
    ``ModelSpec.forward``); the auxiliary loss is left in ``aux_loss`` for the step to add."""

    def __init__(self, model: nn.Module, spec) -> None:  # noqa: ANN001 (ndparallel.verify.model.ModelSpec)
        super().__init__()
        self.model, self.spec = model, spec
        self.aux_loss: torch.Tensor | None = None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits, self.aux_loss = self.spec.forward(self.model, tokens, positions)
        return logits


def _reference(cfg: TrainConfig) -> DryRunModel:
    m = cfg.model
    experts = f", {m.n_experts} experts top-{m.top_k}" if m.n_experts else ""
    name = f"Transformer {m.num_params() / 1e9:.2f}B (dim {m.dim}, {m.n_layers} layers{experts}, {m.dtype})"
    return DryRunModel(lambda: Transformer(cfg.model), name)


def dry_run_model(cfg: TrainConfig, source: str | None = None) -> tuple[TrainConfig, DryRunModel]:
    """The job config (a preset ``source`` replaces its model section) and the model to build."""
    if source is None:
        return cfg, _reference(cfg)
    if source in PRESETS:
        model = TransformerConfig.from_preset(source, max_seq_len=max(cfg.model.max_seq_len, cfg.data.seq_len))
        cfg = dataclasses.replace(cfg, model=model)
        return cfg, _reference(cfg)
    from ndparallel.verify.model import model_spec

    spec = model_spec(source, dtype="float32")  # verify's reading of --model, and its refusals
    shape, build = None, lambda: _factory(spec.source)
    if spec.kind == "hf":
        from ndparallel.estimate import model_spec as estimate_spec

        shape = estimate_spec(_config_json(spec.source)).preflight_shape()
        build = lambda: _hf_model(spec.source)  # noqa: E731
    return cfg, DryRunModel(build, source, shape, lambda model: CallAsVerify(model, spec))


# verify's ModelSpec.build ends in model.to(dtype), which nn.Module does by swapping every parameter, and fake
# parameters cannot be swapped: so the dry run builds the model as verify does, without that call (its
# parameters stay in torch's default dtype, float32, as verify's "float32" would make them).


def _hf_model(source: str) -> nn.Module:
    """A Hugging Face causal LM of ``source``'s config, as ``verify`` builds it (SDPA attention, eager experts)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(source)
    config._experts_implementation = "eager"
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()


def _factory(ref: str) -> nn.Module:
    """``module:callable``'s model (verify checked the reference when it read ``--model``)."""
    import importlib

    module_name, _, attr = ref.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj().train()


def _config_json(source: str) -> str:
    """A Hugging Face folder's ``config.json`` (the estimator reads the file)."""
    from pathlib import Path

    path = Path(source)
    return str(path / "config.json") if path.is_dir() else str(path)
