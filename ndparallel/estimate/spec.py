"""Inputs of the estimator: the model's shape, the cluster, the training shape and a mesh shape.

Everything is plain numbers in SI units (bytes, bytes/s, FLOP/s) so that the formulas in
``memory.py``, ``comm.py`` and ``timing.py`` read like the equations in docs/planning.md.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ndparallel.config.parallelism import CHOICES, ParallelismConfig
from ndparallel.config.pipeline import PP_SCHEDULES
from ndparallel.config.preflight import ModelShape, moe_problem
from ndparallel.distributed.peak import GPU_PEAK_BF16
from ndparallel.errors import ConfigError
from ndparallel.estimate.hardware import GPU_KINDS
from ndparallel.models.hf.tp_plan import expert_count
from ndparallel.models.transformer.presets import PRESETS, TP_SPLIT_FIELDS, TransformerConfig

__all__ = [
    "MAX_GPUS",
    "ACTIVATION_CHECKPOINTING",
    "COMPILE_MODES",
    "GPU_PRESETS",
    "PRECISIONS",
    "ClusterSpec",
    "MeshShape",
    "ModelSpec",
    "Precision",
    "TrainingSpec",
    "hf_moe_fields",
    "model_spec",
    "parse_bandwidth",
    "parse_bytes",
    "parse_count",
]

GiB = 1024**3

# ---------------------------------------------------------------------------------------------- units
_BYTE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}  # fmt: skip
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9, "t": 10**12, "p": 10**15}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: str | float, name: str = "memory") -> float:
    """``"80GiB"`` -> 85899345920, ``"80GB"`` -> 8e10, ``"141G"`` (binary) or a plain number of bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        match = _NUMBER.match(str(value))
        if not match or match.group(2).lower() not in _BYTE_UNITS:
            raise ConfigError(
                f"{name}={value!r} is not a size: use a number with a unit, e.g. 80GiB, 80GB, 141G or 512MiB"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    result = number * _BYTE_UNITS[unit]
    if result <= 0:
        raise ConfigError(f"{name}={value!r} must be positive")
    return result


def parse_bandwidth(value: str | float, name: str = "bandwidth") -> float:
    """Bytes per second: ``"450GB/s"``, ``"50GB"``, ``"400Gbit/s"`` (bits are divided by 8) or a number."""
    text = str(value).strip()
    bits = bool(re.search(r"(?i:bit)|bps$", text))  # "Gbps" / "Gbit/s" are bits; "GBps" / "GB/s" bytes
    text = re.sub(r"(?i)(/s|ps|it)$", "", text)
    text = re.sub(r"(?i)(bit|b)$", "b", text) if bits else text
    return parse_bytes(text, name) / (8 if bits else 1)


def parse_count(value: str | float, name: str) -> float:
    """``"989T"`` -> 9.89e14, ``"8b"`` -> 8e9 (decimal prefixes) or a plain number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        result = float(value)
    else:
        match = _NUMBER.match(str(value).replace("FLOP/s", "").replace("flops", ""))
        if not match or match.group(2).lower() not in _COUNT_UNITS:
            raise ConfigError(f"{name}={value!r} is not a number: use e.g. 989e12 or 989T")
        result = float(match.group(1)) * _COUNT_UNITS[match.group(2).lower()]
    if result <= 0:
        raise ConfigError(f"{name}={value!r} must be positive")
    return result


# ---------------------------------------------------------------------------------------------- model


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
    family: str = "transformer"
    """The model family ``parallelize`` would use: ``transformer`` (the reference model, and Llama-shaped models) or
    ``huggingface`` (a ``config.json``), whose MoE blocks tensor parallelism cannot split yet."""

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
            family="huggingface",
            **hf_moe_fields(config),
        )


def hf_moe_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`ModelSpec` MoE fields of a Hugging Face ``config.json`` ({} for a dense model): the routed experts
    (:func:`ndparallel.models.hf.tp_plan.expert_count`, the runtime's own reader), ``num_experts_per_tok``, the
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
        known = set(ModelSpec.__dataclass_fields__)
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


# ---------------------------------------------------------------------------------------------- cluster
# The ClusterSpec fields of each GPU kind of the one table of per-GPU constants (estimate/hardware.py).
GPU_PRESETS: dict[str, dict[str, Any]] = {
    name: dict(
        gpu=name, gpu_memory=kind.memory, peak_flops=kind.peak_flops, hbm_bw=kind.hbm_bw,
        intra_node_bw=kind.nvlink_bw, inter_node_bw=kind.network_bw, attention_eff=kind.attention_eff,
    )
    for name, kind in GPU_KINDS.items()
}  # fmt: skip


MAX_GPUS = 2**20
"""The largest world size the planner takes (a million ranks, beyond any cluster built): its search is bounded
so that ``ndparallel plan`` answers in seconds."""


@dataclass(frozen=True)
class ClusterSpec:
    """GPUs and their links. Defaults: an H100 SXM 8-GPU node, NVLink 450 GB/s, 50 GB/s of network per GPU
    (``from_gpu`` fills every field from the GPU table, estimate/hardware.py)."""

    num_gpus: int = 8
    gpus_per_node: int = 8
    gpu_memory: float = 80 * GiB
    """Bytes of memory per GPU."""
    intra_node_bw: float = 450e9
    """Bandwidth of one GPU inside a node (NVLink), bytes/s per direction (data sheet; collectives reach
    ``hardware.LINKS['intra'].efficiency`` of it)."""
    inter_node_bw: float = 50e9
    """Network bandwidth per GPU between nodes (InfiniBand / RoCE), bytes/s per direction (data sheet)."""
    peak_flops: float = GPU_PEAK_BF16["H100"]
    """Dense peak FLOP/s of one GPU in the compute dtype."""
    mfu: float | None = None
    """Override: every FLOP at ``peak x mfu`` and no memory-bound time (the old flat model). None (default):
    the kernel model (estimate/compute.py)."""
    hbm_bw: float = 3.35e12
    """HBM bandwidth, bytes/s (memory-bound kernels)."""
    attention_eff: float = 0.30
    """Fraction of peak flash attention reaches (hardware.GpuKind.attention_eff)."""
    gpu: str = "h100"
    """The GPU kind's name (for the report)."""
    memory_margin: float = 0.1
    """Fraction of GPU memory kept free for the CUDA context, allocator fragmentation and comm buffers."""

    def __post_init__(self) -> None:
        for key in ("num_gpus", "gpus_per_node"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{key}={value!r} must be a positive integer")
        if self.num_gpus > MAX_GPUS:
            raise ConfigError(f"gpus={self.num_gpus} is more than the planner's maximum of {MAX_GPUS} (2**20) GPUs")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ConfigError(
                f"gpus={self.num_gpus} is not a multiple of gpus_per_node={self.gpus_per_node}: "
                f"use {self.num_gpus // self.gpus_per_node * self.gpus_per_node} or "
                f"{math.ceil(self.num_gpus / self.gpus_per_node) * self.gpus_per_node} GPUs, or set --gpus-per-node"
            )
        for key in ("gpu_memory", "intra_node_bw", "inter_node_bw", "peak_flops", "hbm_bw"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key}={getattr(self, key)!r} must be positive")
        if self.mfu is not None and not 0 < self.mfu <= 1:
            raise ConfigError(f"mfu={self.mfu!r} must be in (0, 1], e.g. 0.5 (or omitted: the kernel model)")
        if not 0 < self.attention_eff <= 1:
            raise ConfigError(f"attention_eff={self.attention_eff!r} must be in (0, 1]")
        if not 0 <= self.memory_margin < 1:
            raise ConfigError(f"memory_margin={self.memory_margin!r} must be in [0, 1), e.g. 0.1")

    @property
    def usable_memory(self) -> float:
        return self.gpu_memory * (1 - self.memory_margin)

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_gpus // self.gpus_per_node)

    @classmethod
    def from_gpu(cls, gpu: str, **overrides: Any) -> ClusterSpec:
        """A GPU kind of the table (``h100``, ``h100-hbm2e``, ``h200``, ``a100``) with any field overridden."""
        key = gpu.lower()
        if key not in GPU_PRESETS:
            raise ConfigError(f"unknown gpu {gpu!r}; choose one of {sorted(GPU_PRESETS)} (or give each field)")
        return cls(**{**GPU_PRESETS[key], **overrides})


# ---------------------------------------------------------------------------------------------- training
@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of state."""

    name: str
    param: int
    """Sharded parameter storage (under FSDP2 mixed precision this fp32 shard is the master copy)."""
    grad: int
    """Sharded gradient (FSDP2 reduces in fp32)."""
    optimizer: int
    """AdamW m and v (fp32 each)."""
    compute: int
    """Activations and all-gathered (unsharded) parameters."""
    reduce: int
    """Gradient reduction (reduce-scatter / all-reduce) dtype."""


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", param=4, grad=4, optimizer=8, compute=4, reduce=4),
    "bf16": Precision("bf16", param=4, grad=4, optimizer=8, compute=2, reduce=4),
    "fp16": Precision("fp16", param=4, grad=4, optimizer=8, compute=2, reduce=4),
}
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
COMPILE_MODES = ("none", "blocks", "model")


@dataclass(frozen=True)
class TrainingSpec:
    """Training shape. ``global_batch`` counts sequences of ``seq_len`` tokens per optimizer step."""

    global_batch: int = 256
    seq_len: int = 4096
    micro_batch: int = 1
    precision: str = "bf16"
    """``bf16``/``fp16``: FSDP2 MixedPrecisionPolicy(param bf16, reduce fp32), fp32 master shards; or ``fp32``."""
    activation_checkpointing: str = "none"
    """torchtitan's ``activation_checkpoint.mode``: ``none``, ``full`` or ``selective`` (``selective_ac_option``)."""
    selective_ac_option: str = "2"
    """torchtitan's ``selective_ac_option``: ``"op"`` (per-op: save the matmul, attention and reduce-scatter
    outputs, every second matmul excepted) or ``"N"`` (checkpoint every N-th block; ``"2"``, the default, is
    ndparallel's ``selective``: every other block, the first included)."""
    compile: str = "none"
    """``none``, ``blocks`` (each block compiled) or ``model`` (the whole model, so also the embedding, final
    norm and output projection): torchtitan's meaning, where the cross-entropy runs eager either way."""
    compiled_loss: bool = False
    """The loss head (final norm + output projection + fp32 cross-entropy) in one compiled graph, as the
    plain-PyTorch recipe of docs/planning.md's H200 rows: no fp32 logits materialised. ndparallel's own
    ``compile: blocks`` compiles its head (projection + cross-entropy): plan it with ``compiled_loss=True``."""
    optimizer: str = "adamw"
    reshard_after_forward: bool = True
    """FSDP: free gathered units after forward and all-gather them again in backward."""
    fused_norm: bool = True
    """RMSNorm saves only its input and rstd (CUDA fused kernel); False: the composite CPU op's fp32 copies."""
    cp_rotate_method: str = "ring"
    """Context parallel: ``ring``, ``allgather`` or ``alltoall`` (Ulysses): ``ParallelismConfig.cp_rotate_method``."""
    cp_load_balance: bool = True
    """Context parallel cuts the sequence into 2 x cp chunks (``ParallelismConfig.cp_load_balance``)."""
    defer_grad_sync: bool = False
    """``train.defer_grad_sync`` (the trainer's field, ``ndparallel.parallel.grad_sync.micro_batch_sync``): under FSDP,
    sync gradients on the last micro-batch only, keeping unsharded gradients in between. False (the
    default): reduce-scatter every micro-batch. HSDP's all-reduce and pure replicate's run once per step."""

    def __post_init__(self) -> None:
        for key in ("global_batch", "seq_len", "micro_batch"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{key}={value!r} must be a positive integer")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r} is not one of {list(PRECISIONS)}")
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ConfigError(
                f"activation_checkpointing={self.activation_checkpointing!r} is not one of "
                f"{list(ACTIVATION_CHECKPOINTING)}"
            )
        option = self.selective_ac_option
        if option != "op" and not (option.isdigit() and int(option) > 0):
            raise ConfigError(
                f"selective_ac_option={option!r} must be 'op' (per-op) or a positive integer N (every N-th block)"
            )
        if self.compile not in COMPILE_MODES:
            raise ConfigError(f"compile={self.compile!r} is not one of {list(COMPILE_MODES)}")
        if self.cp_rotate_method not in CHOICES["cp_rotate_method"]:
            raise ConfigError(
                f"cp_rotate_method={self.cp_rotate_method!r} is not one of {list(CHOICES['cp_rotate_method'])}"
            )
        if self.optimizer != "adamw":
            raise ConfigError(f"optimizer={self.optimizer!r}: only 'adamw' is modelled")

    @property
    def bytes(self) -> Precision:
        return PRECISIONS[self.precision]

    def accumulation_steps(self, mesh: MeshShape) -> int:
        """Micro-batches per optimizer step on each data-parallel rank (0 when the batch does not divide)."""
        per_step = mesh.dp * self.micro_batch
        return self.global_batch // per_step if self.global_batch % per_step == 0 else 0

    def reduce_scatter_steps(self, mesh: MeshShape) -> int:
        """Micro-batches per step whose backward reduce-scatters gradients: all of them under FSDP, unless
        ``defer_grad_sync``; else the last one."""
        micro_steps = self.accumulation_steps(mesh) or 1
        return micro_steps if mesh.fsdp > 1 and not self.defer_grad_sync else 1


# ---------------------------------------------------------------------------------------------- mesh


@dataclass(frozen=True, order=True)
class MeshShape:
    """Sizes of the mesh dims, outer -> inner: (pp,) dp_replicate, dp_shard, cp, tp; the pipeline's knobs; and
    ``ep``, expert parallelism, which borrows its ranks from dp_shard x cp (``ep_fsdp`` = what remains of them).

    ``pp`` is listed last as a field (so ``MeshShape(rep, shard, cp, tp)`` keeps working) but is the outermost
    mesh dim. The pp knobs mirror ``ParallelismConfig``'s (:meth:`from_config` / :meth:`to_config` convert;
    the sizes' names and rules are the config's): ``pp_schedule``;
    ``pp_microbatches`` (0: the training accumulation steps, the config's None); ``pp_stages_per_rank``
    (0: 1 for gpipe / 1f1b, 2 otherwise, the config's None)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 0
    pp_stages_per_rank: int = 0
    ep: int = 1
    """Expert-parallel size: the inner ``ep`` ranks of dp_shard x cp each own ``n_experts / ep`` routed experts
    (``ParallelismConfig.ep_size``; not a mesh dim of its own)."""

    def __post_init__(self) -> None:
        for key in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"mesh {key}={value!r} must be a positive integer")
        for key in ("pp_microbatches", "pp_stages_per_rank"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{key}={value!r} must be a positive integer (0 or omitted: the default)")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(f"pp_schedule={self.pp_schedule!r} is not one of {list(PP_SCHEDULES)}")

    @classmethod
    def from_config(cls, cfg: ParallelismConfig) -> MeshShape:
        """The shape of a resolved :class:`ParallelismConfig` (``dp_shard_size`` -> ``dp_shard``, ...)."""
        return cls(
            cfg.dp_replicate_size, cfg.dp_shard_size, cfg.cp_size, cfg.tp_size, cfg.pp_size, cfg.pp_schedule,
            cfg.pp_microbatches or 0, cfg.pp_stages_per_rank or 0, cfg.ep_size,
        )  # fmt: skip

    def to_config(self, train: TrainingSpec | None = None) -> ParallelismConfig:
        """The :class:`ParallelismConfig` of this shape, with the training's precision and cp knobs: what
        ``ndparallel train`` would be given. Raises the config's own :class:`ConfigError` for a shape it refuses."""
        knobs = {}
        if train is not None:
            knobs = {
                "mixed_precision": "no" if train.precision == "fp32" else train.precision,
                "activation_checkpointing": train.activation_checkpointing, "compile": train.compile,
                "cp_rotate_method": train.cp_rotate_method, "cp_load_balance": train.cp_load_balance,
            }  # fmt: skip
        sizes = {f"{dim}_size": value for dim, value in self.as_dict().items()}
        return ParallelismConfig(
            **sizes, pp_size=self.pp, pp_schedule=self.pp_schedule, pp_microbatches=self.pp_microbatches or None,
            pp_stages_per_rank=self.pp_stages_per_rank or None, ep_size=self.ep, **knobs,
        )  # fmt: skip

    @property
    def world_size(self) -> int:
        return self.pp * self.inner_size

    @property
    def inner_size(self) -> int:
        """Ranks of one pipeline stage group (the mesh without pp)."""
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def fsdp(self) -> int:
        """FSDP shard group size: dp_shard x cp (context-parallel ranks also shard parameters)."""
        return self.dp_shard * self.cp

    @property
    def ep_fsdp(self) -> int:
        """Ranks the routed experts' FSDP shards over: what ep leaves of dp_shard x cp (1 without FSDP)."""
        return max(1, self.fsdp // self.ep)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each pp rank holds (1 without pp)."""
        if self.pp == 1:
            return 1
        return self.pp_stages_per_rank or (1 if self.pp_schedule in ("gpipe", "1f1b") else 2)

    def describe(self) -> str:
        inner = f"{self.dp_replicate}x{self.dp_shard}x{self.cp}x{self.tp}" + (f" ep{self.ep}" if self.ep > 1 else "")
        return inner if self.pp == 1 else f"pp{self.pp} {self.pp_schedule} x {inner}"

    def as_dict(self) -> dict[str, int]:
        """The four inner dims (what link and group rules read); ``pp_dict`` has the pipeline's."""
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp, "tp": self.tp}

    def pp_dict(self) -> dict[str, object]:
        return {
            "pp": self.pp, "pp_schedule": self.pp_schedule, "pp_microbatches": self.pp_microbatches or None,
            "pp_stages_per_rank": self.pp_stages_per_rank or None,
        }  # fmt: skip
