"""Shape of the reference Transformer, and named presets from a unit-test toy to Llama-class sizes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ndparallel.config.precision import DTYPES
from ndparallel.config.preflight import ModelShape
from ndparallel.config.sources import coerce_fields
from ndparallel.errors import ConfigError, brief_repr

__all__ = ["PARAM_DTYPES", "PRESETS", "TP_SPLIT_FIELDS", "TransformerConfig"]

PARAM_DTYPES = ("float32", "float64")  # names in ndparallel.config.precision.DTYPES
# The shape fields the reference TP table shards (heads, kv heads, FFN width, vocabulary): tp must divide them.
TP_SPLIT_FIELDS = ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size")


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
        if self.dtype is None:
            self.dtype = _param_dtype_name(torch.get_default_dtype())
        if self.dtype not in PARAM_DTYPES:
            raise ConfigError(
                f"model.dtype={self.dtype!r} must be one of {list(PARAM_DTYPES)} "
                "(bf16/fp16: parallelism.mixed_precision)"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

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
        (the reference table shards heads, FFN width and vocabulary), the query heads and the position table."""
        split = {f"model.{name}": getattr(self, name) for name in TP_SPLIT_FIELDS}
        return ModelShape(self.n_layers, split, ("model.n_heads", self.n_heads), self.max_seq_len)

    def num_params(self) -> int:
        """Parameter count (untied embedding and output)."""
        kv_dim = self.n_kv_heads * self.head_dim
        attention = self.dim * self.dim * 2 + self.dim * kv_dim * 2
        mlp = 3 * self.dim * self.ffn_dim
        per_layer = attention + mlp + 2 * self.dim
        return self.n_layers * per_layer + 2 * self.vocab_size * self.dim + self.dim

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6 x matmul params + causal attention."""
        matmul_params = self.num_params() - self.vocab_size * self.dim - (2 * self.n_layers + 1) * self.dim
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
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=192, max_seq_len=256),
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
