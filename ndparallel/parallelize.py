"""``parallelize(model, cfg, mesh)``: the one place that orders the planners.

Order (each step sees the module tree the previous one left, FQNs never change)::

    1. tensor / sequence parallel   mesh["tp"]          weights split inside each layer
    2. context parallel             mesh["cp"]          attention swapped for ring attention
    3. activation checkpointing     per block           recompute block activations in backward
    4. torch.compile                model or per block  graphs include the TP collectives
    5. data parallel                FSDP2 on mesh["dp_shard_cp"], HSDP on (dp_replicate, dp_shard_cp),
                                    or bucketed all-reduce on mesh["dp_replicate"]

Why this order: TP must see plain ``nn.Linear`` weights and produce DTensors that FSDP then
shards on the outer dims (FSDP2 composes with a DTensor parameter, not the reverse);
checkpointing and compile wrap the block's computation, TP communication included; FSDP
comes last so its all-gather/reduce-scatter hooks sit outside all of it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

from torch import nn

from ndparallel.comm.ulysses import check_alltoall_heads
from ndparallel.config import ParallelismConfig
from ndparallel.errors import ConfigError
from ndparallel.mesh import Mesh, init_distributed
from ndparallel.plans.activation_checkpoint import apply_activation_checkpointing
from ndparallel.plans.compile import apply_compile, check_compile
from ndparallel.plans.fully_shard import apply_fully_shard, fsdp_mesh
from ndparallel.plans.hf_tensor_parallel import apply_hf_attention, hf_parallelize_kwargs, is_hf_model
from ndparallel.plans.tensor_parallel import TPPlan, apply_tensor_parallel, check_tp_divisibility, transformer_tp_plan

__all__ = ["find_blocks", "parallelize"]

BlockSpec = Sequence[str] | Callable[[str, nn.Module], bool] | None
_PARALLELIZED = "_ndparallel_parallelized"  # set on a model parallelize has changed: a second call is refused


def find_blocks(model: nn.Module, blocks: BlockSpec = None) -> list[nn.Module]:
    """The transformer blocks of ``model``.

    ``blocks``: ``None`` (default) -> the children of the first ``nn.ModuleList`` (our
    Transformer's ``layers``, a Hugging Face decoder's ``model.layers``); a list of FQNs; or a
    predicate ``(fqn, module) -> bool`` applied to every submodule.
    """
    if blocks is None:
        for module in model.modules():
            if isinstance(module, nn.ModuleList):
                return list(module)
        raise ConfigError(
            f"{type(model).__name__} has no nn.ModuleList of blocks; pass blocks=[fqn, ...] or a predicate"
        )
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


def _check_alltoall_heads(model: nn.Module, tp: int, cp: int) -> None:
    """Ulysses splits each tp rank's query heads over cp: refuse a model config whose heads do not divide."""
    config = getattr(model, "config", None)
    for name in ("n_heads", "num_attention_heads"):  # ours, Hugging Face's
        heads = getattr(config, name, None)
        if isinstance(heads, int) and not isinstance(heads, bool):
            check_alltoall_heads(heads, tp, cp, what=name)
            return


def parallelize(
    model: nn.Module,
    cfg: ParallelismConfig | None = None,
    mesh: Mesh | None = None,
    *,
    plan: TPPlan | None = None,
    blocks: BlockSpec = None,
    fsdp_groups: Sequence[Sequence[str]] | None = None,
) -> nn.Module:
    """Apply TP/SP -> CP -> activation checkpointing -> compile -> FSDP2/HSDP/replicate to ``model`` in place.

    Args:
        model: the module to parallelise (on the target device, or meta for deferred init).
        cfg: sizes and knobs; default ``mesh.config``. With ``mesh=None`` the mesh is built
            from it with :func:`ndparallel.init_distributed`.
        mesh: the :class:`ndparallel.Mesh` to use.
        plan: tensor-parallel table ``{fqn_pattern: ParallelStyle}``; default the reference
            Transformer's (:func:`ndparallel.plans.tensor_parallel.transformer_tp_plan`).
        blocks: which modules are transformer blocks (see :func:`find_blocks`).
        fsdp_groups: extra FSDP units as lists of child FQNs; default ``[[tok_embeddings], [norm, output]]``
            when the model has them.

    Returns the same ``model`` object; parameter names are unchanged. Calling it twice on one
    model is refused (its weights are already split and wrapped).
    """
    done = getattr(model, _PARALLELIZED, None)
    if done is not None:
        raise ConfigError(
            f"this {type(model).__name__} was already parallelized ({done}); call parallelize once, on the plain model"
        )
    cfg, mesh = _resolve(cfg, mesh)
    block_list = find_blocks(model, blocks)
    tp, cp = mesh.size("tp"), mesh.size("cp")
    hf = is_hf_model(model)
    if hf:  # Hugging Face decoder: its TP table and FSDP units, unless the caller passes them
        hf_kwargs = hf_parallelize_kwargs(model, cfg, mesh, plan=plan, fsdp_groups=fsdp_groups)
        plan, fsdp_groups = hf_kwargs["plan"], hf_kwargs["fsdp_groups"]
    if tp > 1:
        check_tp_divisibility(model, tp, transformer_tp_plan() if plan is None else plan)
    if cp > 1 and cfg.cp_rotate_method == "alltoall":
        _check_alltoall_heads(model, tp, cp)
    check_compile(cfg.compile, tp)  # every refusal happens before the model is touched

    if tp > 1:
        apply_tensor_parallel(model, mesh["tp"], plan)
    if hf:
        model = apply_hf_attention(model, mesh, cfg)  # tp/cp > 1: attention function + position_ids seam
    elif cp > 1:
        from ndparallel.plans.context_parallel import apply_context_parallel

        model = apply_context_parallel(model, mesh, cfg)
    apply_activation_checkpointing(block_list, cfg.activation_checkpointing)
    apply_compile(model, block_list, cfg.compile, tp)

    dp_mesh = fsdp_mesh(mesh)
    if dp_mesh is not None:
        apply_fully_shard(model, dp_mesh, cfg, block_list, fsdp_groups)
    else:
        if cfg.mixed_precision != "no":
            warnings.warn(
                f"mixed_precision={cfg.mixed_precision!r} is applied by FSDP, which this mesh does not use "
                "(dp_shard_size x cp_size == 1); wrap the forward in torch.autocast instead",
                stacklevel=2,
            )
        if mesh.size("dp_replicate") > 1:
            from ndparallel.plans.replicate import apply_replicate

            model = apply_replicate(model, mesh["dp_replicate"], cfg.dp_bucket_mb)
    setattr(model, _PARALLELIZED, f"mesh {cfg.describe()}")
    return model
