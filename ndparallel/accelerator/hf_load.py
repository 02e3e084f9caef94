"""``from_pretrained(..., tp_plan="auto", tp_size=N, device_mesh=accelerator.torch_device_mesh)``, as Accelerate's
ND-parallel example loads a model, served by ndparallel's own plan.

Transformers (5.x) cannot adopt a mesh it is handed: with ``tp_size`` it builds its own mesh from the world
size (and needs the accelerate package), so on dp_shard 2 x tp 2 it fails. A load that passes ndparallel's
mesh is meant for ``prepare()``; the Accelerator therefore wraps ``PreTrainedModel.from_pretrained`` (once,
when transformers is imported): such a call loads the model whole, without the three keywords, and
``prepare()`` applies ndparallel's tensor-parallel plan on the same mesh. Calls without an ndparallel mesh
are untouched.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from ndparallel.distributed.mesh import Mesh
from ndparallel.errors import ConfigError

__all__ = ["serve_tp_plan_loads"]

_MARK = "_ndp_serves_tp_plan"


def serve_tp_plan_loads() -> None:
    """Wrap ``transformers.PreTrainedModel.from_pretrained`` (idempotent; nothing if transformers is not imported)."""
    if "transformers" not in sys.modules:
        return
    from transformers import PreTrainedModel

    current = PreTrainedModel.__dict__["from_pretrained"]
    if getattr(current.__func__, _MARK, False):
        return
    original = current.__func__

    @functools.wraps(original)
    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        if isinstance(kwargs.get("device_mesh"), Mesh):
            kwargs = strip_tp_kwargs(kwargs)
        return original(cls, *args, **kwargs)

    setattr(from_pretrained, _MARK, True)
    # Monkeypatching transformers' public classmethod: it has no hook to hand a load to another engine.
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def strip_tp_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without ``tp_plan="auto"``, ``tp_size`` and the ndparallel ``device_mesh``; anything ndparallel's
    plan cannot stand in for raises a ConfigError naming the keyword."""
    kwargs = dict(kwargs)
    mesh: Mesh = kwargs.pop("device_mesh")
    plan, size = kwargs.pop("tp_plan", None), kwargs.pop("tp_size", None)
    if plan not in (None, "auto"):
        raise ConfigError(
            f"from_pretrained(tp_plan={plan!r}, device_mesh=accelerator.torch_device_mesh): prepare() applies "
            "ndparallel's plan for the model; pass tp_plan='auto' or pass your table to ndparallel.parallelize"
        )
    if size is not None and size != mesh.size("tp"):
        raise ConfigError(
            f"from_pretrained(tp_size={size}) but the accelerator's mesh has tp_size={mesh.size('tp')}; "
            "pass the parallelism_config's tp_size"
        )
    if kwargs.get("distributed_config") is not None:
        raise ConfigError(
            "from_pretrained(distributed_config=..., device_mesh=accelerator.torch_device_mesh): transformers would "
            "shard the model itself; drop distributed_config and let accelerator.prepare() parallelise it"
        )
    return kwargs
