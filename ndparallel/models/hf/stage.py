"""A pipeline stage of a Hugging Face causal LM (``PIPELINE_MODEL_TYPES``), under the unsplit model's names.

``model.embed_tokens`` (first stage), ``model.layers.<i>`` (an ``nn.ModuleDict`` keyed by the original
index), ``model.norm`` and ``lm_head`` (last stage); ``model.rotary_emb`` on every stage. The stage builds
each layer's mask (causal or sliding window, as its ``*Model.forward`` picks) and rotary embeddings itself,
from ``position_ids`` (``[batch, seq]``: global positions, sharded with the tokens under cp), and applies the
model's embedding and logit multipliers / soft-capping read from its config.

Built from a model on the meta device, a rank materialises only its stages (``to_empty``) and calls
:meth:`HFCausalLMStage.init_weights`: HF's init rule seeded per module name (:mod:`ndparallel.models.hf.init`), or,
for :func:`ndparallel.hf.load_pretrained_pipeline`, only the buffers (the weights are read after
``parallelize``, each rank reading its stages' shards).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from ndparallel.distributed.documents import DocumentMask
from ndparallel.errors import ConfigError
from ndparallel.models.hf.attention import ATTENTION_RING, ATTENTION_SDPA
from ndparallel.models.hf.init import init_buffers, seeded_init, seeded_init_module
from ndparallel.parallel.masks import DOCUMENTS_KWARG

__all__ = ["LOAD_MARKER", "HFCausalLMStage"]

# model_types whose *ForCausalLM forward the stage reproduces: embed_tokens (with Gemma's scaled embedding
# module; Phi's embed_dropout module) x ``embedding_multiplier`` (Granite), dropout ``embedding_dropout``
# (StarCoder 2); layers, each with the mask of its ``config.layer_types`` entry (sliding windows: Gemma 2/3,
# SmolLM3, Qwen) or, without layer_types, the sliding-window mask wherever ``config.sliding_window`` is set
# (Mistral, Phi-3, StarCoder 2); the rotary of its layer type (Gemma 3's local/global rope); the final norm
# (``norm``, Phi's ``final_layernorm``); lm_head, then ``logits_scaling`` (Granite, divided), ``logit_scale``
# (Cohere) and ``final_logit_softcapping`` (Gemma 2/3). Each is measured exact on pp 2
# (tests/models/test_hf_zoo.py: the core in make test, the second line in make zoo's sweep; test_pipeline_hf.py);
# any other type could train something else silently (nanochat's stage measured a loss 4.6e-2 off), so it is
# refused by name until a test measures it.
PIPELINE_MODEL_TYPES = frozenset(
    {
        "cohere", "gemma2", "gemma3_text", "granite", "llama", "mistral", "olmo2", "phi3", "qwen2", "qwen3",
        "smollm3", "starcoder2",
        "arcee", "cohere2", "cwm", "ernie4_5", "exaone", "exaone4", "gemma", "glm", "glm4", "helium",
        "hyperclovax", "internlm3", "iquestcoder", "jais2", "ministral3", "olmo", "olmo3", "seed_oss", "vaultgemma",
        "phi", "gpt_neox",
        "mixtral", "qwen3_moe", "deepseek_v3",
    }
)  # fmt: skip
# The mixtures of experts above are measured exact on pp 2 and pp 2 x ep 2 (tests/models/test_hf_moe.py) with
# output_router_logits=False; True is refused: transformers computes the balancing loss in the causal LM's forward
# from every layer's router logits together, and no stage holds them all.
# the base model's parts, by the names the PIPELINE_MODEL_TYPES use (Phi: final_layernorm; GPT-NeoX: embed_in,
# final_layer_norm), and the dropout module some apply after the embedding (Phi, GPT-NeoX)
_PARTS = {
    "embed": ("embed_tokens", "embed_in"),
    "layers": ("layers",),
    "norm": ("norm", "final_layernorm", "final_layer_norm"),
    "rotary": ("rotary_emb",),
}
_EMBED_DROPOUTS = ("embed_dropout", "emb_dropout")
# config.layer_types entries a stage builds a mask for (create_causal_mask / create_sliding_window_causal_mask)
_MASK_KINDS = ("full_attention", "sliding_attention")
# Set on a meta model by load_pretrained_pipeline: its stages' parameters come from a checkpoint after
# parallelize, so init_weights leaves them (only the non-persistent buffers are computed).
LOAD_MARKER = "_ndparallel_weights_from_checkpoint"


class _Body(nn.Module):
    """Holds the base model's parts under its attribute (``model.``)."""


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
        if getattr(full.config, "output_router_logits", False):
            raise ConfigError(
                f"pp_size > 1 with output_router_logits=True ({type(full).__name__}): transformers computes the "
                "load-balancing loss in the causal LM's forward from every layer's router logits together, which no "
                "pipeline stage holds; set output_router_logits=False (no balancing loss), or use pp_size=1"
            )
        if getattr(full.config, "use_bidirectional_attention", False):
            raise ConfigError(
                f"pp_size > 1 does not build the bidirectional masks of {type(full).__name__} "
                "(use_bidirectional_attention=True): a stage's masks are causal; use pp_size=1"
            )
        # the base model's attribute (``model``; GPT-NeoX: ``gpt_neox``) and its parts' names: the stage holds them
        # under the same FQNs as the whole model
        self._prefix = getattr(full, "base_model_prefix", None) or "model"
        base = getattr(full, self._prefix, None)
        names = {part: next((n for n in options if hasattr(base, n)), None) for part, options in _PARTS.items()}
        if base is None or None in names.values() or not hasattr(full, "lm_head"):
            raise ConfigError(
                f"pp_size > 1 cannot find the blocks of {type(full).__name__}: a Hugging Face stage needs "
                f"{self._prefix}.{{{' / '.join('|'.join(o) for o in _PARTS.values())}}} and lm_head; use pp_size=1"
            )
        self._embed_name, self._norm_name = names["embed"], names["norm"]
        dropout = next((n for n in _EMBED_DROPOUTS if isinstance(getattr(base, n, None), nn.Dropout)), None)
        writers = _tie_writers(full)
        tied = bool(writers)
        self.config = full.config
        self.first, self.last = first, last
        self._kinds = {i: _mask_kind(full.config, i) for i in block_ids}  # layer index -> its mask (and rope) kind
        # Gemma 3: one rotary table per layer type (local / global rope), picked by a ``layer_type`` argument
        self._rope_per_kind = "layer_type" in inspect.signature(base.rotary_emb.forward).parameters
        # HF's per-module rule, a bound method: it holds ``full``, so keep it only for a meta model (no weights);
        # a materialised model's stages must not keep the other stages' weights alive.
        on_meta = any(p.is_meta for p in full.parameters())
        self._init_module = full._init_weights if on_meta else None
        # the tied weight's modules in the whole model's init order: each copy gets every one's init, as the one
        # tensor does in one process (the last writer wins)
        self._tie_writers = writers if on_meta else []
        self._params_from_checkpoint = bool(getattr(full, LOAD_MARKER, False))
        body = _Body()
        setattr(self, self._prefix, body)
        if first:
            setattr(body, self._embed_name, getattr(base, self._embed_name))
            if dropout is not None:  # Phi, GPT-NeoX: a dropout module after the embedding
                setattr(body, dropout, getattr(base, dropout))
        self._dropout_name = dropout
        body.layers = nn.ModuleDict({str(i): base.layers[i] for i in block_ids})
        body.rotary_emb = base.rotary_emb
        if last:
            setattr(body, self._norm_name, getattr(base, self._norm_name))
            # tied: the last stage holds its own copy (the first stage holds the embedding's); the pipeline
            # sums the copies' gradients and counts one in the norm (docs/pipeline-parallel.md#tied-word-embeddings)
            self.lm_head = copy.deepcopy(full.lm_head) if tied else full.lm_head
        # this stage's copies of a weight tied across stages: local FQN -> the one-process FQN of the weight (the
        # embedding's, as transformers stores it)
        self.tied_weights: dict[str, str] = {}
        embedding = f"{self._prefix}.{self._embed_name}.weight"
        if tied and first:
            self.tied_weights[embedding] = embedding
        if tied and last:
            self.tied_weights["lm_head.weight"] = embedding

    @property
    def _body(self) -> nn.Module:
        """The base model's parts this stage holds (``self.model``; GPT-NeoX: ``self.gpt_neox``)."""
        return getattr(self, self._prefix)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """What :func:`ndparallel.models.hf.init.seeded_init` gives the whole model from ``seed`` (default 0), for this
        stage's modules; the rotary tables. A stage of a checkpoint being loaded: its non-persistent buffers
        only (:func:`ndparallel.models.hf.init.init_buffers`)."""
        if self._init_module is None:
            raise ConfigError(
                f"{type(self).__name__} was built from a materialised model, whose weights it already holds: "
                "init_weights needs the model built on the meta device"
            )
        if self._params_from_checkpoint:
            init_buffers(self, self._init_module)  # non-persistent buffers: rotary inv_freq, Gemma's embed_scale
            return
        seed = 0 if seed is None else seed
        seeded_init(self, seed, self._init_module)
        for fqn in self.tied_weights:
            copy_ = self.get_parameter(fqn)
            for writer_fqn, module, name in self._tie_writers:
                with _holding(module, name, copy_):
                    seeded_init_module(module, seed, writer_fqn, self._init_module)

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The ``*ForCausalLM`` forward for this stage's part: tokens (first stage) or hidden states in; hidden
        states or logits (last stage) out. ``documents``: the micro-batch's mask over the whole rows, ``[batch, 2,
        seq]`` query and key document ids (padding, packed documents: the pipeline builds it)."""
        config = self.config
        h = self._embed(x) if self.first else x
        kinds = sorted(set(self._kinds.values()))
        extra = {}
        if documents is None:
            masks = self._causal_masks(h, position_ids, kinds)
        elif config._attn_implementation in (ATTENTION_RING, ATTENTION_SDPA):  # tp/cp: ndparallel's attention
            masks, extra = dict.fromkeys(kinds), {DOCUMENTS_KWARG: DocumentMask(documents[:, 0], documents[:, 1])}
        else:  # transformers' own attention: the mask as a 4-D tensor it takes as is
            masks = self._document_masks(DocumentMask(documents[:, 0], documents[:, 1]), kinds, h.dtype)
        if self._rope_per_kind:
            rotary = {kind: self._body.rotary_emb(h, position_ids, kind) for kind in kinds}
        else:
            rotary = dict.fromkeys(kinds, self._body.rotary_emb(h, position_ids=position_ids))
        for i, layer in self._body.layers.items():
            kind = self._kinds[int(i)]
            h = layer(
                h, attention_mask=masks[kind], position_embeddings=rotary[kind], position_ids=position_ids, **extra
            )
        return self._head(h) if self.last else h

    def _causal_masks(self, h: torch.Tensor, position_ids: torch.Tensor, kinds: list[str]) -> dict:
        """Each layer kind's mask as its ``*Model.forward`` builds it (packed ``position_ids`` included)."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        make = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        args = {"config": self.config, "inputs_embeds": h, "attention_mask": None, "cache": None}
        return {kind: make[kind](**args, position_ids=position_ids) for kind in kinds}

    def _document_masks(self, documents: DocumentMask, kinds: list[str], dtype: torch.dtype) -> dict:
        """Each layer kind's ``[batch, 1, seq, seq]`` mask from the rows' documents: boolean for SDPA, additive
        (0 / dtype min, as transformers' eager mask) for eager attention."""
        window = getattr(self.config, "sliding_window", None)
        masks = {}
        for kind in kinds:
            visible = documents.dense(window if kind == "sliding_attention" else None)[:, None]
            if self.config._attn_implementation == "eager":
                visible = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
                    ~visible, torch.finfo(dtype).min
                )
            masks[kind] = visible
        return masks

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``*Model.forward`` up to the first layer: Gemma's scale is inside its embedding module; Granite's
        ``embedding_multiplier`` and StarCoder 2's ``embedding_dropout`` follow it."""
        h = getattr(self._body, self._embed_name)(tokens)
        if self._dropout_name is not None:
            h = getattr(self._body, self._dropout_name)(h)
        multiplier = getattr(self.config, "embedding_multiplier", None)
        if multiplier is not None:
            h = h * multiplier
        dropout = getattr(self.config, "embedding_dropout", None)
        if dropout is not None:
            h = nn.functional.dropout(h, p=dropout, training=self.training)
        return h

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """``norm`` and ``lm_head``, then ``*ForCausalLM.forward``'s logit transforms, in HF's order."""
        logits = self.lm_head(getattr(self._body, self._norm_name)(h))
        scaling = getattr(self.config, "logits_scaling", None)  # Granite: divided
        if scaling is not None:
            logits = logits / scaling
        scale = getattr(self.config, "logit_scale", None)  # Cohere: multiplied
        if scale is not None:
            logits = logits * scale
        cap = getattr(self.config, "final_logit_softcapping", None)  # Gemma 2 / 3
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


