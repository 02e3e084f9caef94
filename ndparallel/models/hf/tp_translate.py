"""Each entry of a Hugging Face config's ``base_model_tp_plan`` as an exact DTensor style, or refused by name.

:data:`STYLES` is what ndparallel does with each of transformers' style names, :data:`REFUSED` why it refuses the
others (docs/huggingface.md has the table). :func:`linear_entries` translates one model's entries (a sublayer's
rowwise projection reduce-scatters into sequence shards; a sublayer whose projections all gather computes
replicated inside); :func:`unplaceable` is the one refusal every step of the plan raises, naming the model type,
the module and the way out. The plan around these entries (embedding, norms, ``lm_head``) is
``ndparallel/models/hf/tp_plan.py``'s.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from ndparallel.errors import ConfigError
from ndparallel.models.hf.styles import PerShardNorm, ReplicatedCompute
from ndparallel.parallel.fqn import fqn_matches, matching_modules

__all__ = ["REFUSED", "STYLES", "PlanContext", "custom_plan_hint", "linear_entries", "prefixed_plan", "unplaceable"]

# transformers' style name -> what ndparallel does with it (docs/huggingface.md, "The style table")
STYLES = {
    "colwise": "ColwiseParallel: output features sharded, local output",
    "rowwise": "RowwiseParallel, output reduce-scattered to sequence shards (the sublayer's exit)",
    "colwise_gather_output": "ColwiseParallel, output all-gathered (replicated compute after it)",
    "rowwise_split_input": "RowwiseParallel on a replicated input, output reduce-scattered to sequence shards",
    "replicated_with_grad_allreduce": "PerShardNorm: replicated weight over each rank's heads, gradient summed",
    "embedding_rowwise": "the input embedding: vocab-parallel, seq-sharded output; inside a sublayer: "
    "vocab-parallel, replicated output",
    "embedding_colwise": "the input embedding: placed vocab-parallel as above; inside a sublayer: "
    "dim-sharded, gathered output",
    "replicate": "the input embedding: placed vocab-parallel; inside a gathered sublayer: ReplicatedCompute",
}
# transformers' style name -> why ndparallel refuses it (each names the module and the way out when raised)
REFUSED = {
    "moe_tp_experts": "tensor parallel of fused MoE experts is not implemented (shard the experts by expert "
    "parallel instead, ep_size: docs/expert-parallel.md)",
    "moe_identity_expert": "it belongs to MoE tensor parallel of the experts, which is not implemented",
    "packed_colwise": "packed 3-D expert weights belong to MoE tensor parallel, which is not implemented",
    "packed_rowwise": "packed 3-D expert weights belong to MoE tensor parallel, which is not implemented",
    "mla_kv_a_proj": "MLA's shared rope key (kv_a_proj_with_mqa) needs a gradient all-reduce of one output "
    "slice that ndparallel does not implement",
    "local_params": "bare parameters sharded with the heads (attention sinks) are not translated",
    "unit_colwise": "replicating whole heads over a sub-mesh when the heads do not divide tp (transformers' unit "
    "mesh) is not translated",
    "unit_rowwise": "replicating whole heads over a sub-mesh when the heads do not divide tp (transformers' unit "
    "mesh) is not translated",
    "all_reduce": "a module summing partial outputs of rowwise children conflicts with ndparallel's "
    "reduce-scatter to sequence shards",
}
_MOE_FIRST = ("moe_tp_experts", "moe_identity_expert", "mla_kv_a_proj")  # the refusal that names the real reason
_GATHERED = {"colwise_gather_output", "rowwise_split_input", "replicate", "embedding_rowwise", "embedding_colwise"}
_ROWWISE = {"rowwise", "rowwise_split_input"}


def custom_plan_hint(model: nn.Module) -> str:
    """The way out every refusal of the plan ends with: pass a plan of your own, or no tensor parallel."""
    return (
        f"pass tp_plan={{fqn_pattern: ParallelStyle}} to ndparallel.parallelize for {type(model).__name__} (start from "
        "ndparallel.hf.hf_tp_plan(model, overrides={fqn: style})), with "
        "blocks=[fqn, ...] and fsdp_groups=[[fqn, ...], ...] where the defaults do not fit "
        "(docs/huggingface.md#another-architecture-pass-a-plan), or use tp_size=1"
    )


def unplaceable(model: nn.Module, fqn: str, module: nn.Module | None, why: str) -> ConfigError:
    """The refusal when the plan cannot place ``fqn``: names the model type, the module, its class and the way out."""
    kind = f" ({type(module).__name__})" if module is not None else ""
    return ConfigError(
        f"model_type={model.config.model_type!r}: the Hugging Face plan cannot place {fqn!r}{kind}: {why}; "
        f"{custom_plan_hint(model)}"
    )


class PlanContext:
    """What translating one entry needs to know about the model."""

    def __init__(self, model: nn.Module, layers_pattern: str, embedding_fqn: str, output_fqn: str | None):
        self.model = model
        self.layers_pattern = layers_pattern
        self.structural = {embedding_fqn, output_fqn}
        self.depth = len(layers_pattern.split("."))

    def sublayer(self, fqn: str) -> str | None:
        """``layers.*.<sub>`` for an entry inside a decoder layer's child, else None."""
        atoms = fqn.split(".")
        if len(atoms) < self.depth + 2 or not fqn.startswith(f"{self.layers_pattern}."):
            return None
        return ".".join(atoms[: self.depth + 1])


