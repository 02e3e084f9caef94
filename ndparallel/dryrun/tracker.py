"""What one rank holds and computes during a dry-run step: live bytes by kind, their peak, FLOPs and the ops.

:class:`RankTracker` is a ``TorchDispatchMode`` over this rank's *local* ops (DTensors are left to desugar into
them). Every storage an op reads or writes is remembered through a weak reference, with its current size and a
kind; the sum of live storages is sampled after each op, and its maximum is the peak, kept with the module and
phase running then. Kinds, strongest first (a storage keeps the strongest kind it was ever seen as):

- ``params``: this rank's parameter shards (registered before the step);
- ``unsharded_params``: a parameter a module holds while it runs that is not a shard (FSDP's gathered copy);
- ``grads``: a parameter's ``.grad`` (told by its post-accumulate-grad hook, which FSDP2 fires too);
- ``optimizer``: the optimizer's state (registered after its step);
- ``activations``: what autograd saves for backward (``saved_tensors_hooks``; a checkpointed block's recomputation
  saves under torch's own hooks, seen through ``on_recomputed_save``);
- ``temporaries``: everything else (communication buffers, unsharded gradients, an op's workspace).

Fake tensors made while DTensor propagates a sharding are no memory (global-shape ones, in the dry run's own
FakeTensorMode: a whole unsharded weight per parameter of a foreach op of the optimizer, were they counted), nor
are fake tensors of another FakeTensorMode (on real ranks DTensor makes its own).

Sizes are read on every touch and on every ``UntypedStorage.resize_`` (FSDP2 frees a gathered parameter by
resizing its storage to 0), so a freed storage counts 0 at once. A storage counts once however many views share
it. Not seen: memory that is no torch tensor (NCCL's buffers, the CUDA caching allocator's rounding and
fragmentation), and a fused kernel's savings (docs/planning.md, "Dry run").
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ndparallel.distributed.counter import CommCounter
from ndparallel.distributed.local_ops import LocalOpMode, local_shard
from ndparallel.dryrun.roofline import OpCensus
from ndparallel.dryrun.torch_api import (
    during_sharding_propagation,
    gpu_flop_formula,
    in_backward_pass,
    on_recomputed_save,
    on_storage_resize,
    tensors_in,
)

__all__ = ["KINDS", "Peak", "RankTracker"]

KINDS = ("params", "unsharded_params", "grads", "optimizer", "activations", "temporaries")
_RANK = {kind: i for i, kind in enumerate(KINDS)}


@dataclass
class Peak:
    """The most bytes live at once, their kinds, and where the step was."""

    total: int = 0
    by_kind: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    module: str = ""
    phase: Any = ""
    """Where in the step (:meth:`RankTracker.phase_text` words it)."""


class _Entry:
    __slots__ = ("kind", "nbytes", "ref")

    def __init__(self, ref: weakref.ref, nbytes: int, kind: str) -> None:
        self.ref, self.nbytes, self.kind = ref, nbytes, kind


class RankTracker(LocalOpMode):
    """Live bytes by kind, the peak (total, by kind, module, phase), the activation peak, and FLOPs."""

    def __init__(self, fake_mode: Any = None, values: LocalOpMode | None = None) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self._values = values
        """What answers each op beneath this mode (the dry run's :class:`~ndparallel.dryrun.values.DryRunValues`),
        called in place of entering it as a mode of its own: one dispatch layer fewer over every op."""
        """The dry run's FakeTensorMode (None on real ranks): a fake tensor of any other mode holds no memory (DTensor
        makes global-shape ones of its own to propagate shardings)."""
        self._propagating = [0]
        """DTensor sharding propagations running now (their global-shape fake tensors are no memory)."""
        self._live: dict[int, _Entry] = {}
        self.totals = dict.fromkeys(KINDS, 0)
        self.total = 0
        self.peak = Peak()
        self.activation_peak = 0
        self.flops = 0
        self.ops = OpCensus()
        """Every op's FLOPs and bytes, by part of the step (``ndparallel.dryrun.roofline``: its time on a GPU)."""
        self._part = "step"
        self.retained_activations = 0
        """Saved activations still alive when the measured step starts (torch's pipeline keeps the first stage's
        shape-inference forward, one micro-batch, from the first step on)."""
        self.state_at_step: dict[str, int] | None = None
        """Parameter, gradient and optimizer bytes when the optimizer steps (every gradient there)."""
        self._step_phase = ""
        self._micro_batch = 0
        self._in_backward = False
        self._roots: set[str] = set()
        self._modules: list[str] = []
        self._backward_module = ""
        self._counter: CommCounter | None = None

    # -- storages ---------------------------------------------------------------------------------------------
    def track(self, tensor: Any, kind: str = "temporaries") -> None:
        """Remember ``tensor``'s storage (if new) and raise its kind to ``kind`` if that is stronger."""
        if not isinstance(tensor, torch.Tensor) or not self._holds_memory(tensor):
            return
        try:
            storage = local_shard(tensor).untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, some subclasses)
            return
        key = id(storage)
        entry = self._live.get(key)
        if entry is None:
            # The storage's Python object lives exactly as long as the storage (torch preserves it): its
            # weak reference dies when the memory is freed, and then the id is not reused stale.
            ref = weakref.ref(storage, lambda _ref, k=key: self._forget(k))
            entry = self._live[key] = _Entry(ref, 0, kind)
            self._resize(entry, storage.nbytes())
        elif _RANK[kind] < _RANK[entry.kind]:
            self.totals[entry.kind] -= entry.nbytes
            self.totals[kind] += entry.nbytes
            entry.kind = kind

    def _holds_memory(self, tensor: torch.Tensor) -> bool:
        if self._propagating[0]:
            return False
        mode = getattr(local_shard(tensor), "fake_mode", None)  # FakeTensor.fake_mode (torch._subclasses, private)
        return mode is None or mode is self.fake_mode

    def track_all(self, tensors: Iterable[Any], kind: str) -> None:
        for tensor in tensors:
            self.track(tensor, kind)

    def _forget(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._resize(entry, 0)

    def _resize(self, entry: _Entry, nbytes: int) -> None:
        delta = nbytes - entry.nbytes
        if not delta:
            return
        entry.nbytes = nbytes
        self.totals[entry.kind] += delta
        self.total += delta
        if self.totals["activations"] > self.activation_peak:
            self.activation_peak = self.totals["activations"]
        if self.total > self.peak.total:
            self.peak = Peak(self.total, dict(self.totals), self.where(), self._where_in_step())

    def _resized(self, storage: torch.UntypedStorage) -> None:
        entry = self._live.get(id(storage))
        if entry is not None:
            self._resize(entry, storage.nbytes())

    def reset_peak(self) -> None:
        """Start a new peak from what is live now (the step measured, after a warm-up step)."""
        self.peak = Peak(self.total, dict(self.totals), self.where(), self._where_in_step())
        self.activation_peak = self.retained_activations = self.totals["activations"]
        self.state_at_step = None
        self._micro_batch = 0  # a pipeline's shape-inference forward is no micro-batch

    # -- where the step is -------------------------------------------------------------------------------------
    def set_phase(self, text: str) -> None:
        """The training step's own phase (``TrainStep(phase=...)``): "step 2: forward/backward", ..."""
        self._step_phase, self._micro_batch, self._in_backward = text, 0, False

    def where(self) -> str:
        """The module running now (in backward: the last one whose output gradient arrived)."""
        if self._modules:
            return self._modules[-1]
        return self._backward_module if self._in_backward else ""

    def _where_in_step(self) -> Any:
        return (self._step_phase, self._micro_batch, bool(self._modules), self._in_backward)

    @staticmethod
    def phase_text(where: Any) -> str:
        """``Peak.phase`` as words: "step 2: forward/backward, micro-batch 3, backward (recompute)"."""
        if not isinstance(where, tuple):
            return str(where)
        step_phase, micro_batch, in_module, in_backward = where
        if not micro_batch:
            return step_phase
        sub = ("backward (recompute)" if in_backward else "forward") if in_module else "backward"
        return f"{step_phase}, micro-batch {micro_batch}, {sub}"

    def watch(self, roots: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> list[Any]:
        """Hooks on every module (its name while it runs; parameters it holds that are not shards), every
        parameter (its gradient) and every optimizer (its state). Returns the handles."""
        handles = []
        for root in roots:
            self._roots.add(type(root).__name__)
            for name, module in root.named_modules():
                label = name or type(module).__name__
                handles.append(module.register_forward_pre_hook(self._enter(label)))
                handles.append(module.register_forward_hook(self._leave(label), always_call=True))
            for param in root.parameters():
                handles.append(param.register_post_accumulate_grad_hook(lambda p: self.track(p.grad, "grads")))
        for optimizer in optimizers:
            handles.append(optimizer.register_step_pre_hook(self._optimizer_stepping))
            handles.append(optimizer.register_step_post_hook(self._optimizer_stepped))
        return handles

    def _enter(self, name: str):
        def hook(module: nn.Module, args: Any) -> None:
            if not self._modules and name in self._roots:  # a forward of the whole model (or stage)
                self._micro_batch += 1
                self._in_backward = False
            self._modules.append(name)
            for param in module._parameters.values():  # this module's own (FSDP swaps in gathered ones)
                self.track(param, "unsharded_params")

        return hook

    def _leave(self, name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._modules and self._modules[-1] == name:
                self._modules.pop()
            for tensor in tensors_in(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._backward_into(name))

        return hook

    def _backward_into(self, name: str):
        def hook(grad: torch.Tensor) -> None:
            self._backward_module, self._in_backward = name, True

        return hook

    def _optimizer_stepping(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.state_at_step is None:  # the first optimizer of the step: every gradient is there
            self.state_at_step = {kind: self.totals[kind] for kind in ("params", "grads", "optimizer")}
        self._part = "optimizer"

    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._part = "step"
        for state in optimizer.state.values():
            self.track_all(state.values(), "optimizer")

    # -- the mode ----------------------------------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """``saved_tensors_hooks`` pack: what autograd saves is an activation (unless a stronger kind)."""
        self.track(tensor, "activations")
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @contextlib.contextmanager
    def active(self) -> Iterator[RankTracker]:
        """Enter the mode, the saved-tensor hooks (and checkpointing's recomputation's) and the resize watch."""
        with (
            on_recomputed_save(self.pack),
            on_storage_resize(self._resized),
            during_sharding_propagation(self._propagating),
            torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack),
        ):
            with self:
                yield self

    @contextlib.contextmanager
    def counting(self, counter: CommCounter) -> Iterator[None]:
        """While entered, every collective this mode sees is also counted by ``counter``: what entering the
        counter as a mode of its own would count, without a second dispatch layer over every op (about a tenth
        of a dry run's time)."""
        self._counter = counter
        try:
            yield
        finally:
            self._counter = None

    def local_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self._counter is not None:
            self._counter.record(func, args)
        out = func(*args, **kwargs) if self._values is None else self._values.local_op(func, args, kwargs)
        formula = gpu_flop_formula(func)  # the CPU flash-attention kernels counted as the GPU's
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        tensors = tensors_in((args, kwargs, out))
        self.ops.add(func, tensors, args, kwargs, out, self._part, self._op_phase())
        for tensor in tensors:
            self._touch(tensor)
        return out

    def _op_phase(self) -> str:
        """The census's phase of the op running now: ``backward`` in autograd's backward pass (recompute, FSDP's
        backward hooks), ``forward`` elsewhere in a micro-batch (from its model's forward on: the loss too),
        empty outside the micro-batches (clipping, the optimizer)."""
        if self._part != "step":
            return ""
        if in_backward_pass():
            return "backward"
        return "forward" if self._micro_batch else ""

    def _touch(self, tensor: torch.Tensor) -> None:
        if not self._holds_memory(tensor):
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        entry = self._live.get(id(storage))
        if entry is None:
            self.track(tensor)
        elif entry.nbytes != storage.nbytes():
            self._resize(entry, storage.nbytes())
