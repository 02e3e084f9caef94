"""The model-family protocol and its registry: what every floor may ask about a kind of model, with no planner.

A family answers two kinds of questions. :func:`ndparallel.parallelize` asks, in this order, and never anything
else about the model (it has no branch on a family)::

    matches(model)                     does this family claim the model?
    blocks(model)                      the transformer blocks: FSDP units, activation checkpointing, compile
    tp_plan(model)                     the TP + SP table {fqn_pattern: ParallelStyle}, when tp > 1
    check(model, cfg, mesh)            pre-flight refusals, raised before the model is touched
    moe_modules / moe_layers(model)    mixture-of-experts modules: global router statistics, expert parallel
    expert_count(layer)                (field, routed experts) of one MoE module: ep must divide it
    split_fields, heads_field          model.config fields tp must divide; the query heads Ulysses splits over cp
    fsdp_groups(model)                 FSDP units besides the blocks, as lists of FQNs
    apply_attention(model, mesh, cfg)  after TP: how tp/cp reach the attention (cp_attention, positions_arg)
    moe_tensor_parallel(model)         tp > 1 on an MoE: how tp splits it; None: tp > 1 on its MoE is refused
    apply_moe(model, layers, mesh)     after the attention: router statistics over dp x cp, experts over ep (and tp)
    pipeline_stage(model, ids, f, l)   pp > 1: a module holding blocks ``ids`` under the unsplit FQNs (plus the
                                       embedding when ``f``, the head when ``l``); stage_blocks(stage) its blocks
    compile_loss_head(model)           compile: blocks: compile the loss head too, if the family has one

The jobs (``ndparallel train``'s step, the Accelerator, the transformers Trainer on it) ask the rest, so that
they import no model family::

    loss_in_forward(model)             whether forward(..., labels=) returns the loss (a compiled loss head)
    router_loads / nonfinite_routers   after a step: each router's global tokens per expert; the routers whose
                                       logits held a NaN/inf (named when a step diverges)
    update_router_biases(model, rate)  after a step: move the balancing biases, reset the routers' counts
    on_prepared(model)                 what ``Accelerator.prepare`` adds to a prepared model (HF: save_pretrained)
    save_pretrained(model, folder)     the model's own folder format, full weights gathered (the Trainer's save)
    unreadable_weights(folder)         why that folder's weights cannot be read, or None (the Trainer's resume)

:class:`FamilyProtocol` holds the fields and every answer that needs no planner. ``apply_attention`` and
``apply_moe`` call planners, so their defaults live one step up, in :class:`ndparallel.parallel.family.ModelFamily`:
the class a family subclasses. Planners and jobs import only this module (docs/parallelize.md#model-families).

:func:`family_for` picks the family: the ones given to :func:`register_family` (newest first), then the built-in
families (registered by ``ndparallel.models.builtin``, which the first lookup imports: Hugging Face's), and
otherwise the default (the reference Transformer's), the answer for a model no family claims.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.distributed.mesh import Mesh
from ndparallel.errors import ConfigError
from ndparallel.parallel.fqn import fqn_matches

if TYPE_CHECKING:  # the types of two answers; this module calls no planner and imports no DTensor
    from torch.distributed.tensor.parallel import ParallelStyle

    from ndparallel.parallel.moe_tensor_parallel import MoETensorParallel

__all__ = [
    "FamilyProtocol",
    "block_list",
    "config_sizes",
    "family_for",
    "register_builtin_family",
    "register_family",
    "load_builtin_families_with",
    "registered_families",
]

# The user's families are asked first, then the built-in ones; the default answers for every model no family claims.
_REGISTERED: list[FamilyProtocol] = []
_BUILT_IN: list[FamilyProtocol] = []
_DEFAULT: list[FamilyProtocol] = []


def block_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The first ``nn.ModuleList`` of ``model`` and its FQN (the reference ``layers``, an HF ``model.layers``)."""
    return next(((name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)), None)