def prefixed_plan(model: nn.Module, prefix: str) -> dict[str, str]:
    """The config's ``base_model_tp_plan`` (empty if none) with its patterns prefixed by the base model's FQN."""
    hf_plan = getattr(model.config, "base_model_tp_plan", None) or {}
    return {f"{prefix}.{pattern}" if prefix else pattern: kind for pattern, kind in hf_plan.items()}


def _base_plan(model: nn.Module, prefix: str, overrides: Mapping) -> dict[str, str]:
    plan = prefixed_plan(model, prefix)
    if not plan and not overrides:
        raise ConfigError(
            f"model_type={model.config.model_type!r} has no base_model_tp_plan in its transformers config, so "
            f"there is no tensor-parallel plan to translate; {custom_plan_hint(model)}"
        )
    return plan


def _matches(model: nn.Module, pattern: str) -> tuple[nn.Module | None, bool]:
    """The first module ``pattern`` matches, and whether it matches a parameter instead."""
    module = next((m for _, m in matching_modules(model, pattern)), None)
    is_param = module is None and any(fqn_matches(name, pattern) for name, _ in model.named_parameters())
    return module, is_param


def _refuse_first(model: nn.Module, plan: dict[str, str]) -> None:
    """Raise for the first refused style, MoE / MLA first (their reason is the real one), naming the module."""
    ranked = sorted(plan.items(), key=lambda kv: kv[1] not in _MOE_FIRST)
    for fqn, kind in ranked:
        module, is_param = _matches(model, fqn)
        if module is None and not is_param:
            continue
        if kind in ("packed_colwise", "packed_rowwise") and isinstance(module, nn.Linear):
            raise unplaceable(
                model,
                fqn,
                module,
                f"{kind!r} on an nn.Linear is not translated (each rank would "
                "need its slice of every packed part); its colwise_gather_output translation, "
                "ColwiseParallel(output_layouts=Replicate()), is exact",
            )
        if kind in REFUSED:
            raise unplaceable(model, fqn, module, f"its base_model_tp_plan style {kind!r}: {REFUSED[kind]}")
        if kind not in STYLES:
            raise unplaceable(
                model,
                fqn,
                module,
                f"its base_model_tp_plan style {kind!r} is unknown to ndparallel (known: "
                f"{sorted(STYLES)}; refused: {sorted(REFUSED)})",
            )
        if is_param:
            raise unplaceable(model, fqn, None, f"{kind!r} on a bare parameter: ndparallel places modules")


