"""One prepared optimizer over several pipeline stages, seen as one optimizer per stage for checkpoints.

``ndparallel.checkpoint.save``/``load`` take a rank's stage modules with one optimizer per module (format 3).
A rank of an interleaved or V schedule holds several stages but the script built one optimizer (and maybe an
LR scheduler over it), which must stay the object it steps. :func:`stage_views` gives, per stage, an
optimizer of the same class whose parameter groups are that stage's share of the prepared optimizer's groups
(same hyper-parameters) and whose state entries are the prepared optimizer's own (shared tensors);
:func:`merge_views` copies what a load put into the views back into the prepared optimizer.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from ndparallel.accelerator.stepping import GATE_ATTRIBUTE

__all__ = ["StageViews", "merge_views", "stage_views"]

StageViews = list[tuple[torch.optim.Optimizer, list[int]]]  # (view, index in the optimizer of each view group)


def stage_views(optimizer: torch.optim.Optimizer, stages: list[nn.Module]) -> StageViews:
    """Per stage: a view of ``optimizer`` over that stage's parameters (see the module doc)."""
    # Instance attributes: the gated step/zero_grad (stepping) and an LR scheduler's step counter wrap
    # the prepared optimizer itself; a view uses its class's methods.
    hidden = {"step", "zero_grad", GATE_ATTRIBUTE}
    views: StageViews = []
    for stage in stages:
        held = {id(p) for p in stage.parameters()}
        view = object.__new__(type(optimizer))
        view.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k not in hidden})
        groups, index = [], []
        for i, group in enumerate(optimizer.param_groups):
            params = [p for p in group["params"] if id(p) in held]
            if params:
                groups.append({**group, "params": params})
                index.append(i)
        view.param_groups = groups
        view.state = defaultdict(
            dict, {p: optimizer.state[p] for g in groups for p in g["params"] if p in optimizer.state}
        )
        views.append((view, index))
    return views


def merge_views(optimizer: torch.optim.Optimizer, views: StageViews) -> None:
    """Copy the views' state entries and hyper-parameters (after a load) into ``optimizer``."""
    for view, index in views:
        for group, i in zip(view.param_groups, index, strict=True):
            optimizer.param_groups[i].update({k: v for k, v in group.items() if k != "params"})
            for p in group["params"]:
                if p in view.state:
                    optimizer.state[p] = view.state[p]