class FamilyProtocol:
    """Everything asked of one kind of model, with the defaults that need no planner.

    The defaults describe a generic decoder: blocks are the children of the first ``nn.ModuleList``, no TP
    table (``parallelize`` then needs ``tp_plan=``), no FSDP units besides the blocks and the root, no MoE
    tensor parallel, no router statistics, no folder format of its own. Subclass
    :class:`ndparallel.parallel.family.ModelFamily` (which adds ``apply_attention`` and ``apply_moe``).
    """

    name: str = "model"
    split_fields: tuple[str, ...] = ()  # model.config fields tp must divide (heads, kv heads, FFN width, vocab)
    heads_field: str | None = None  # model.config field with the query heads (Ulysses splits them over cp)
    cp_attention: tuple[type | str, ...] = ()  # classes or FQN patterns that cp replaces by ring attention
    # Mixture-of-experts modules (classes or FQN patterns) following the contract of ndparallel/parallel/
    # expert_parallel.py: router statistics over dp x cp, experts sharded over ep
    moe_modules: tuple[type | str, ...] = ()
    positions_arg: str = "positions"  # the forward argument that takes each token's global position
    pipeline_cp: bool = True  # whether pipeline stages of this family run context parallel (tested)
    # ParallelismConfig fields this family's pipeline stages are untested with under pp_size > 1:
    # build_pipeline refuses any set away from its default (a cp_* field only when cp_size > 1)
    pipeline_untested: tuple[str, ...] = ()
    label: str = "model"  # how refusals name a model of this family

    # ------------------------------------------------------------------ what parallelize asks

    def matches(self, model: nn.Module) -> bool:
        """Whether this family describes ``model``."""
        return False

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The transformer blocks, in order."""
        found = block_list(model)
        if found is None:
            raise ConfigError(
                f"{type(model).__name__} has no nn.ModuleList of blocks; pass blocks=[fqn, ...] or a predicate"
            )
        return list(found[1])

    def tp_plan(self, model: nn.Module) -> Mapping[str, ParallelStyle] | None:
        """The tensor + sequence parallel table (asked only when tp > 1); None: the caller must pass ``tp_plan=``."""
        return None

    def check(self, model: nn.Module, cfg: ParallelismConfig, mesh: Mesh) -> None:
        """Raise :class:`ConfigError` for what this family cannot do on ``mesh``, before the model is touched."""

    def moe_layers(self, model: nn.Module) -> list[nn.Module]:
        """The modules of ``model`` that ``moe_modules`` names, in ``named_modules`` order."""
        return [
            module
            for name, module in model.named_modules()
            if name
            and any(isinstance(module, t) if isinstance(t, type) else fqn_matches(name, t) for t in self.moe_modules)
        ]

    def expert_count(self, layer: nn.Module) -> tuple[str, int]:
        """The field that names one MoE module's routed experts, and their number (ep must divide it)."""
        return "n_experts", layer.experts.n_experts

    def moe_tensor_parallel(self, model: nn.Module) -> MoETensorParallel | None:
        """How tp splits this family's MoE modules (:mod:`ndparallel.parallel.moe_tensor_parallel`); None: tp > 1
        on its MoE models is refused by name."""
        return None

    def fsdp_groups(self, model: nn.Module) -> list[list[str]]:
        """FSDP units besides the blocks, as lists of FQNs (each list is one unit; the rest is the root unit)."""
        return []

    def apply_attention(self, model: nn.Module, mesh: Mesh, cfg: ParallelismConfig) -> nn.Module:
        """After TP, before activation checkpointing: route the attention through tp/cp; returns the model.
        Implemented (with the context-parallel planner) by :class:`ndparallel.parallel.family.ModelFamily`."""
        raise NotImplementedError(f"{type(self).__name__}: subclass ndparallel.parallel.family.ModelFamily")

    def apply_moe(self, model: nn.Module, moe_layers: Sequence[nn.Module], mesh: Mesh) -> None:
        """After the attention: the MoE modules' router statistics, experts over ep, MoE tensor parallel.
        Implemented (with the MoE planners) by :class:`ndparallel.parallel.family.ModelFamily`."""
        raise NotImplementedError(f"{type(self).__name__}: subclass ndparallel.parallel.family.ModelFamily")

    def pipeline_stage(self, model: nn.Module, block_ids: Sequence[int], first: bool, last: bool) -> nn.Module:
        """One pipeline stage of ``model``: blocks ``block_ids`` (an ``nn.ModuleDict`` keyed by the original
        index, so FQNs are the unsplit model's), the embedding when ``first``, the head when ``last``; its
        ``forward(x, <positions>)`` takes tokens on the first stage, hidden states elsewhere. Default: refused."""
        raise ConfigError(
            f"{type(model).__name__} (model family {self.name!r}) cannot be split into pipeline stages: the family "
            "has no pipeline_stage; use pp_size=1, or register a family that defines pipeline_stage"
        )

    def stage_blocks(self, stage: nn.Module) -> list[str]:
        """FQNs of the blocks of a stage from :meth:`pipeline_stage`: the children of its first ``nn.ModuleDict``."""
        name, blocks = next((n, m) for n, m in stage.named_modules() if isinstance(m, nn.ModuleDict))
        return [f"{name}.{key}" for key in blocks]

    def compile_loss_head(self, model: nn.Module) -> None:
        """Under ``compile: blocks``, after the blocks: compile the head that computes the loss (projection and
        cross entropy in one graph) when the model computes its loss in ``forward(..., labels)``.
        Default: nothing (the loss stays eager, on the logits)."""

    # ------------------------------------------------------------------ what the jobs ask

    def loss_in_forward(self, model: nn.Module) -> bool:
        """Whether ``model(x, positions, labels=y)`` returns the loss instead of the logits (the training step
        then passes labels). Default: the model's own ``loss_in_forward`` flag, False when it has none."""
        return bool(getattr(model, "loss_in_forward", False))

    def router_loads(self, model: nn.Module) -> list[torch.Tensor]:
        """Each router's tokens per expert (of the global batch) counted since the last
        :meth:`update_router_biases`, in module order. Default: none (the routers keep no counts)."""
        return []

    def nonfinite_routers(self, model: nn.Module) -> list[str]:
        """The FQNs of the routers whose logits held a NaN/inf since the last :meth:`update_router_biases`
        (this rank's). Default: none."""
        return []

    def update_router_biases(self, model: nn.Module, rate: float) -> None:
        """After an optimizer step: move each router's balancing bias by ``rate`` (0: only the reset), then reset
        the routers' counts and non-finite flags. Default: nothing to move or reset."""

    def on_prepared(self, model: nn.Module) -> None:
        """What ``Accelerator.prepare`` adds to a model it has parallelised (Hugging Face's: a ``save_pretrained``
        that gathers the shards). Default: nothing."""

    def save_pretrained(self, model: nn.Module, folder: str | os.PathLike) -> str | None:
        """Write ``model`` (sharded or not) in its own folder format, every rank calling; rank 0 writes and gets
        the folder. Default: refused (the family has no such format)."""
        raise ConfigError(
            f"{type(model).__name__} (model family {self.name!r}) has no pretrained folder format to save to; "
            "save a checkpoint (ndparallel.checkpoint.save) instead"
        )

    def unreadable_weights(self, folder: str | os.PathLike) -> str | None:
        """Why the weights in ``folder`` (this family's format) cannot be read, or None. Default: None."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def register_family(family: FamilyProtocol) -> FamilyProtocol:
    """Make ``parallelize`` use ``family`` for every model its ``matches`` accepts; asked before the built-in
    families, the last registered first. Registering the same object again moves it to the front."""
    if not isinstance(family, FamilyProtocol):
        raise ConfigError(f"register_family needs a ModelFamily instance, got {type(family).__name__}")
    if family in _REGISTERED:
        _REGISTERED.remove(family)
    _REGISTERED.append(family)
    return family


def register_builtin_family(family: FamilyProtocol, *, default: bool = False) -> None:
    """How a family folder under ``ndparallel/models/`` joins the lookup: asked after every family a user
    registered; ``default=True`` makes it the answer for a model no family claims. Families sit above the
    planners, so the planners never import one: ``ndparallel.models.builtin`` calls this when it is imported."""
    if default:
        _DEFAULT[:] = [family]
    elif family not in _BUILT_IN:
        _BUILT_IN.append(family)


_BUILT_IN_LOADERS: list[Callable[[], object]] = []


def load_builtin_families_with(loader: Callable[[], object]) -> None:
    """How the built-in families become known without this floor importing them: ``ndparallel``'s ``__init__``
    hands over a loader (importing ``ndparallel.models.builtin``, which registers them), called at the first lookup.
    ``import ndparallel`` itself stays light (the ``ndparallel`` command, a launched script's runner)."""
    _BUILT_IN_LOADERS.append(loader)


def registered_families() -> list[FamilyProtocol]:
    """Every family in the order :func:`family_for` asks them; the last is the default."""
    while _BUILT_IN_LOADERS:
        _BUILT_IN_LOADERS.pop(0)()
    return [*reversed(_REGISTERED), *_BUILT_IN, *(_DEFAULT or [FamilyProtocol()])]


def family_for(model: nn.Module) -> FamilyProtocol:
    """The family that describes ``model``: the first that matches, else the default (the reference Transformer's)."""
    families = registered_families()
    return next((family for family in families[:-1] if family.matches(model)), families[-1])


def _field(model: nn.Module, name: str | None) -> int | None:
    value = getattr(getattr(model, "config", None), name, None) if name else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def config_sizes(model: nn.Module, names: Sequence[str]) -> dict[str, int]:
    """The integer ``model.config`` fields among ``names`` that the model has."""
    return {name: value for name in names if (value := _field(model, name)) is not None}
