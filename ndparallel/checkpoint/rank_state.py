"""A rank's share of the training state: one module or several (pipeline stages), one optimizer per module.

A rank may hold several pipeline stages (interleaved and V schedules), each an ``nn.Module`` with
its own optimizer. Stage modules keep the unsplit model's FQNs (``layers.5.attention.wq.weight``),
so the state dicts of a rank's modules merge without clashes, and the same key names come out on
every pp size and in one process: that is what lets DCP reshard a checkpoint across pp sizes.

The optimizer state is taken **flattened** (torch's ``flatten_optimizer_state_dict``): one entry per
parameter, ``state.<fqn>.<name>`` and ``param_groups.<fqn>.<hyper-parameter>``. A nested
``param_groups`` list is one object numbered by group, which cannot be split between ranks that
hold different parameters; the flat form can (format version 3). :func:`flatten_nested_optimizer`
reads the nested form written by versions 1 and 2.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ndparallel.checkpoint.format import TENSOR_MARK, TUPLE_MARK, join_state
from ndparallel.errors import CheckpointError
from ndparallel.parallel.pipeline.tied import copy_names

__all__ = [
    "RankState",
    "as_modules",
    "as_optimizers",
    "flatten_nested_optimizer",
    "is_hyper_parameter",
    "set_rank_state",
]

ModelArg = nn.Module | Sequence[nn.Module]
OptimizerArg = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
_PARAM_GROUPS = "param_groups."


def as_modules(model: ModelArg) -> list[nn.Module]:
    """``model`` as a list of modules (one module, or a rank's pipeline stages in order)."""
    modules = [model] if isinstance(model, nn.Module) else list(model)
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise CheckpointError(
            f"model must be an nn.Module or a non-empty sequence of them (this rank's pipeline stages), "
            f"got {type(model).__name__}"
        )
    return modules


def as_optimizers(optimizer: OptimizerArg, n_modules: int) -> list[torch.optim.Optimizer] | None:
    """``optimizer`` as one optimizer per module, or None; a count that does not match is refused."""
    if optimizer is None:
        return None
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    if len(optimizers) != n_modules or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise CheckpointError(
            f"{n_modules} module(s) but {len(optimizers)} optimizer(s): pass one torch.optim.Optimizer per "
            "module (per pipeline stage), in the same order, or optimizer=None"
        )
    return optimizers


def _merge(into: dict[str, Any], part: dict[str, Any], what: str, index: int) -> list[str]:
    clash = sorted(set(into) & set(part))
    if clash:
        raise CheckpointError(
            f"module {index} repeats {what} key(s) {clash[:3]} of an earlier module: the modules of one rank "
            "(its pipeline stages) must hold different parameters under the unsplit model's names"
        )
    into.update(part)
    return list(part)


def _stored_key(key: str, copies: dict[str, str]) -> str:
    """The flat optimizer key ``key`` of a tied weight's copy (``state.lm_head.weight.exp_avg``) under the
    weight's own name (``state.model.embed_tokens.weight.exp_avg``): what one process stores."""
    for local, one in copies.items():
        for head in ("state.", _PARAM_GROUPS):
            if key.startswith(f"{head}{local}."):
                return f"{head}{one}.{key[len(head) + len(local) + 1 :]}"
    return key


@dataclass
class RankState:
    """The merged state dicts of a rank's modules (and optimizers), with each module's keys."""

    model: dict[str, Any] = field(default_factory=dict)
    model_keys: list[list[str]] = field(default_factory=list)
    optimizer: dict[str, Any] | None = None
    optimizer_keys: list[list[str]] = field(default_factory=list)
    """Each module's optimizer keys, as its optimizer names them (a tied copy under its local FQN)."""
    stored_as: dict[str, str] = field(default_factory=dict)
    """A tied copy's optimizer key -> the key ``optimizer`` holds it under (the weight's, as one process)."""
    param_groups: list[list[str]] = field(default_factory=list)
    """The FQNs of each parameter group of each optimizer (all optimizers' groups in one list)."""

    @classmethod
    def of(cls, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer] | None) -> RankState:
        """Collective under FSDP/DTensor. With optimizers, torch initialises the state of an optimizer
        that has none (a step with lr 0): call it only once the checkpoint is known to fit the model."""
        state = cls(optimizer=None if optimizers is None else {})
        for i, module in enumerate(modules):
            if optimizers is None:
                state.model_keys.append(_merge(state.model, get_model_state_dict(module), "model", i))
                continue
            model_sd, optim_sd = get_state_dict(module, optimizers[i], options=_FLAT)
            state.model_keys.append(_merge(state.model, model_sd, "model", i))
            # a weight tied across pipeline stages: its copies' optimizer states are equal, stored once under
            # the weight's name (two copies on this rank: the first kept)
            copies = copy_names(module)
            renamed = {k: _stored_key(k, copies) for k in optim_sd}
            state.stored_as.update((k, v) for k, v in renamed.items() if k != v)
            fresh = {renamed[k]: v for k, v in optim_sd.items() if k == renamed[k] or renamed[k] not in state.optimizer}
            _merge(state.optimizer, fresh, "optimizer", i)
            state.optimizer_keys.append(list(optim_sd))
            name_of = {id(p): copies.get(name, name) for name, p in module.named_parameters()}
            state.param_groups += [[name_of[id(p)] for p in g["params"]] for g in optimizers[i].param_groups]
        return state

    def check_groups(self, stored: dict[str, Any]) -> None:
        """The parameters of each live parameter group have equal stored hyper-parameters (torch refuses
        the load otherwise, after the model is loaded). Keys not stored are left to the fit check; a
        tensor hyper-parameter is compared by shape and dtype (its values are read later)."""

        def shown(fqn: str, name: str) -> str:
            entry = stored.get(f"{_PARAM_GROUPS}{fqn}.{name}")
            if isinstance(entry, dict) and TENSOR_MARK in entry:
                entry = {k: v for k, v in entry.items() if k != TENSOR_MARK}
            return json.dumps(entry)

        for fqns in filter(None, self.param_groups):
            prefix = f"{_PARAM_GROUPS}{fqns[0]}."
            names = [k[len(prefix) :] for k in self.optimizer or {} if k.startswith(prefix)]
            for name in names:
                if any(f"{_PARAM_GROUPS}{fqn}.{name}" not in stored for fqn in fqns):
                    continue  # reported by the fit check, which runs next
                values = {shown(fqn, name) for fqn in fqns}
                if len(values) > 1:
                    raise CheckpointError(
                        f"the checkpoint gives the parameters of one live parameter group (that of {fqns[0]!r}) "
                        f"different {name!r} values {sorted(values)[:3]}: group the parameters as they were saved"
                    )


