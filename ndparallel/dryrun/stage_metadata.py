"""Pipeline stages' shape exchange without the peers: what each stage would receive, from one process.

On its first step a torch ``PipelineStage`` learns its input shapes from the previous stage (a pickled object
sent point to point) and its output gradients' shapes from the next one. On the fake process group nothing
arrives, so the dry run answers instead (:class:`StageMailbox`, one per dry run, its pp ranks run in order):

- forward: the metadata the previous stage sent, kept when that stage ran (pp ranks run from 0 up); for a stage
  whose sender has not run yet (interleaved schedules) the last one sent: every stage boundary of a decoder
  carries the same hidden-state tensor (a model whose boundaries differ is a named limit, docs/planning.md);
- backward: gradients shaped like the stage's own outputs (a gradient has its tensor's shape).

The exchange happens in the first step only, before the first micro-batch: :func:`after_shape_inference` tells
when the step proper starts (the measurement begins there, in a dry run and on real ranks alike): after the
inference's cleanup, as a multi-stage schedule gathers its FSDP units before its first micro-batch.
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
    """Call ``callback()`` once, when the first step's shape inference is over: after the last stage's
    ``_post_metadata_inference_cleanup`` (torch's FSDP reshard after the inference), before the schedule's first
    action, which under multi-stage schedules is FSDP's unshard (all-gather) of the stages to come, not yet its
    first micro-batch; where torch has no such cleanup, at the first micro-batch (``forward_one_chunk``)."""
    stages = pipeline_stages(schedule)
    # torch's private PipelineStage._post_metadata_inference_cleanup (torch 2.13), wrapped on the instance
    hook = "_post_metadata_inference_cleanup" if all(hasattr(s, "_post_metadata_inference_cleanup") for s in stages) \
        else "forward_one_chunk"  # fmt: skip
    calls = 0
    for stage in stages:
        original = getattr(stage, hook)

        def wrapped(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            nonlocal calls
            if hook == "forward_one_chunk" and not calls:
                callback()
            out = _original(*args, **kwargs)
            calls += 1
            if hook != "forward_one_chunk" and calls == len(stages):
                callback()
            return out

        setattr(stage, hook, wrapped)  # instance attributes: this run's stages only


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
