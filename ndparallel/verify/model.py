"""What ``ndparallel verify`` trains: a preset, a Hugging Face config (random weights) or a user's factory.

A :class:`ModelSpec` is a few strings, so it crosses to the rank processes by pickle; each rank builds the
same weights from it (``torch.manual_seed(seed)`` before the build). It also knows how to call the model
(:meth:`ModelSpec.logits`) and which TP plan to hand ``parallelize``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ndparallel.distributed.memory import check_fits_in_memory as fits_in_memory
from ndparallel.errors import ConfigError
from ndparallel.parallel.protocol import block_list

__all__ = ["DTYPES", "ModelSpec", "check_fits_in_memory", "model_spec", "vocab_size"]

# --dtype -> the parameters' dtype (bf16 trains fp32 parameters with bf16 compute: mixed_precision)
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bf16": torch.float32}


@dataclass(frozen=True)
class ModelSpec:
    """``kind`` is ``preset`` (a TransformerConfig preset name), ``hf`` (a config.json file or folder) or
    ``factory`` (``module:callable`` returning an ``nn.Module``); ``tp_plan`` an optional ``module:attr``;
    ``shrink``: a preset or HF config at the tiny sizes of its architecture (:meth:`shrunk`)."""

    kind: str
    source: str
    dtype: str = "float64"
    tp_plan_ref: str | None = None
    seed: int = 0
    shrink: bool = False

    @property
    def name(self) -> str:
        return self.source

    def build(self) -> nn.Module:
        """The model with its seeded weights, parameters in the verify dtype, in train mode."""
        torch.manual_seed(self.seed)
        if self.kind == "preset":
            model = _preset(self.source, self.dtype, self.seed, self.shrink)
        elif self.kind == "hf":
            model = _hf_model(self.source, self.shrink)
        else:
            model = _call_factory(self.source)
        model = model.to(DTYPES[self.dtype]).train()
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigError(
                f"{self.source}: {type(model).__name__} has no trainable parameters: verify compares what training "
                "does to them; give it parameters (requires_grad=True)"
            )
        if block_list(model) is None:
            raise ConfigError(
                f"{self.source}: {type(model).__name__} has no nn.ModuleList of blocks: verify (and parallelize) "
                "shard and checkpoint per block; keep the blocks in an nn.ModuleList"
            )
        return model

    def shrunk(self) -> dict[str, tuple[Any, Any]]:
        """What ``--shrink`` changed, ``{field: (from, to)}`` ({} without it): the rule of
        :func:`ndparallel.hf.tiny_config` for an HF config, the ``tiny`` preset's sizes for a preset."""
        if not self.shrink:
            return {}
        if self.kind == "hf":
            return _shrunk_hf(self.source)[1]
        from ndparallel.models.transformer.presets import shrink_preset

        return shrink_preset(self.source, dtype=_param_dtype(self.dtype), seed=self.seed)[1]

    def tp_plan(self, model: nn.Module) -> Mapping[str, Any] | None:
        """The ``--tp-plan`` table (an attribute, or a callable given the model), or None: the family's."""
        if self.tp_plan_ref is None:
            return None
        plan = _resolve(self.tp_plan_ref, "--tp-plan")
        plan = plan(model) if callable(plan) else plan
        if not isinstance(plan, Mapping):
            raise ConfigError(f"--tp-plan {self.tp_plan_ref} gave a {type(plan).__name__}, not a {{fqn: style}} dict")
        return plan

    def logits(self, model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Forward ``[batch, seq]`` tokens with their (cp-sharded) global ``positions``; the logits."""
        return self.forward(model, tokens, positions)[0]

    def forward(
        self, model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits and the auxiliary loss that training adds to the cross entropy (None without one): an HF
        MoE's ``router_aux_loss_coef x outputs.aux_loss`` (the global batch's under dp/cp), else what the modules
        left in ``aux_loss`` (the reference MoE's router losses: :func:`ndparallel.parallel.loss.auxiliary_loss`)."""
        from ndparallel.parallel.loss import auxiliary_loss

        if self.kind == "hf":
            out = model(input_ids=tokens, position_ids=positions[None])
        elif self.kind == "preset" or "positions" in inspect.signature(model.forward).parameters:
            out = model(tokens, positions=positions)
        else:
            out = model(tokens)
        aux, coef = getattr(out, "aux_loss", None), getattr(model, "router_aux_loss_coef", None)
        logits = self._logits_of(out, tokens)
        if aux is not None and coef:  # an HF MoE, whatever built it (a config, or a factory of the user's)
            return logits, coef * aux
        return logits, auxiliary_loss(model)

    def _logits_of(self, out: Any, tokens: torch.Tensor) -> torch.Tensor:
        """The logits in a forward's output: the tensor itself, its ``logits`` attribute (a ModelOutput) or its
        ``logits`` key (a dict), of shape ``[batch, seq, vocab]`` (one row per token); anything else is refused
        in one line (a tuple or 2-D logits used to fail inside the loss, or the cross entropy's broadcasting)."""
        logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", out)
        if not isinstance(logits, torch.Tensor):
            raise ConfigError(
                f"{self.source}: the forward returned a {type(out).__name__} with no logits: verify reads the "
                "logits; return them as a tensor, or as the `logits` key or attribute of the output"
            )
        if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(tokens.shape):
            raise ConfigError(
                f"{self.source}: the forward returned logits of shape {tuple(logits.shape)} for tokens of shape "
                f"{tuple(tokens.shape)}: verify needs [batch, seq, vocab] logits, one row per token"
            )
        return logits


def check_fits_in_memory(spec: ModelSpec, ranks: int, memory: int | None = None) -> None:
    """Refuse a model too big for this machine before building it: the reference and every rank hold the whole
    model with its gradients and AdamW state (4 copies). Counted on the meta device; a factory that cannot
    build there is not checked. The rule is :func:`ndparallel.distributed.memory.check_fits_in_memory`."""
    try:
        with torch.device("meta"):
            model = spec.build()
    except Exception:
        return
    params = sum(p.numel() for p in model.parameters())
    if spec.kind == "factory" or spec.shrink:
        fix = "verify a shrunk config of the same architecture (fewer layers, a smaller hidden size)"
    else:
        fix = (
            "verify a shrunk config of the same architecture: add --shrink (shrink=True), which keeps the "
            "architecture at 2 layers and a small width and says so in the output"
        )
    fits_in_memory(
        params, DTYPES[spec.dtype].itemsize, factor=4, holders=ranks + 1, memory=memory, fix=fix,
        what=f"{spec.name}: {params / 1e6:.0f}M parameters need",
        held=f"here (the reference and {ranks} ranks each hold the model, its gradients and AdamW state)",
    )  # fmt: skip


def vocab_size(model: nn.Module) -> int:
    """The vocabulary the random tokens are drawn from: ``config.vocab_size``, ``vocab_size`` or the first
    embedding's rows."""
    for owner in (getattr(model, "config", None), model):
        size = getattr(owner, "vocab_size", None)
        if isinstance(size, int):
            return size
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise ConfigError(
            f"{type(model).__name__} has no vocab_size attribute and no nn.Embedding: verify feeds token ids; "
            "give the model a vocab_size attribute"
        )
    return embedding.num_embeddings


def model_spec(
    model: str | Callable[[], nn.Module],
    dtype: str = "float64",
    tp_plan: str | None = None,
    seed: int = 0,
    shrink: bool = False,
) -> ModelSpec:
    """``--model`` as a spec: a preset name, a config.json / folder, ``module:factory``, or a module-level
    factory function (named by its module and name: the ranks import it). ``shrink`` (a preset or HF config
    only) is checked here, before any rank starts."""
    if callable(model):
        model = f"{model.__module__}:{model.__qualname__}"
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: choose one of {list(DTYPES)}")
    from ndparallel.models import PRESETS

    if model in PRESETS:
        return ModelSpec("preset", model, dtype, tp_plan, seed, shrink)
    path = Path(model)
    if path.is_dir() or path.suffix == ".json":
        _hf_config(model)  # refused here, before any rank starts
        spec = ModelSpec("hf", str(path.resolve()), dtype, tp_plan, seed, shrink)
        spec.shrunk()  # an architecture that cannot take the tiny sizes: refused here too
        return spec
    if ":" in model:
        if shrink:
            raise ConfigError(
                f"--shrink applies to a preset or a Hugging Face config, not to --model {model!r} (your factory "
                "chooses its own sizes): make the factory build a smaller model of the same architecture"
            )
        return ModelSpec("factory", model, dtype, tp_plan, seed)
    raise ConfigError(
        f"--model {model!r} is no preset ({', '.join(sorted(PRESETS))}), no config.json or folder, and no "
        "module:factory"
    )


def _param_dtype(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32"


def _preset(name: str, dtype: str, seed: int, shrink: bool = False) -> nn.Module:
    from ndparallel.models import Transformer, TransformerConfig
    from ndparallel.models.transformer.presets import shrink_preset

    if shrink:
        return Transformer(shrink_preset(name, dtype=_param_dtype(dtype), seed=seed)[0])
    return Transformer(TransformerConfig.from_dict({"preset": name, "dtype": _param_dtype(dtype), "seed": seed}))


def _hf_config(source: str):
    """The ``transformers`` config of a config.json file or a folder holding one (no weights, no remote code)."""
    path = Path(source)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"--model {source}: no {file} (a Hugging Face config.json or a folder holding one)")
    try:
        fields = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"--model {source}: {file} is not JSON ({err})") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ConfigError(f"--model {source}: {file} has no model_type; is it a Hugging Face config.json?")
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "--model with a Hugging Face config needs transformers: pip install 'ndparallel[hf]'"
        ) from None
    try:
        return transformers.AutoConfig.for_model(**fields)
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"--model {source}: transformers cannot read {file}: {err}") from None


