"""Pipeline bubble on CPU: step time of pp 2 with m = 2, 4, 8 micro-batches against the cost model.

    PYTHONPATH=$PWD python -m benchmarks.pp_bubble

The no-bubble reference is measured in the same ranks, alternating with the pipeline steps: each rank runs
its stage's forward + backward of all m micro-batches with no communication and no waiting (random stage
inputs and output gradients); ideal = the slower rank's time. Predicted step = ideal / (1 - bubble), bubble =
(p-1)/(m+p-1) (ndparallel.estimate.pipeline.bubble_fraction). Times are the fastest step after the first of
each (the step least disturbed by other processes on a shared machine). Every schedule and m runs in this
one invocation, side by side. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import os
import platform

import torch

from ndparallel.bench.pipeline import PipelineRun, measure_pipeline
from ndparallel.estimate import MeshShape
from ndparallel.estimate.pipeline import bubble_fraction
from ndparallel.testing import run_distributed

MODEL = dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=512, vocab_size=128, max_seq_len=128,
             dtype="float32")  # fmt: skip
BATCH, SEQ, STEPS = 16, 128, 8


def main() -> None:
    load = os.getloadavg()[0]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load average {load:.1f}, torch {torch.__version__}, "
          "1 thread per rank")  # fmt: skip
    print("| schedule | m | no-bubble step s | measured step s | predicted s | measured / predicted | bubble (model) "
          "| bubble (measured) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for m in (2, 4, 8):
        for schedule in ("gpipe", "1f1b"):
            run = PipelineRun(MODEL, {"pp": 2}, schedule, m, batch=BATCH, seq=SEQ, steps=STEPS, track_memory=False)
            ranks = run_distributed(measure_pipeline, 2, run, timeout=600)
            measured = max(r["min_step_s"] for r in ranks)
            ideal = max(r["compute_only_min_s"] for r in ranks)
            bubble = bubble_fraction(MeshShape(pp=2, pp_schedule=schedule), m)
            predicted = ideal / (1 - bubble)
            print(f"| {schedule} | {m} | {ideal:.3f} | {measured:.3f} | {predicted:.3f} | {measured / predicted:.2f} | "
                  f"{bubble:.2f} | {1 - ideal / measured:.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
