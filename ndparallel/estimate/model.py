"""The model the planner reasons about: a Llama-style decoder's shape (:class:`ModelSpec`), read from a preset, a
Hugging Face ``config.json``, raw counts or a ``TransformerConfig`` (:func:`model_spec`).

A spec is built where the model's facts are known, so the estimator never names a model family: the family a
spec came from and whether that family's MoE blocks split over tp are fields, filled by the constructors here
from the families themselves (ndparallel/models/). Parameter counts and FLOPs: docs/planning.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ndparallel.config.preflight import ModelShape, moe_problem
from ndparallel.errors import ConfigError
from ndparallel.models.hf.detect import FAMILY_NAME as HF_FAMILY_NAME
from ndparallel.models.hf.detect import expert_count
from ndparallel.models.transformer.presets import FAMILY_NAME, PRESETS, TP_SPLIT_FIELDS, TransformerConfig

__all__ = ["ModelSpec", "hf_moe_fields", "model_spec"]


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-style decoder's shape: all the estimator needs to know about a model.

    A mixture of experts (``n_experts > 0``) replaces the SwiGLU MLP of its MoE blocks (``moe_layers``) by a
    router (``dim -> n_experts``), ``n_experts`` routed SwiGLU experts of width ``expert_ffn_dim`` of which each
    token runs through ``top_k``, and a shared SwiGLU MLP of width ``shared_ffn_dim`` every token runs through:
    the reference :class:`ndparallel.models.transformer.moe.MoE`."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    head_dim: int = 0
    """0 means ``dim // n_heads``."""
    tied_embeddings: bool = False
    name: str = "custom"
    n_experts: int = 0
    """Routed experts per MoE block; 0: a dense model (the other MoE fields are then ignored)."""
    top_k: int = 2
    """Routed experts each token runs through."""
    expert_ffn_dim: int = 0
    """Hidden width of one routed expert; 0: ``ffn_dim``."""
    shared_ffn_dim: int = 0
    """Hidden width of the shared experts' one SwiGLU MLP (the reference's ``n_shared_experts x expert_ffn_dim``)."""
    moe_layers: tuple[int, ...] = ()
    """Indices of the MoE blocks, the others dense blocks of ``ffn_dim``; empty with ``n_experts > 0``: every block."""
    family: str = FAMILY_NAME
    """The name of the model family ``parallelize`` would use: the reference model's (also Llama-shaped raw counts),
    or Hugging Face's for a ``config.json`` (``ndparallel.models.*.family.FAMILY.name``)."""
    moe_tp: bool = field(default=True, metadata={"reported": False})
    """Whether tensor parallelism splits its MoE blocks (its family has a ``MoETensorParallel`` table: the
    reference model's ``MOE_TENSOR_PARALLEL``); False: ``parallelize`` refuses tp > 1 on them (a Hugging Face
    config's, for now). Set where the spec is built; a fact of the family, not of the shape, so not reported."""

    def __post_init__(self) -> None:
        for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model.{key}={value!r} must be a positive integer")
        if self.head_dim == 0:
            if self.dim % self.n_heads:
                raise ConfigError(f"model.n_heads={self.n_heads} does not divide model.dim={self.dim}")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model.n_kv_heads={self.n_kv_heads} does not divide model.n_heads={self.n_heads}")
        self._normalise_experts()

    def _normalise_experts(self) -> None:
        """Check the MoE fields with the model config's own rule (``moe_problem``) and fill their defaults."""
        problem = moe_problem(self.n_experts, self.top_k, 0, "softmax")
        for key in ("expert_ffn_dim", "shared_ffn_dim"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                problem = problem or f"model.{key}={value!r} must be an integer >= 0"
        if problem:
            raise ConfigError(problem)
        layers = tuple(self.moe_layers)
        if not self.n_experts:
            object.__setattr__(self, "moe_layers", ())
            return
        if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.n_layers for i in layers):
            raise ConfigError(f"model.moe_layers={list(layers)} must be block indices in [0, {self.n_layers})")
        object.__setattr__(self, "moe_layers", tuple(sorted(set(layers))) or tuple(range(self.n_layers)))
        object.__setattr__(self, "expert_ffn_dim", self.expert_ffn_dim or self.ffn_dim)

    def as_dict(self) -> dict[str, Any]:
        """The shape's fields, as ``plan --json`` reports them and raw counts may give them (not ``moe_tp``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("reported", True)}

    # -- parameter counts ------------------------------------------------------------------------
    def preflight_shape(self) -> ModelShape:
        """What the job pre-flight checks, named as ``ndparallel train``'s ``model:`` section names them (an MoE's
        tp splits the experts' width, and the dense width only where dense blocks remain). tp splits the shared
        experts' width too: the reference model's is ``n_shared_experts x expert_ffn_dim``, split whenever the
        experts' is, but a spec from raw numbers (``ndparallel plan --shared-ffn-dim``) may give any width."""
        fields = list(TP_SPLIT_FIELDS)
        if self.is_moe:
            fields[fields.index("ffn_dim")] = "expert_ffn_dim"
            if self.n_moe_layers < self.n_layers:
                fields.append("ffn_dim")
            if self.shared_ffn_dim:
                fields.append("shared_ffn_dim")
        split = {f"model.{name}": getattr(self, name) for name in fields}
        experts = ("model.n_experts", self.n_experts) if self.is_moe else None
        return ModelShape(self.n_layers, split, ("model.n_heads", self.n_heads), experts=experts)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def n_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        """wq, wk, wv and wo of one block."""
        return 2 * self.dim * self.q_dim + 2 * self.dim * self.kv_dim

    @property
    def layer_matmul_params(self) -> int:
        """wq, wk, wv, wo and the SwiGLU w1, w3, w2 of one dense block (the weights tensor parallel splits)."""
        return 2 * self.dim * self.q_dim + 2 * self.dim * self.kv_dim + 3 * self.dim * self.ffn_dim

    @property
    def expert_params(self) -> int:
        """One routed expert's w1, w3, w2 (``3 d F``)."""
        return 3 * self.dim * self.expert_ffn_dim

    @property
    def router_params(self) -> int:
        """The router's gate, ``dim -> n_experts`` (replicated over tensor-parallel ranks)."""
        return self.dim * self.n_experts

    @property
    def shared_params(self) -> int:
        """The shared experts' SwiGLU MLP (``3 d S``)."""
        return 3 * self.dim * self.shared_ffn_dim

    def moe_matmul_params(self, experts: int) -> int:
        """An MoE block's matmul weights with ``experts`` routed experts: attention, router, shared experts and
        those experts (``n_experts``: what it holds; ``top_k``: what one token runs through)."""
        return self.attention_params + self.router_params + self.shared_params + experts * self.expert_params

    @property
    def layer_norm_params(self) -> int:
        """attention_norm + ffn_norm (replicated across tensor-parallel ranks)."""
        return 2 * self.dim

    def block_params(self, index: int) -> int:
        """Every parameter of block ``index`` (what the pipeline split balances)."""
        if index in self.moe_layers:
            return self.moe_matmul_params(self.n_experts) + self.layer_norm_params
        return self.layer_matmul_params + self.layer_norm_params

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    @property
    def output_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab_size * self.dim

    def num_params(self) -> int:
        """All parameters (same count as ``TransformerConfig.num_params`` for the reference model)."""
        per_layer = self.layer_matmul_params + self.layer_norm_params
        moe = self.n_moe_layers * (self.moe_matmul_params(self.n_experts) + self.layer_norm_params)
        dense = (self.n_layers - self.n_moe_layers) * per_layer
        return dense + moe + self.embedding_params + self.output_params + self.dim

    def num_active_params(self) -> int:
        """Parameters one token runs through: all but the routed experts it is not routed to."""
        return self.num_params() - self.n_moe_layers * (self.n_experts - self.top_k) * self.expert_params

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, forward + backward: 6 x matmul params + causal attention (12 L d s / 2); an
        MoE block counts the ``top_k`` experts a token runs through (its active parameters), not all of them."""
        moe = self.n_moe_layers * self.moe_matmul_params(self.top_k)
        dense = (self.n_layers - self.n_moe_layers) * self.layer_matmul_params
        return 6 * (dense + moe + self.vocab_size * self.dim) + self.attention_flops_per_token(seq_len)

    def attention_flops_per_token(self, seq_len: int) -> float:
        """The q k^T and p v part of ``flops_per_token`` (what context parallel splits and ring P2P overlaps)."""
        return 6 * self.n_layers * self.q_dim * seq_len

    # -- constructors ----------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: TransformerConfig, name: str = "custom") -> ModelSpec:
        experts = {}
        if cfg.is_moe:
            experts = dict(
                n_experts=cfg.n_experts, top_k=cfg.top_k, expert_ffn_dim=cfg.expert_ffn_dim,
                shared_ffn_dim=cfg.n_shared_experts * cfg.expert_ffn_dim,
            )  # fmt: skip
        return cls(
            dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=int(cfg.n_kv_heads or cfg.n_heads),
            ffn_dim=cfg.ffn_dim, vocab_size=cfg.vocab_size, name=name, **experts,
        )  # fmt: skip

    @classmethod
    def from_preset(cls, name: str) -> ModelSpec:
        if name not in PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)} or pass a config.json")
        return cls.from_config(TransformerConfig.from_preset(name), name=name)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], name: str = "hf") -> ModelSpec:
        """From a Hugging Face ``config.json`` dict (Llama / Mistral / Qwen style field names; a mixture of experts
        by :func:`hf_moe_fields`)."""
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [key for key in required if key not in config]
        if missing:
            raise ConfigError(f"HF config is missing {missing}; it needs {list(required)} (+ num_key_value_heads)")
        return cls(
            dim=int(config["hidden_size"]),
            n_layers=int(config["num_hidden_layers"]),
            n_heads=int(config["num_attention_heads"]),
            n_kv_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
            ffn_dim=int(config.get("intermediate_size_mlp") or config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            head_dim=int(config.get("head_dim") or 0),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            name=str(config.get("_name_or_path") or config.get("model_type") or name),
            family=HF_FAMILY_NAME,
            moe_tp=False,  # no MoETensorParallel for Hugging Face MoE blocks yet: parallelize refuses tp > 1
            **hf_moe_fields(config),
        )


def hf_moe_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`ModelSpec` MoE fields of a Hugging Face ``config.json`` ({} for a dense model): the routed experts
    (:func:`ndparallel.models.hf.detect.expert_count`, the runtime's own reader), ``num_experts_per_tok``, the
    expert width (``moe_intermediate_size``, else ``intermediate_size``), the shared experts
    (``shared_expert_intermediate_size``, else ``n_shared_experts`` experts) and which blocks are MoE, by each
    family's own rule: an explicit ``moe_layers`` list (Llama 4), DeepSeek's ``first_k_dense_replace`` dense blocks
    first, Qwen-MoE's ``mlp_only_layers`` and ``decoder_sparse_step``; every block otherwise (Mixtral)."""
    experts = expert_count(config)
    if not experts:
        return {}
    top_k = config.get("num_experts_per_tok")
    if not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(
            f"HF config declares {experts} routed experts but num_experts_per_tok={top_k!r}: set the experts each "
            "token is routed to"
        )
    width = int(config.get("moe_intermediate_size") or config["intermediate_size"])
    shared = config.get("shared_expert_intermediate_size") or int(config.get("n_shared_experts") or 0) * width
    return dict(
        n_experts=experts, top_k=top_k, expert_ffn_dim=width, shared_ffn_dim=int(shared),
        moe_layers=_hf_moe_layers(config, int(config["num_hidden_layers"])),
    )  # fmt: skip