def _mask_kind(config: object, layer: int) -> str:
    """Layer ``layer``'s mask kind as its ``*Model.forward`` picks it: its ``config.layer_types`` entry, else
    (Mistral, Phi-3, StarCoder 2) the sliding-window mask wherever ``config.sliding_window`` is set."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return "full_attention" if getattr(config, "sliding_window", None) is None else "sliding_attention"
    kind = layer_types[layer]
    if kind not in _MASK_KINDS:
        raise ConfigError(
            f"pp_size > 1 cannot build the {kind!r} mask of layer {layer} (model_type="
            f"{getattr(config, 'model_type', None)!r}): a stage builds {' / '.join(_MASK_KINDS)} masks; use pp_size=1"
        )
    return kind


_TIE_WRITERS = "_ndparallel_tie_writers"  # on the whole model: its tie, as found before a stage materialised


def _tie_writers(full: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(module FQN, module, attribute)`` of every module of ``full`` holding its tied embedding / lm_head weight,
    in module order; empty when untied. Found once and kept on ``full``: materialising one stage (``to_empty``)
    replaces its copy of the weight, and the next stage cut from ``full`` must still know the two were one."""
    if not hasattr(full, _TIE_WRITERS):
        weight = full.lm_head.weight
        tied = weight is full.get_input_embeddings().weight
        writers = [
            (fqn, module, name)
            for fqn, module in full.named_modules()
            for name, p in module.named_parameters(recurse=False)
            if tied and p is weight
        ]
        object.__setattr__(full, _TIE_WRITERS, writers)  # not a submodule: a plain attribute
    return getattr(full, _TIE_WRITERS)


@contextlib.contextmanager
def _holding(module: nn.Module, name: str, param: nn.Parameter) -> Iterator[None]:
    """``module.<name>`` is ``param`` for the block (a tied weight's other module, initialising this copy)."""
    kept = module._parameters[name]
    module._parameters[name] = param
    try:
        yield
    finally:
        module._parameters[name] = kept
