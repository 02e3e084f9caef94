"""Pipeline parallelism: the model cut into stages along its blocks, run by torch's schedules over ``mesh["pp"]``.

``build_pipeline(model, cfg, mesh) -> Pipeline`` (docs/pipeline-parallel.md). One module per concept:
``split`` (which blocks each stage holds), ``placement`` (which stages a rank holds), ``stages`` (stage
modules, parallelised on the mesh without pp), ``torch_api`` (torch's stage and schedule classes),
``runtime`` (the step: loss, context parallel buffers, replicate sync, shape guard), ``build``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ndparallel.lazy import lazy_names

# Public name -> its module, imported on first use (PEP 562): the cost model reads ``placement`` and ``split``
# without the runtime's DTensor imports (the ``ndparallel train`` front process builds the plan parser).
_EXPORTS: dict[str, str] = {
    "build_pipeline": "ndparallel.parallel.pipeline.build",
    "last_stage_rank": "ndparallel.parallel.pipeline.placement",
    "stage_ids": "ndparallel.parallel.pipeline.placement",
    "Pipeline": "ndparallel.parallel.pipeline.runtime",
    "balanced_split": "ndparallel.parallel.pipeline.split",
    "stage_ranges": "ndparallel.parallel.pipeline.split",
}

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ imports each on first use
    from ndparallel.parallel.pipeline.build import build_pipeline
    from ndparallel.parallel.pipeline.placement import last_stage_rank, stage_ids
    from ndparallel.parallel.pipeline.runtime import Pipeline
    from ndparallel.parallel.pipeline.split import balanced_split, stage_ranges


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)


__all__ = ["Pipeline", "balanced_split", "build_pipeline", "last_stage_rank", "stage_ids", "stage_ranges"]
