"""``ndparallel verify`` as a user runs it: the table on stdout, progress on stderr, the JSON, exit codes."""

from __future__ import annotations

import json

import pytest

from tests.command import run_ndparallel

pytestmark = pytest.mark.jobs  # real launchers, torchrun, CLI processes or signals: not in make test-fast


def test_verify_prints_the_table_writes_json_and_exits_1_on_a_failure(tmp_path):
    out = tmp_path / "verify.json"
    done = run_ndparallel(
        "verify",
        "--model",
        "tests.verify.toy:build_centered",
        "--tp-plan",
        "tests.verify.toy:PLAN",
        "--layouts",
        "dp_shard=2;tp=2;pp=2",
        "--cpu-ranks",
        "2",
        "--steps",
        "2",
        "--json",
        str(out),
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    assert "verify: 2 ranks: dp_shard=2, tp=2, pp=2" in done.stderr  # progress while it runs
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.split()}
    assert "FAIL" in lines["dp_shard=2"] and "pass" in lines["tp=2"] and "refused:" in lines["pp=2"]
    assert "verdict: FAIL" in done.stdout and "tolerance: float64 exactness bound" in done.stdout
    data = json.loads(out.read_text())
    assert data["ok"] is False and data["steps"] == 2
    assert [row["verdict"] for row in data["rows"]] == ["FAIL", "pass", "refused"]
    assert data["rows"][1]["errors"]["param"] < 1e-10


@pytest.mark.parametrize(
    "args, cause",
    [
        (["--layouts", "tp=8"], "layout tp=8 needs 8 ranks but --cpu-ranks is 4"),
        (["--model", "tests.verify.toy:build_flat"], "has no nn.ModuleList of blocks"),
        (["--model", "tests.verify.toy:build", "--shrink"], "--shrink applies to a preset or a Hugging Face config"),
    ],
)
def test_bad_input_is_one_line(args, cause):
    model = [] if "--model" in args else ["--model", "tiny"]
    done = run_ndparallel("verify", *model, *args, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1].startswith("ndparallel: error:")
    assert cause in done.stderr and "Traceback" not in done.stderr
