"""Pipeline bubble on CPU: step time of pp 2 with m = 2, 4, 8 micro-batches against the cost model.

    PYTHONPATH=$PWD python -m benchmarks.pp_bubble

Times are the fastest of the steps after the first (the step least disturbed by other processes on a shared
machine). The no-bubble reference is one process running the whole model forward + backward on the same
local batch (1 thread), halved: what each of 2 stages would take if it never waited. Predicted step =
ideal / (1 - bubble), bubble = (p-1)/(m+p-1) (ndparallel.estimate.pipeline.bubble_fraction). Every schedule
and m runs in this one invocation, side by side. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import os
import platform
import time

import torch
import torch.nn.functional as F

from ndparallel.bench.pipeline import PipelineRun, measure_pipeline
from ndparallel.estimate import MeshShape
from ndparallel.estimate.pipeline import bubble_fraction
from ndparallel.testing import run_distributed

MODEL = dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=512, vocab_size=128, max_seq_len=128,
             dtype="float32")  # fmt: skip
BATCH, SEQ, STEPS = 16, 128, 8


def whole_model_step_s() -> float:
    """One process, 1 thread: forward + backward of the whole model on the batch (median of STEPS - 1)."""
    from ndparallel.models import Transformer, TransformerConfig

    torch.set_num_threads(1)
    model = Transformer(TransformerConfig.from_dict(MODEL))
    data = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        F.cross_entropy(model(data[:, :-1]).flatten(0, 1), data[:, 1:].flatten()).backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return min(times[1:])


def main() -> None:
    load = os.getloadavg()[0]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load average {load:.1f}, torch {torch.__version__}, "
          "1 thread per rank")  # fmt: skip
    ideal = whole_model_step_s() / 2
    print(f"whole model fwd+bwd, 1 process: {2 * ideal:.3f} s -> ideal pp2 step {ideal:.3f} s")
    print(
        "| schedule | m | measured step s | predicted s | measured / predicted | bubble (model) | bubble (measured) |"
    )
    print("|---|---|---|---|---|---|---|")
    for m in (2, 4, 8):
        for schedule in ("gpipe", "1f1b"):
            run = PipelineRun(MODEL, {"pp": 2}, schedule, m, batch=BATCH, seq=SEQ, steps=STEPS, track_memory=False)
            measured = max(r["min_step_s"] for r in run_distributed(measure_pipeline, 2, run, timeout=600))
            bubble = bubble_fraction(MeshShape(pp=2, pp_schedule=schedule), m)
            predicted = ideal / (1 - bubble)
            print(f"| {schedule} | {m} | {measured:.3f} | {predicted:.3f} | {measured / predicted:.2f} | "
                  f"{bubble:.2f} | {1 - ideal / measured:.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
