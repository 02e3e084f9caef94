"""``parallelize(model, cfg, mesh)``: the one place that orders the planners.

Order (each step sees the module tree the previous one left, FQNs never change)::

    1. tensor / sequence parallel   mesh["tp"]          weights split inside each layer
    2. context parallel             mesh["cp"]          attention swapped for ring attention
    3. mixture of experts           mesh["dp_cp"], ["ep"]  router counts of the global batch; experts over ep;
                                    and ["tp"]          under tp the MoE block split over tp inside
    4. activation checkpointing     per block           recompute block activations in backward
    5. torch.compile                model or per block  graphs include the TP collectives
    6. data parallel                FSDP2 on mesh["dp_shard_cp"], HSDP on (dp_replicate, dp_shard_cp),
                                    or bucketed all-reduce on mesh["dp_replicate"]; experts on mesh.experts_fsdp

Why this order: TP must see plain ``nn.Linear`` weights and produce DTensors that FSDP then
shards on the outer dims (FSDP2 composes with a DTensor parameter, not the reverse);
checkpointing and compile wrap the block's computation, TP communication included; FSDP
comes last so its all-gather/reduce-scatter hooks sit outside all of it.

What is particular to a kind of model (its TP table, blocks, FSDP units, attention seam, position
handling, refusals) comes from its :class:`ndparallel.parallel.family.ModelFamily`; this module never branches
on one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

from torch import nn

from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.config.preflight import check_alltoall_heads, ep_problem
from ndparallel.distributed.mesh import Mesh
from ndparallel.distributed.process import init_distributed
from ndparallel.errors import ConfigError
from ndparallel.parallel.activation_checkpoint import apply_activation_checkpointing
from ndparallel.parallel.compile import apply_compile, check_compile
from ndparallel.parallel.expert_parallel import expert_modules
from ndparallel.parallel.fully_shard import apply_fully_shard, fsdp_mesh
from ndparallel.parallel.master_weights import apply_master_weights
from ndparallel.parallel.moe_tensor_parallel import moe_tp_problem
from ndparallel.parallel.protocol import FamilyProtocol, config_sizes, family_for
from ndparallel.parallel.tensor_parallel import TPTable, apply_tensor_parallel, check_tp_divisibility

__all__ = ["find_blocks", "parallelize"]

BlockSpec = Sequence[str] | Callable[[str, nn.Module], bool] | None
_PARALLELIZED = "_ndparallel_parallelized"  # set on a model parallelize has changed: a second call is refused


def find_blocks(model: nn.Module, blocks: BlockSpec = None) -> list[nn.Module]:
    """The transformer blocks of ``model``.

    ``blocks``: ``None`` (default) -> the model family's answer (the children of the first
    ``nn.ModuleList`` for the built-in families: our Transformer's ``layers``, a Hugging Face
    decoder's ``model.layers``); a list of FQNs; or a predicate ``(fqn, module) -> bool`` applied to
    every submodule.
    """
    if blocks is None:
        return family_for(model).blocks(model)
    if callable(blocks):
        return [m for name, m in model.named_modules() if name and blocks(name, m)]
    found = []
    for fqn in blocks:
        try:
            found.append(model.get_submodule(fqn))
        except AttributeError:
            raise ConfigError(f"blocks entry {fqn!r} is not a submodule of {type(model).__name__}") from None
    return found


def _resolve(cfg: ParallelismConfig | None, mesh: Mesh | None) -> tuple[ParallelismConfig, Mesh]:
    if mesh is None:
        mesh = init_distributed(cfg or ParallelismConfig())
        return mesh.config, mesh
    if cfg is None:
        return mesh.config, mesh
    resolved = cfg.resolve(mesh.size())
    if resolved.sizes != mesh.config.sizes:
        raise ConfigError(
            f"cfg sizes ({resolved.describe()}) differ from the mesh's ({mesh.config.describe()}); "
            "pass the config the mesh was built from, or mesh=None"
        )
    if mesh.size("cp") > 1:
        # context_parallel() shards the inputs by the mesh's config; the attention must agree.
        for name in ("cp_load_balance", "cp_rotate_method", "cp_backend"):
            if getattr(resolved, name) != getattr(mesh.config, name):
                raise ConfigError(
                    f"cfg.{name}={getattr(resolved, name)!r} differs from the mesh's {getattr(mesh.config, name)!r}: "
                    "ndparallel.context_parallel shards inputs by the mesh's settings; build the mesh from this "
                    "cfg (init_distributed(cfg)) or pass mesh=None"
                )
    return resolved, mesh


def _check_alltoall_heads(model: nn.Module, family: FamilyProtocol, tp: int, cp: int) -> None:
    """Ulysses splits each tp rank's query heads over cp: refuse a model config whose heads do not divide."""
    for name, heads in config_sizes(model, [family.heads_field] if family.heads_field else []).items():
        check_alltoall_heads(heads, tp, cp, what=name)


