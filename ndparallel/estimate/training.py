"""The training the planner reasons about: batch, sequence, precision and the knobs that change memory or time
(:class:`TrainingSpec`). The knobs ``ndparallel train`` shares take the config's own choices
(ndparallel/config/parallelism.py ``CHOICES``), so the planner offers what the trainer accepts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ndparallel.config.parallelism import CHOICES
from ndparallel.errors import ConfigError

if TYPE_CHECKING:
    from ndparallel.estimate.mesh import MeshShape

__all__ = ["ACTIVATION_CHECKPOINTING", "COMPILE_MODES", "PRECISIONS", "Precision", "TrainingSpec"]


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
ACTIVATION_CHECKPOINTING: tuple[str, ...] = CHOICES["activation_checkpointing"]
COMPILE_MODES: tuple[str, ...] = CHOICES["compile"]


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

    @property
    def mixed_precision(self) -> str:
        """``ParallelismConfig.mixed_precision`` of this precision (``fp32`` is the config's ``no``)."""
        return "no" if self.precision == "fp32" else self.precision

    def accumulation_steps(self, mesh: MeshShape) -> int:
        """Micro-batches per optimizer step on each data-parallel rank (0 when the batch does not divide)."""
        per_step = mesh.dp * self.micro_batch
        return self.global_batch // per_step if self.global_batch % per_step == 0 else 0

    def reduce_scatter_steps(self, mesh: MeshShape) -> int:
        """Micro-batches per step whose backward reduce-scatters gradients: all of them under FSDP, unless
        ``defer_grad_sync``; else the last one."""
        micro_steps = self.accumulation_steps(mesh) or 1
        return micro_steps if mesh.fsdp > 1 and not self.defer_grad_sync else 1
