"""The one file of the dry run that reaches into private torch: each name behind one small function.

torch ships what a dry run needs, but not publicly (torch 2.11-2.14): the fake process group (a backend
whose collectives move nothing, so one process can be rank ``r`` of a world of 16,384), ``FakeTensorMode``
(tensors with shapes, dtypes and devices but no data), the FLOP formulas of ``FlopCounterMode`` and
``UntypedStorage.resize_`` (how FSDP2 frees a gathered parameter without freeing the tensor). A moved name
raises one ConfigError saying which torch version was expected, instead of an ImportError deep inside.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ndparallel.errors import ConfigError

__all__ = [
    "fake_store",
    "fake_tensor_mode",
    "flop_formula",
    "gpu_flop_formula",
    "in_backward_pass",
    "is_fake",
    "on_recomputed_save",
    "on_storage_resize",
    "tensors_in",
]


def _moved(what: str, err: Exception) -> ConfigError:
    return ConfigError(
        f"the dry run needs {what}, which torch {torch.__version__} does not have where torch 2.11-2.14 keep it "
        f"({type(err).__name__}: {err}); use torch 2.11-2.14"
    )


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors inside an op's or a module's arguments or outputs (nested lists, tuples, dicts).
    Private: ``torch.utils._pytree`` is how torch's own dispatch modes walk them; no public API does."""
    from torch.utils._pytree import tree_leaves

    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def in_backward_pass() -> bool:
    """Whether autograd's engine is running a backward pass on this thread now (its hooks, an activation
    checkpoint's recomputation and its final callbacks included). torch._C._current_graph_task_id: private,
    -1 outside a backward (the id torch's own checkpoint and compiled autograd read); no public API says it."""
    return torch._C._current_graph_task_id() != -1


def fake_store() -> Any:
    """A store for ``init_process_group(backend="fake")``. Importing torch's fake_pg module registers the
    backend (torch.testing._internal: private, but the only way torch offers)."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as err:
        raise _moved("torch's fake process group (torch.testing._internal.distributed.fake_pg)", err) from None
    return FakeStore()


def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode`` that also takes real tensors (the mesh's small index tensors, loss scalars) as inputs.
    torch._subclasses: private; the mode torch.compile and torch's memory estimators run on."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError as err:
        raise _moved("FakeTensorMode (torch._subclasses.fake_tensor)", err) from None
    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake tensor (no data)."""
    from torch._subclasses.fake_tensor import FakeTensor  # the same private module as fake_tensor_mode

    return isinstance(tensor, FakeTensor)


def fake_constant(tensor: torch.Tensor) -> torch.Tensor | None:
    """The real values a fake tensor carries when torch could keep them (a ``torch.tensor([...])`` literal)."""
    return getattr(tensor, "constant", None)  # FakeTensor.constant: private attribute, None when absent


def flop_formula(func: Any) -> Callable[..., int] | None:
    """The FLOP formula ``FlopCounterMode`` uses for an aten op (called as ``formula(*args, out_val=out,
    **kwargs)``), or None. torch.utils.flop_counter.flop_registry: an undocumented module attribute."""
    return _flop_registry().get(getattr(func, "overloadpacket", func))


def gpu_flop_formula(func: Any) -> Callable[..., int] | None:
    """:func:`flop_formula`, but the CPU flash-attention kernels a dry run dispatches (which the registry lacks)
    take the formula of the GPU's flash kernel: the same arguments first (query, key, value; backward: the
    output's gradient before them), so the same count."""
    name = getattr(getattr(func, "overloadpacket", func), "__name__", "")
    gpu = _CPU_FLASH.get(name)
    if gpu is None:
        return flop_formula(func)
    return _flop_registry().get(getattr(torch.ops.aten, gpu))


_CPU_FLASH = {
    "_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "_scaled_dot_product_flash_attention_backward",
}