def _hf_moe_layers(config: Mapping[str, Any], n_layers: int) -> tuple[int, ...]:
    """The blocks a Hugging Face MoE config makes MoE blocks (its modeling file's rule, see :func:`hf_moe_fields`)."""
    if isinstance(config.get("moe_layers"), list):
        return tuple(int(i) for i in config["moe_layers"])
    first_dense = int(config.get("first_k_dense_replace") or 0)
    step = int(config.get("decoder_sparse_step") or 1)
    dense_only = set(config.get("mlp_only_layers") or ())
    return tuple(i for i in range(first_dense, n_layers) if (i + 1) % step == 0 and i not in dense_only)


def model_spec(model: str | os.PathLike | Mapping[str, Any] | TransformerConfig | ModelSpec) -> ModelSpec:
    """Any model description -> ModelSpec: a preset name, a path to an HF ``config.json``, an HF config dict,
    a ``{dim, n_layers, ...}`` dict of raw counts, a TransformerConfig or a ModelSpec."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, TransformerConfig):
        return ModelSpec.from_config(model)
    if isinstance(model, Mapping):
        if "hidden_size" in model:
            return ModelSpec.from_hf_config(model)
        if "preset" in model:  # a training YAML's model section: TransformerConfig fields, checked there
            return ModelSpec.from_config(TransformerConfig.from_dict(dict(model)), name=str(model["preset"]))
        known = {f.name for f in fields(ModelSpec) if f.metadata.get("reported", True)}
        unknown = sorted(set(model) - known)
        if unknown:
            raise ConfigError(f"unknown model field(s) {unknown}; raw counts use {sorted(known)}")
        values = dict(model)
        values.setdefault("n_kv_heads", values.get("n_heads"))
        try:
            return ModelSpec(**values)
        except TypeError as err:
            raise ConfigError(f"raw model counts are incomplete ({err}); give {sorted(known)}") from None
    text = os.fspath(model)
    if text.endswith(".json") or os.path.sep in text:
        path = Path(text)
        if not path.is_file():
            raise ConfigError(f"model config file {text!r} does not exist")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"{text}: invalid JSON: {err}") from None
        return ModelSpec.from_hf_config(data, name=path.parent.name or path.stem)
    return ModelSpec.from_preset(text)