def is_hyper_parameter(key: str) -> bool:
    """A flat optimizer key of a hyper-parameter (``param_groups.<fqn>.lr``), not of per-parameter state."""
    return key.startswith(_PARAM_GROUPS)


def set_rank_state(
    modules: list[nn.Module],
    optimizers: list[torch.optim.Optimizer] | None,
    live: RankState,
    skeleton: dict[str, Any],
    tensors: dict[str, torch.Tensor],
) -> None:
    """Put what DCP read (``tensors``, in the structure of the checkpoint's ``skeleton``) into each module
    and its optimizer, each getting exactly its own keys."""
    for i, module in enumerate(modules):
        model_sd = {k: join_state(skeleton["model"][k], tensors) for k in live.model_keys[i]}
        if optimizers is None:
            set_model_state_dict(module, model_sd, options=StateDictOptions(strict=True))
            continue
        optim_sd = {k: _read(k, live, skeleton, tensors) for k in live.optimizer_keys[i]}
        options = StateDictOptions(strict=True, flatten_optimizer_state_dict=True)
        set_state_dict(module, optimizers[i], model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)


def _read(key: str, live: RankState, skeleton: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
    """Optimizer entry ``key`` as read; a tied copy's is its own clone (never the other copy's tensor)."""
    value = join_state(skeleton["optimizer"][live.stored_as.get(key, key)], tensors)
    return value.clone() if key in live.stored_as and isinstance(value, torch.Tensor) else value


def _is_plain_dict(value: Any) -> bool:
    return isinstance(value, dict) and TENSOR_MARK not in value and TUPLE_MARK not in value


def _flatten_state(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if _is_plain_dict(value):  # nested per-parameter state (e.g. Shampoo), flattened as torch does
        for k, v in value.items():
            _flatten_state(f"{prefix}.{k}", v, out)
    else:
        out[prefix] = value


def flatten_nested_optimizer(section: Any) -> Any:
    """The optimizer section of a version 1/2 state JSON (``{"state": {fqn: {...}}, "param_groups": [...]}``)
    in the flat form of version 3. Tensor placeholders keep their DCP keys (``optimizer.state.<fqn>.<name>``
    is the same in both forms). A section already flat is returned as it is."""
    if not (isinstance(section, dict) and isinstance(section.get("param_groups"), list)):
        return section
    flat: dict[str, Any] = {}
    for fqn, entries in (section.get("state") or {}).items():
        _flatten_state(f"state.{fqn}", entries, flat)
    for group in section["param_groups"]:
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            raise CheckpointError("the optimizer's param_groups in the state JSON are malformed (no 'params' list)")
        for fqn in group["params"]:
            for k, v in group.items():
                if k != "params":
                    flat[f"{_PARAM_GROUPS}{fqn}.{k}"] = v
    return flat