def _tp_table(model: nn.Module, family: FamilyProtocol, tp_plan: TPTable | None) -> TPTable:
    """The caller's ``plan``, else the family's table."""
    if tp_plan is not None:
        return tp_plan
    table = family.tp_plan(model)
    if table is None:
        raise ConfigError(
            f"tp_size > 1 but {type(model).__name__} has no tensor-parallel table (model family {family.name!r}): "
            "pass tp_plan={fqn_pattern: ParallelStyle} to ndparallel.parallelize (docs/parallelize.md)"
        )
    return table


def parallelize(
    model: nn.Module,
    cfg: ParallelismConfig | None = None,
    mesh: Mesh | None = None,
    *,
    tp_plan: TPTable | None = None,
    blocks: BlockSpec = None,
    fsdp_groups: Sequence[Sequence[str]] | None = None,
) -> nn.Module:
    """Apply TP/SP -> CP -> MoE/EP -> activation checkpointing -> compile -> FSDP2/HSDP/replicate to ``model``.

    Args:
        model: the module to parallelise (on the target device, or meta for deferred init).
        cfg: sizes and knobs; default ``mesh.config``. With ``mesh=None`` the mesh is built
            from it with :func:`ndparallel.init_distributed`.
        mesh: the :class:`ndparallel.Mesh` to use.
        plan: tensor-parallel table ``{fqn_pattern: ParallelStyle}``; default the model family's
            (:func:`ndparallel.parallel.protocol.family_for`; the reference Transformer's is
            :func:`ndparallel.models.transformer.family.transformer_tp_plan`).
        blocks: which modules are transformer blocks (see :func:`find_blocks`); default the family's.
        fsdp_groups: extra FSDP units as lists of FQNs; default the family's (the reference Transformer's:
            ``[[tok_embeddings], [norm, output]]`` when the model has them).

    Returns the same ``model`` object; parameter names are unchanged. Calling it twice on one
    model is refused (its weights are already split and wrapped).
    """
    done = getattr(model, _PARALLELIZED, None)
    if done is not None:
        raise ConfigError(
            f"this {type(model).__name__} was already parallelized ({done}); call parallelize once, on the plain model"
        )
    cfg, mesh = _resolve(cfg, mesh)
    family = family_for(model)
    block_list = family.blocks(model) if blocks is None else find_blocks(model, blocks)
    tp, cp = mesh.size("tp"), mesh.size("cp")
    if tp > 1:
        tp_plan = _tp_table(model, family, tp_plan)
    family.check(model, cfg, mesh)
    if fsdp_groups is None:
        fsdp_groups = family.fsdp_groups(model)
    if tp > 1:
        check_tp_divisibility(model, tp, tp_plan, fields=family.split_fields)
    if cp > 1 and cfg.cp_rotate_method == "alltoall":
        _check_alltoall_heads(model, family, tp, cp)
    check_compile(cfg.compile, tp)
    moe_layers = family.moe_layers(model)
    experts = family.expert_count(moe_layers[0]) if moe_layers else None
    problem = ep_problem(mesh.size("ep"), experts, cfg)
    if tp > 1 and moe_layers and problem is None:
        problem = moe_tp_problem(moe_layers, family.moe_tensor_parallel(model), tp, family.name)
    if problem:
        raise ConfigError(problem)  # every refusal happens before the model is touched

    apply_master_weights(model, cfg)  # fp32 master weights where FSDP casts (Accelerate's rule)

    if tp > 1:
        apply_tensor_parallel(model, mesh["tp"], tp_plan)
    model = family.apply_attention(model, mesh, cfg)  # tp/cp: attention seam, positions, input checks
    family.apply_moe(model, moe_layers, mesh)  # router statistics of the global batch; experts over ep
    apply_activation_checkpointing(block_list, cfg.activation_checkpointing)
    apply_compile(model, block_list, cfg.compile, tp)
    if cfg.compile == "blocks":
        family.compile_loss_head(model)

    dp_mesh = fsdp_mesh(mesh)
    if dp_mesh is not None:
        ep = mesh.size("ep") > 1
        experts_kwargs = dict(experts=expert_modules(moe_layers), experts_mesh=mesh.experts_fsdp) if ep else {}
        apply_fully_shard(model, dp_mesh, cfg, block_list, fsdp_groups, **experts_kwargs)
    else:
        if cfg.mixed_precision != "no":
            warnings.warn(
                f"mixed_precision={cfg.mixed_precision!r} is applied by FSDP, which this mesh does not use "
                "(dp_shard_size x cp_size == 1); wrap the forward in torch.autocast instead",
                stacklevel=2,
            )
        if mesh.size("dp_replicate") > 1:
            from ndparallel.parallel.replicate import apply_replicate

            model = apply_replicate(model, mesh["dp_replicate"], cfg.dp_bucket_mb)
    setattr(model, _PARALLELIZED, f"mesh {cfg.describe()}")
    return model
