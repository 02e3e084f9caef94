"""``ModelFamily``: the class a model family subclasses, the protocol with the planners' default behaviours.

:class:`~ndparallel.parallel.protocol.FamilyProtocol` (``protocol.py``) holds the fields, every answer that needs no
planner, and the registry. Two answers do call planners, and their defaults live here, above those planners::

    apply_attention(model, mesh, cfg)  under cp: the modules in ``cp_attention`` swapped for ring attention, and
                                       the forward argument ``positions_arg`` filled with each rank's global
                                       positions (:func:`ndparallel.parallel.context_parallel.apply_ring_attention`)
    apply_moe(model, layers, mesh)     router statistics over dp x cp, experts over ep
                                       (:mod:`ndparallel.parallel.expert_parallel`) and, under tp, each MoE module
                                       split by the family's ``moe_tensor_parallel``

The reference Transformer's family (``ndparallel/models/transformer/family.py``) is also the default for a model no
family claims: its table fits Llama-shaped models named like ours, and anything else passes ``tp_plan=``,
``blocks=`` and ``fsdp_groups=`` to ``parallelize`` (each overrides the family's answer) or registers a family of
its own with :func:`register_family`. Floor: a family definition may use torch's ParallelStyle classes and
ndparallel's planners, so it sits on the planners' floor, beside them; a model never imports its family
(docs/parallelize.md#model-families).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.distributed.mesh import Mesh
from ndparallel.parallel.context_parallel import apply_ring_attention
from ndparallel.parallel.expert_parallel import apply_expert_parallel, apply_router_statistics
from ndparallel.parallel.moe_tensor_parallel import apply_moe_tensor_parallel
from ndparallel.parallel.protocol import FamilyProtocol, family_for, register_family

# family_for and register_family are documented under this module (docs/parallelize.md); both are defined in
# protocol.py, where planners and jobs import them.
__all__ = ["ModelFamily", "family_for", "register_family"]


class ModelFamily(FamilyProtocol):
    """What ``parallelize`` and the jobs need to know about one kind of model. Subclass it, override what differs.

    The defaults describe a generic decoder (:class:`~ndparallel.parallel.protocol.FamilyProtocol`), and under
    cp the modules in ``cp_attention`` swapped for ring attention.
    """

    def apply_attention(self, model: nn.Module, mesh: Mesh, cfg: ParallelismConfig) -> nn.Module:
        """After TP, before activation checkpointing: route the attention through tp/cp; returns the model."""
        if mesh.size("cp") == 1:
            return model
        return apply_ring_attention(model, mesh, cfg, targets=self.cp_attention, positions_arg=self.positions_arg)

    def apply_moe(self, model: nn.Module, moe_layers: Sequence[nn.Module], mesh: Mesh) -> None:
        """After the attention: count the routers' tokens over ``mesh["dp_cp"]`` (the global batch's balancing
        loss), shard the experts over ``mesh["ep"]`` (:mod:`ndparallel.parallel.expert_parallel`) and, under tp,
        split each MoE module over ``mesh["tp"]`` (:mod:`ndparallel.parallel.moe_tensor_parallel`)."""
        apply_router_statistics(moe_layers, mesh)
        spec = self.moe_tensor_parallel(model) if mesh.size("tp") > 1 and moe_layers else None
        apply_expert_parallel(moe_layers, mesh, spec.expert_hidden_dims if spec else None)
        if spec is not None:
            apply_moe_tensor_parallel(moe_layers, mesh["tp"], spec)
