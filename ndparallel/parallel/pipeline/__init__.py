"""Pipeline parallelism: the model cut into stages along its blocks, run by torch's schedules over ``mesh["pp"]``.

``build_pipeline(model, cfg, mesh) -> Pipeline`` (docs/pipeline-parallel.md). One module per concept:
``split`` (which blocks each stage holds), ``placement`` (which stages a rank holds), ``stages`` (stage
modules, parallelised on the mesh without pp), ``torch_api`` (torch's stage and schedule classes),
``runtime`` (the step: loss, context parallel buffers, replicate sync, shape guard), ``build``.
"""

from ndparallel.parallel.pipeline.build import build_pipeline
from ndparallel.parallel.pipeline.placement import last_stage_rank, stage_ids
from ndparallel.parallel.pipeline.runtime import Pipeline
from ndparallel.parallel.pipeline.split import balanced_split, stage_ranges

__all__ = ["Pipeline", "balanced_split", "build_pipeline", "last_stage_rank", "stage_ids", "stage_ranges"]
