"""Pipeline stages' shape exchange without the peers: what each stage would receive, from one process.

On its first step a torch ``PipelineStage`` learns its input shapes from the previous stage (a pickled object
sent point to point) and its output gradients' shapes from the next one. On the fake process group nothing
arrives, so the dry run answers instead (:class:`StageMailbox`, one per dry run, its pp ranks run in order):

- forward: the metadata the previous stage sent, kept when that stage ran (pp ranks run from 0 up); for a stage
  whose sender has not run yet (interleaved schedules) the last one sent: every stage boundary of a decoder
  carries the same hidden-state tensor (a model whose boundaries differ is a named limit, docs/planning.md);
- backward: gradients shaped like the stage's own outputs (a gradient has its tensor's shape).

The exchange happens in the first step only, before the first micro-batch: :func:`after_shape_inference` tells
when the step proper starts (the measurement begins there, in a dry run and on real ranks alike).
"""

from __future__ import annotations

import pickle
import types
from collections.abc import Callable
from typing import Any

from ndparallel.dryrun.torch_api import backward_meta, pipeline_stages
from ndparallel.errors import ConfigError

__all__ = ["StageMailbox", "after_shape_inference"]


def after_shape_inference(schedule: Any, callback: Callable[[], None]) -> None:
    """Call ``callback()`` once, when the schedule's first micro-batch starts (its shapes then inferred):
    ``PipelineStage.forward_one_chunk`` of each stage, wrapped on the instance."""
    called = False
    for stage in pipeline_stages(schedule):
        original = stage.forward_one_chunk

        def forward_one_chunk(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            nonlocal called
            if not called:
                called = True
                callback()
            return _original(*args, **kwargs)

        stage.forward_one_chunk = forward_one_chunk


class StageMailbox:
    """Forward metadata by receiving stage; installed on a schedule's stages by :meth:`attach`."""

    def __init__(self) -> None:
        self.forward: dict[int, Any] = {}
        self.last: Any = None

    def attach(self, schedule: Any) -> None:
        for stage in pipeline_stages(schedule):
            stage._send_meta = types.MethodType(self._send, stage)  # instance attributes: this run's stages only
            stage._recv_meta = types.MethodType(self._receive, stage)

    def _send(self, mailbox_stage: Any, meta: Any, dst_stage: int) -> None:
        sent = pickle.dumps(meta)  # what torch sends; keeping the object itself would keep the stage's outputs
        if not hasattr(meta, "backward_metas"):
            self.forward[dst_stage] = self.last = pickle.loads(sent)  # noqa: S301 (our own bytes)

    def _receive(self, stage: Any, src_stage: int) -> Any:
        if src_stage > stage.stage_index:  # gradients of this stage's outputs
            return backward_meta(stage._stage_meta.outputs)
        meta = self.forward.get(stage.stage_index, self.last)
        if meta is None:
            raise ConfigError(
                f"dry run: pipeline stage {stage.stage_index} has no input shapes (no earlier stage ran): dry-run "
                "the pp ranks in order from 0"
            )
        return meta
