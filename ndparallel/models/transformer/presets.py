"""Shape of the reference Transformer, and named presets from a unit-test toy to Llama-class sizes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ndparallel.config.precision import DTYPES
from ndparallel.config.preflight import ModelShape, moe_problem
from ndparallel.config.sources import coerce_fields
from ndparallel.errors import ConfigError, brief_repr

__all__ = ["FAMILY_NAME", "PARAM_DTYPES", "PRESETS", "TP_SPLIT_FIELDS", "TransformerConfig", "shrink_preset"]

FAMILY_NAME = "transformer"  # TransformerFamily.name, here for the cost model, which names it without importing it
PARAM_DTYPES = ("float32", "float64")  # names in ndparallel.config.precision.DTYPES
# The shape fields the reference TP table shards (heads, kv heads, FFN width, vocabulary): tp must divide them.
TP_SPLIT_FIELDS = ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size")
EXPERTS_IMPLS = ("loop", "grouped_mm")  # how the routed experts run (TransformerConfig.experts_impl)


@dataclass
class TransformerConfig:
    """Llama-style decoder shape. ``n_kv_heads < n_heads`` gives grouped-query attention."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int | None = None
    ffn_dim: int = 192
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    n_experts: int = 0
    """Routed experts per block; 0: a dense model (every block a SwiGLU MLP). > 0: every block's feed-forward is a
    mixture of experts (:class:`ndparallel.models.transformer.moe.MoE`), dropless."""
    top_k: int = 2
    """Experts each token is routed to."""
    n_shared_experts: int = 0
    """Experts every token passes through besides its routed ones (DeepSeek's shared experts), as one SwiGLU MLP."""
    expert_ffn_dim: int | None = None
    """Hidden width of one expert (and of each shared expert); None: ``ffn_dim``."""
    router: str = "softmax"
    """``softmax``: top-k of the softmax, renormalised over the chosen k (Mixtral). ``sigmoid``: top-k of
    sigmoid scores plus a per-expert bias used only for the choice (DeepSeek-V3's auxiliary-loss-free
    balancing, the bias moved by :func:`ndparallel.models.transformer.moe.update_router_biases`)."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss ``n_experts * sum_e f_e * P_e`` (token fractions of the global batch)."""
    z_loss_coef: float = 0.001
    """Weight of the router z-loss, the mean of ``logsumexp(router logits)^2``."""
    experts_impl: str = "loop"
    """How the routed experts run: ``loop`` (one matmul per expert; every dtype, float64 included) or
    ``grouped_mm`` (torch's grouped GEMM, one kernel per projection for all experts; float32 parameters, bf16/fp16
    under mixed precision)."""
    seed: int = 0
    dtype: str | None = None
    """Parameter dtype: ``float32``, or ``float64`` (the exactness proof of the parity tests; bf16/fp16
    training is ``parallelism.mixed_precision``). None: ``torch.get_default_dtype()`` when the config is made,
    as ``nn.Linear`` would use (resolved to its name here, so the config records what was built)."""

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model.{name}={brief_repr(value)} must be a positive integer")
        if self.dim % self.n_heads:
            raise ConfigError(f"model.n_heads={self.n_heads} does not divide model.dim={self.dim}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model.n_kv_heads={self.n_kv_heads} does not divide model.n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} (dim / n_heads) must be even for rotary embeddings")
        if self.expert_ffn_dim is None:
            self.expert_ffn_dim = self.ffn_dim
        width = self.expert_ffn_dim
        if not isinstance(width, int) or isinstance(width, bool) or width < 1:
            raise ConfigError(
                f"model.expert_ffn_dim={brief_repr(width)} must be a positive integer (or null: model.ffn_dim)"
            )
        problem = moe_problem(self.n_experts, self.top_k, self.n_shared_experts, self.router)
        if problem:
            raise ConfigError(problem)
        for name in ("aux_loss_coef", "z_loss_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ConfigError(f"model.{name}={brief_repr(value)} must be a finite number >= 0")
        if self.dtype is None:
            self.dtype = _param_dtype_name(torch.get_default_dtype())
        if self.dtype not in PARAM_DTYPES:
            raise ConfigError(
                f"model.dtype={self.dtype!r} must be one of {list(PARAM_DTYPES)} "
                "(bf16/fp16: parallelism.mixed_precision)"
            )
        if self.experts_impl not in EXPERTS_IMPLS:
            choices = list(EXPERTS_IMPLS)
            raise ConfigError(f"model.experts_impl={brief_repr(self.experts_impl)} must be one of {choices}")
        if self.experts_impl == "grouped_mm" and self.dtype == "float64":
            raise ConfigError(
                "model.experts_impl='grouped_mm' with model.dtype='float64': torch's grouped GEMM has no float64 "
                "kernel; use experts_impl='loop' for float64"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> TransformerConfig:
        """A named shape (see ``PRESETS``), with any field overridden."""
        if name not in PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformerConfig:
        """From a YAML ``model:`` section: ``{preset: tiny, n_layers: 4, ...}`` or plain fields."""
        data = dict(data)
        preset = data.pop("preset", None)
        fields = coerce_fields(cls, data, "model")
        return cls.from_preset(preset, **fields) if preset else cls(**fields)

    def preflight_shape(self) -> ModelShape:
        """What the job pre-flight checks (:mod:`ndparallel.config.preflight`): blocks, the fields TP splits
        (the reference table shards heads, FFN width and vocabulary; an MoE's experts' width instead of the unused
        dense one), the query heads and the position table."""
        fields = [("expert_ffn_dim" if self.is_moe and name == "ffn_dim" else name) for name in TP_SPLIT_FIELDS]
        split = {f"model.{name}": getattr(self, name) for name in fields}
        experts = ("model.n_experts", self.n_experts) if self.is_moe else None
        return ModelShape(self.n_layers, split, ("model.n_heads", self.n_heads), self.max_seq_len, experts=experts)

    def num_params(self) -> int:
        """Parameter count (untied embedding and output)."""
        kv_dim = self.n_kv_heads * self.head_dim
        attention = self.dim * self.dim * 2 + self.dim * kv_dim * 2
        mlp = self._mlp_params(self.n_experts)
        per_layer = attention + mlp + 2 * self.dim
        return self.n_layers * per_layer + 2 * self.vocab_size * self.dim + self.dim

    def _mlp_params(self, experts: int) -> int:
        """One block's feed-forward parameters with ``experts`` routed experts (dense: the SwiGLU MLP)."""
        if not self.is_moe:
            return 3 * self.dim * self.ffn_dim
        expert = 3 * self.dim * self.expert_ffn_dim
        return (experts + self.n_shared_experts) * expert + self.dim * self.n_experts

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6 x matmul params + causal attention; an MoE counts the
        ``top_k`` experts a token runs through (its active parameters)."""
        inactive = self.n_layers * (self._mlp_params(self.n_experts) - self._mlp_params(self.top_k))
        matmul_params = self.num_params() - inactive - self.vocab_size * self.dim - (2 * self.n_layers + 1) * self.dim
        attention = 6 * self.n_layers * self.dim * seq_len  # 12*L*d*s, halved for the causal mask
        return 6 * matmul_params + attention


def _param_dtype_name(dtype: torch.dtype) -> str:
    """The ``model.dtype`` name of torch's default dtype; a default outside ``PARAM_DTYPES`` is refused."""
    for name in PARAM_DTYPES:
        if DTYPES[name] == dtype:
            return name
    raise ConfigError(
        f"torch.get_default_dtype() is {dtype}, not a parameter dtype: set model.dtype to one of {list(PARAM_DTYPES)} "
        "(bf16/fp16: parallelism.mixed_precision)"
    )


# Shapes: tiny/small are for tests and CPU demos; 1b is the 953M-parameter model of the one-GPU
# baseline (docs/benchmarks.md, "One GPU: ndparallel vs plain PyTorch"); 8b and 70b follow the
# public Llama-3 shapes.
_TINY: dict[str, Any] = dict(vocab_size=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=192, max_seq_len=256)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": _TINY,
    "tiny-moe": dict(_TINY, n_experts=4, top_k=2, n_shared_experts=1, expert_ffn_dim=32),  # tiny, with experts
    "small": dict(vocab_size=256, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=704, max_seq_len=1024),
    "125m": dict(vocab_size=32000, dim=768, n_layers=12, n_heads=12, ffn_dim=2048, max_seq_len=2048),
    "1b": dict(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, ffn_dim=5632, max_seq_len=4096),
    "8b": dict(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "70b": dict(
        vocab_size=128256,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
}


def shrink_preset(name: str, **overrides: Any) -> tuple[TransformerConfig, dict[str, tuple[Any, Any]]]:
    """Preset ``name`` at the ``tiny`` preset's sizes (``tiny-moe``'s expert fields for a mixture of experts;
    shared experts kept only where the preset has them), every other field kept (rope theta, router, ...); and
    what changed, ``{field: (from, to)}``. The one shrinking rule of the reference Transformer
    (``ndparallel verify --shrink``)."""
    full = TransformerConfig.from_preset(name, **overrides)
    fields = dict(PRESETS["tiny-moe"] if full.is_moe else PRESETS["tiny"])
    if full.is_moe and not full.n_shared_experts:
        fields["n_shared_experts"] = 0
    if not full.is_moe:
        fields["expert_ffn_dim"] = None  # follows ffn_dim, as in the preset
    small = TransformerConfig.from_preset(name, **{**overrides, **fields})
    before, after = vars(full), vars(small)
    changes = {k: (before[k], v) for k, v in after.items() if before[k] != v}
    if not full.is_moe:
        changes.pop("expert_ffn_dim", None)  # unused by a dense model
    return small, changes
