"""Pipeline-parallel bench cases: parsing, labels, refusals, the pipeline column, and one measured pp case.

One pp case is measured on real ranks; the rest needs no ranks.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ndparallel.bench.sweep import cases_from_config, load_cases
from ndparallel.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


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
        ({"pp_size": 2, "pp_schedule": "1f1b", "pp_microbatches": 3},
         "pp_microbatches=3 does not divide the per-rank batch 8"),
        ({"pp_size": 4, "pp_schedule": "1f1b", "pp_microbatches": 2}, "pp_microbatches=2 is fewer than the 4"),
        ({"pp_size": 2, "pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 4, "pp_microbatches": 4},
         "pp_size=2 x pp_stages_per_rank=4 = 8 pipeline stages but model.n_layers=2"),
        ({"pp_size": 2, "pp_schedule": "1f1b", "micro_batch": 8},
         "(set pp_microbatches, or a smaller train.micro_batch)"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(message)):
            cases_from_config(_config(shape))
    deferral_off = _config({"pp_size": 2, "dp_shard_size": 2, "pp_schedule": "1f1b", "pp_microbatches": 2})
    deferral_off["defaults"]["defer_grad_sync"] = False  # torch's stage always defers under FSDP: not honoured
    with pytest.raises(ConfigError, match=re.escape("defer_grad_sync=false cannot be honoured with pp_size=2")):
        cases_from_config(deferral_off)


def test_a_pp_case_is_measured_on_real_ranks_and_trains_like_one_rank():
    """The bench runs a pp case through ndparallel.parallel.pipeline and TrainStep: same losses as one rank (fp32, same
    seed and global batch), and the table shows the schedule."""
    from ndparallel.bench.harness import run_cases
    from ndparallel.bench.report import format_table

    config = _config({"label": "single"}, {"pp_size": 2, "pp_schedule": "gpipe", "pp_microbatches": 4})
    config["defaults"].update(steps=2, compute_twin=False)
    single, pipe = run_cases(cases_from_config(config), peak_flops=1e12, verbose=False)
    assert not pipe.error and len(pipe.losses) == 2, pipe.error
    assert pipe.losses == pytest.approx(single.losses, abs=1e-5)  # fp32; float64: pipeline/test_parity.py
    assert pipe.pipeline["schedule"] == "gpipe" and pipe.pipeline["microbatches"] == 4
    assert "pp2 gpipe m4" in format_table([single, pipe])
