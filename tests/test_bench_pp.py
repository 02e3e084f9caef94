"""Pipeline-parallel bench cases: parsing, labels, refusals and the pipeline column (no ranks spawned).

On a build without ``ndparallel.pipeline`` a pp case must come back as an unmeasured row that says so,
never as a number; the rest of the sweep still runs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ndparallel.bench.case import pipeline_runtime_missing
from ndparallel.bench.harness import run_cases
from ndparallel.bench.report import format_table
from ndparallel.bench.sweep import cases_from_config, load_cases
from ndparallel.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _config(*shapes: dict) -> dict:
    return {
        "defaults": {"model": {"preset": "tiny"}, "seq_len": 16, "warmup": 0, "steps": 1},
        "sweeps": [{"name": "pipe", "global_batch": 8, "shapes": list(shapes)}],
    }


def test_scaling_yaml_compares_schedules_side_by_side():
    cases = load_cases(ROOT / "benchmarks" / "scaling.yaml", only=["pipeline"])
    labels = [c.label for c in cases]
    assert labels[:4] == ["single", "pp2_gpipe_m4", "pp2_1f1b_m4", "pp2_interleaved_1f1b_m4"]
    assert [c.world_size for c in cases] == [1, 2, 2, 2, 4, 4]  # pp ranks count in the world size
    gpipe = cases[1]
    assert gpipe.pipeline_shape().pp == 2 and gpipe.pipeline_shape().pp_schedule == "gpipe"


def test_pp_cases_the_trainer_would_refuse_are_refused_early():
    for shape, message in [
        ({"pp_size": 2, "pp_schedule": "1f1b", "pp_microbatches": 3}, "does not split over dp=1"),
        ({"pp_size": 4, "pp_schedule": "1f1b", "pp_microbatches": 2}, "pp_microbatches >= 4"),
        ({"pp_size": 2, "pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 4, "pp_microbatches": 4},
         "pp=2 x 4 stage(s) per rank > 2 blocks"),
        ({"pp_size": 2, "pp_schedule": "1f1b"}, "needs pp_microbatches"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(message)):
            cases_from_config(_config(shape))


def test_pp_case_without_the_runtime_is_reported_not_measured(capsys):
    if pipeline_runtime_missing() is None:
        pytest.skip("this build has ndparallel.pipeline: pp cases are measured for real (tests/test_bench.py)")
    (case,) = cases_from_config(_config({"pp_size": 2, "pp_schedule": "gpipe", "pp_microbatches": 4}))
    (result,) = run_cases([case], peak_flops=1e12)  # nothing is spawned for it
    assert "needs ndparallel.pipeline" in result.error and result.step_s == []
    assert result.pipeline == {"pp": 2, "schedule": "gpipe", "microbatches": 4, "stages_per_rank": 1, "bubble": 0.2}
    table = format_table([result])
    assert "pp2 gpipe m4 bubble 20%" in table and "not measured: needs ndparallel.pipeline" in table
    assert "not measured" in capsys.readouterr().out
