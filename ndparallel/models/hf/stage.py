"""A pipeline stage of a Hugging Face causal LM (``PIPELINE_MODEL_TYPES``), under the unsplit model's names.

``model.embed_tokens`` (first stage), ``model.layers.<i>`` (an ``nn.ModuleDict`` keyed by the original
index), ``model.norm`` and ``lm_head`` (last stage); ``model.rotary_emb`` on every stage. The stage builds
the causal mask and rotary embeddings itself, from ``position_ids`` (``[batch, seq]``: global positions,
sharded with the tokens under cp).

Built from a model on the meta device, a rank materialises only its stages (``to_empty``) and calls
:meth:`HFCausalLMStage.init_weights`: HF's init rule seeded per module name (:mod:`ndparallel.models.hf.init`), or,
for :func:`ndparallel.hf.load_pretrained_pipeline`, only the rotary tables (the weights are read after
``parallelize``, each rank reading its stages' shards).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ndparallel.errors import ConfigError
from ndparallel.models.hf.init import init_buffers, seeded_init

__all__ = ["LOAD_MARKER", "HFCausalLMStage"]

# model_types whose *ForCausalLM forward is only embed -> layers -> norm -> lm_head, so that a stage computes the
# same: measured exact on pp 2 (tests/models/test_hf_zoo.py, test_pipeline_hf.py). Others (Granite's embedding
# and logit multipliers, Gemma's soft-capping and per-layer rotary, Cohere's logit_scale, ...) would train
# something else silently, so they are refused until a stage reproduces their forward and a test measures it.
PIPELINE_MODEL_TYPES = frozenset({"llama", "mistral", "olmo2", "phi3", "qwen2", "qwen3"})
# Set on a meta model by load_pretrained_pipeline: its stages' parameters come from a checkpoint after
# parallelize, so init_weights leaves them (only the rotary tables are computed).
LOAD_MARKER = "_ndparallel_weights_from_checkpoint"


class _Body(nn.Module):
    """Holds the base model's parts under ``model.``."""


class HFCausalLMStage(nn.Module):
    """Blocks ``block_ids`` of an HF ``*ForCausalLM`` (modules shared with it, weights included)."""

    positions_arg = "position_ids"

    def __init__(self, full: nn.Module, block_ids: Sequence[int], first: bool, last: bool):
        super().__init__()
        model_type = getattr(full.config, "model_type", None)
        if model_type not in PIPELINE_MODEL_TYPES:
            raise ConfigError(
                f"pp_size > 1 is not supported for model_type={model_type!r} ({type(full).__name__}): a pipeline "
                "stage runs only embed_tokens -> layers -> norm -> lm_head and is measured exact for "
                f"{', '.join(sorted(PIPELINE_MODEL_TYPES))}; use pp_size=1"
            )
        base = getattr(full, "model", None)
        parts = ("embed_tokens", "layers", "norm", "rotary_emb")
        if base is None or not all(hasattr(base, p) for p in parts) or not hasattr(full, "lm_head"):
            raise ConfigError(
                f"pp_size > 1 cannot find the blocks of {type(full).__name__}: a Hugging Face stage needs "
                "model.embed_tokens / model.layers / model.norm / model.rotary_emb and lm_head; use pp_size=1"
            )
        if full.lm_head.weight is base.embed_tokens.weight:
            raise ConfigError(
                f"{type(full).__name__} ties lm_head to embed_tokens (tie_word_embeddings=True), which pipeline "
                "stages would hold on different ranks: pp_size > 1 does not support tied word embeddings yet; "
                "set config.tie_word_embeddings=False or use pp_size=1"
            )
        self.config = full.config
        self.first, self.last = first, last
        # HF's per-module rule, a bound method: it holds ``full``, so keep it only for a meta model (no weights);
        # a materialised model's stages must not keep the other stages' weights alive.
        on_meta = any(p.is_meta for p in full.parameters())
        self._init_module = full._init_weights if on_meta else None
        self._params_from_checkpoint = bool(getattr(full, LOAD_MARKER, False))
        self.model = _Body()
        if first:
            self.model.embed_tokens = base.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): base.layers[i] for i in block_ids})
        self.model.rotary_emb = base.rotary_emb
        if last:
            self.model.norm = base.norm
            self.lm_head = full.lm_head

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """What :func:`ndparallel.models.hf.init.seeded_init` gives the whole model from ``seed`` (default 0), for this
        stage's modules; the rotary tables. A stage of a checkpoint being loaded: the rotary tables only."""
        if self._init_module is None:
            raise ConfigError(
                f"{type(self).__name__} was built from a materialised model, whose weights it already holds: "
                "init_weights needs the model built on the meta device"
            )
        if self._params_from_checkpoint:
            init_buffers(self, self._init_module)  # rotary inv_freq: computed from the config
            return
        seeded_init(self, 0 if seed is None else seed, self._init_module)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        h = self.model.embed_tokens(x) if self.first else x
        mask = create_causal_mask(
            config=self.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=position_ids
        )
        rotary = self.model.rotary_emb(h, position_ids=position_ids)
        for layer in self.model.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=rotary, position_ids=position_ids)
        return self.lm_head(self.model.norm(h)) if self.last else h