@functools.cache
def _flop_registry() -> dict:
    try:
        from torch.utils.flop_counter import flop_registry
    except ImportError as err:
        raise _moved("torch.utils.flop_counter.flop_registry", err) from None
    return flop_registry


@contextlib.contextmanager
def on_storage_resize(callback: Callable[[torch.UntypedStorage], None]) -> Iterator[None]:
    """Call ``callback(storage)`` after every ``UntypedStorage.resize_`` while entered. FSDP2 frees and re-grows a
    gathered parameter's storage in place (``storage.resize_(0)``), which no aten op reports; torch's own
    MemTracker patches the method the same way (there is no hook)."""
    original = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        result = original(storage, size)
        callback(storage)
        return result

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original


@contextlib.contextmanager
def on_recomputed_save(callback: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call ``callback(tensor)`` for each tensor that activation checkpointing's recomputation saves for backward
    while entered. torch's non-reentrant checkpoint recomputes a block under saved-tensor hooks of its own, which
    shadow any outer ``saved_tensors_hooks`` (the innermost pair packs): without this the recomputed block's saved
    tensors would not be seen as saved. torch.utils.checkpoint._recomputation_hook: private (torch 2.11-2.14), its
    ``pack_hook`` wrapped per instance; without the class nothing is wrapped."""
    from torch.utils import checkpoint

    cls = getattr(checkpoint, "_recomputation_hook", None)
    if cls is None:
        yield
        return
    original = cls.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        pack = self.pack_hook

        def pack_hook(tensor: torch.Tensor) -> Any:
            callback(tensor)
            return pack(tensor)

        self.pack_hook = pack_hook

    cls.__init__ = init
    try:
        yield
    finally:
        cls.__init__ = original


def pipeline_stages(schedule: Any) -> list[Any]:
    """The ``PipelineStage`` objects of a torch pipeline schedule (``_stages`` on multi-stage schedules, ``_stage``
    on single-stage ones: private attributes, the only way to reach them after ``build_pipeline``)."""
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    if any(stage is None or not hasattr(stage, "_recv_meta") for stage in stages):
        raise ConfigError(
            f"a dry run with pp_size > 1 needs torch's pipeline stage metadata exchange of torch 2.13-2.14 "
            f"(PipelineStage._recv_meta), which torch {torch.__version__} lacks; dry-run the job without pp, or "
            "use torch 2.13+"
        )
    return stages


def backward_meta(output_metas: Any) -> Any:
    """torch's ``_StageBackwardMeta`` for gradients shaped like ``output_metas`` (torch.distributed.pipelining
    ._utils: private, the object a stage receives from the next one when it infers its shapes)."""
    try:
        from torch.distributed.pipelining._utils import _StageBackwardMeta
    except ImportError as err:
        raise _moved("torch.distributed.pipelining._utils._StageBackwardMeta", err) from None
    return _StageBackwardMeta(backward_metas=tuple(output_metas))


def without_fake_mode() -> contextlib.AbstractContextManager:
    """Run real tensors' ops really while a FakeTensorMode is active (the device mesh's index tensors).
    torch._subclasses.fake_tensor.unset_fake_temporarily: private, the call torch's own tracers use."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily  # the same private module as fake_tensor_mode

    return unset_fake_temporarily()


@contextlib.contextmanager
def during_sharding_propagation(flag: list[int]) -> Iterator[None]:
    """While entered, ``flag[0]`` counts the DTensor sharding propagations running now. DTensor derives an op's
    output shape by running it on global-shape fake tensors of the active FakeTensorMode (the dry run's own), so
    a tracker must not count what is made meanwhile. ShardingPropagator._propagate_tensor_meta_non_cached:
    private (torch.distributed.tensor._sharding_prop, torch 2.11-2.14); without it nothing is wrapped."""
    try:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:
        yield
        return
    original = getattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", None)
    if original is None:
        yield
        return

    def propagate(self: Any, *args: Any, **kwargs: Any) -> Any:
        flag[0] += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            flag[0] -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original