def _translate(ctx: PlanContext, fqn: str, kind: str, module: nn.Module, gathered: bool) -> ParallelStyle | None:
    """One base-plan entry as a DTensor style (None: nothing to do), or a ConfigError naming it."""
    model = ctx.model
    if fqn in ctx.structural:
        return None  # the input embedding / lm_head: ndparallel's own placement (exact for every style here)
    sub = ctx.sublayer(fqn)
    if sub is None:
        raise unplaceable(
            model,
            fqn,
            module,
            f"{kind!r} outside a decoder layer's sublayer: the sequence-parallel table has no place for it",
        )
    if kind in ("colwise", "colwise_gather_output", "rowwise", "rowwise_split_input"):
        if not isinstance(module, nn.Linear):
            raise unplaceable(model, fqn, module, f"{kind!r} shards an nn.Linear, and this is not one")
    if kind == "colwise":
        return ColwiseParallel()
    if kind == "colwise_gather_output":
        return ColwiseParallel(output_layouts=Replicate())
    if kind in _ROWWISE:
        if len(fqn.split(".")) != ctx.depth + 2:
            raise unplaceable(
                model,
                fqn,
                module,
                f"{kind!r} below the sublayer's children: ndparallel reduce-"
                "scatters only a sublayer's last projection into sequence shards",
            )
        inputs = Replicate() if kind == "rowwise_split_input" else Shard(-1)
        return RowwiseParallel(input_layouts=inputs, output_layouts=Shard(1))
    if kind in ("embedding_rowwise", "embedding_colwise"):
        if not isinstance(module, nn.Embedding):
            raise unplaceable(model, fqn, module, f"{kind!r} shards an nn.Embedding, and this is not one")
        style = RowwiseParallel if kind == "embedding_rowwise" else ColwiseParallel
        return style(input_layouts=Replicate(), output_layouts=Replicate())
    if kind == "replicate":
        if not gathered:
            raise unplaceable(
                model,
                fqn,
                module,
                "'replicate' inside a sublayer whose inputs are sharded: its gradients would differ per rank",
            )
        return ReplicatedCompute()
    # replicated_with_grad_allreduce
    params = list(module.parameters())
    if not params:
        return None  # a norm without a scale: nothing to shard or sum
    if list(module.children()) or any(p.dim() != 1 for p in params):
        raise unplaceable(
            model,
            fqn,
            module,
            "'replicated_with_grad_allreduce' on a module that is not a norm (a leaf with 1-D parameters)",
        )
    return PerShardNorm()


def linear_entries(
    ctx: PlanContext, prefix: str, overrides: Mapping[str, ParallelStyle | None]
) -> dict[str, ParallelStyle | None]:
    """The entries of the base plan, translated; an entry in ``overrides`` (prefixed FQN pattern) replaces the
    translation of that pattern. Base entries matching nothing in this instance are left out."""
    model = ctx.model
    plan = {fqn: kind for fqn, kind in _base_plan(model, prefix, overrides).items() if fqn not in overrides}
    _refuse_first(model, plan)
    by_sub: dict[str, set[str]] = {}
    for fqn, kind in plan.items():
        sub = ctx.sublayer(fqn)
        if sub is not None and _matches(model, fqn)[0] is not None:
            by_sub.setdefault(sub, set()).add(kind)
    entries: dict[str, ParallelStyle | None] = {}
    exits: dict[str, str] = {}
    for fqn, kind in plan.items():
        module, _ = _matches(model, fqn)
        if module is None:
            continue
        sub = ctx.sublayer(fqn)
        if kind in _ROWWISE and fqn not in ctx.structural and sub is not None:
            if sub in exits:
                raise unplaceable(
                    model,
                    fqn,
                    module,
                    f"a second rowwise projection in {sub!r} (after "
                    f"{exits[sub]!r}): ndparallel reduce-scatters one exit per sublayer",
                )
            exits[sub] = fqn
        style = _translate(ctx, fqn, kind, module, by_sub.get(sub or "", set()) <= _GATHERED)
        if style is not None:
            entries[fqn] = style
    entries.update(overrides)
    for sub, kinds in by_sub.items():
        if kinds <= _GATHERED:
            entries.update(_replicated_inside(model, sub, entries))
    return entries


def _replicated_inside(model: nn.Module, sub: str, entries: Mapping) -> dict[str, ParallelStyle]:
    """The parameter-holding leaves of a gathered sublayer no entry covers: they compute on replicated inputs."""
    extra = {}
    for name, module in matching_modules(model, sub):
        for child, leaf in module.named_modules():
            if not child or list(leaf.children()) or not list(leaf.parameters(recurse=False)):
                continue
            pattern = f"{sub}.{child}"
            if not any(fqn_matches(f"{name}.{child}", p) for p in entries):
                extra[pattern] = ReplicatedCompute()
        break  # the layers share one structure: the first matching sublayer names the patterns
    return extra