def _shrunk_hf(source: str) -> tuple[Any, dict[str, tuple[Any, Any]]]:
    """The HF config of ``source`` shrunk by :func:`ndparallel.hf.tiny_config`'s rule, and what changed."""
    from ndparallel.models.hf.tiny import shrink_config

    config = _hf_config(source)
    try:
        return shrink_config(config)
    except Exception as err:  # transformers' validators raise several kinds
        cause = " ".join(str(err).split())[:300]
        raise ConfigError(
            f"--shrink: {config.model_type} does not take the tiny sizes of ndparallel.hf.tiny_config ({cause}): "
            "write a small config.json of the architecture by hand (2 layers, a small hidden size)"
        ) from None


def _hf_model(source: str, shrink: bool = False) -> nn.Module:
    import transformers

    config = _shrunk_hf(source)[0] if shrink else _hf_config(source)
    config._experts_implementation = "eager"  # an MoE's experts: grouped_mm has no float64 kernel (any dtype runs it)
    try:
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except (ValueError, KeyError) as err:
        raise ConfigError(f"--model {source}: no causal LM for model_type {config.model_type!r}: {err}") from None


def _resolve(ref: str, what: str) -> Any:
    """``module:attr`` -> the object (the working directory is importable, as for ``python -m``)."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{what} {ref!r}: expected module:attribute, e.g. mypkg.models:build")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except ImportError as err:
        raise ConfigError(f"{what} {ref!r}: cannot import {module_name!r} ({err})") from None
    except AttributeError:
        raise ConfigError(f"{what} {ref!r}: {module_name!r} has no attribute {attr!r}") from None
    return obj


def _call_factory(ref: str) -> nn.Module:
    factory = _resolve(ref, "--model")
    if not callable(factory):
        raise ConfigError(f"--model {ref!r} is a {type(factory).__name__}, not a callable returning an nn.Module")
    try:
        model = factory()
    except Exception as err:
        raise ConfigError(f"--model {ref!r}: the factory failed: {type(err).__name__}: {err}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {ref!r} returned a {type(model).__name__}, not an nn.Module")
    return model
