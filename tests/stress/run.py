"""``make stress``: the multi-process test groups and real launches, repeatedly, under load; counts native crashes.

Each round runs (1) ``pytest -n 2`` on the multi-process test files (``--tests``; default: the exit teardown,
the mesh harness and the Accelerate example, whose ``all_reduce(op=AVG)`` once segfaulted) and (2) ``--launches``
real ``ndparallel launch --cpu-ranks 2`` jobs of tests/stress/exit_job.py and of the transformers Trainer
(tests/accelerator/trainer_job.py, 2 runs a job), while ``--burners`` processes spin on the CPU. A native crash
is any ``terminate called``, ``Fatal Python error``, ``Segmentation fault``, SIGSEGV or SIGABRT in a job's output,
or a negative exit code; a job whose ranks all finished must exit 0. Prints one JSON line per round and a
summary; exit 1 on any crash or failure. ``python -m tests.stress.run --rounds 20`` (docs/troubleshooting.md).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NATIVE = re.compile(r"terminate called|Fatal Python error|Segmentation fault|SIGSEGV|SIGABRT|exit code -\d+")
DEFAULT_TESTS = [
    "tests/distributed/test_exit_teardown.py",
    "tests/distributed/test_mesh_and_harness.py",
    "tests/accelerator/test_nd_parallel_example.py",
]


def _burn() -> None:
    while True:
        pass


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _run(argv: list[str], cwd: Path, timeout: float) -> dict:
    start = time.monotonic()
    try:
        done = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
        rc, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        rc, out = "timeout", f"{err.stdout or ''}{err.stderr or ''}"
    native = sorted(set(NATIVE.findall(out if isinstance(out, str) else out.decode(errors="replace"))))
    return {"rc": rc, "native": native, "s": round(time.monotonic() - start), "tail": out[-1500:] if rc else ""}


def _trainer_model(folder: Path) -> None:
    subprocess.run([sys.executable, "-c", _TINY_LLAMA, str(folder)], check=True, env=_env(), cwd=REPO)


_TINY_LLAMA = """
import sys, torch, transformers
config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
torch.manual_seed(0)
transformers.AutoModelForCausalLM.from_config(config).double().save_pretrained(sys.argv[1])
"""


def _launches(count: int, work: Path, timeout: float) -> list[dict]:
    command = [sys.executable, "-m", "ndparallel", "launch", "--cpu-ranks", "2", "--"]
    jobs = []
    for i in range(count):
        if i % 2 == 0:
            jobs.append(("exit_job", _run([*command, str(REPO / "tests/stress/exit_job.py")], REPO, timeout)))
            continue
        out = work / f"trainer-{i}"
        runs = [
            {"out": str(out / "a"), "sizes": {"dp_shard_size": 2}, "steps": 2},
            {"out": str(out / "b"), "sizes": {"tp_size": 2}, "steps": 2, "save_steps": 2},
        ]
        job = [*command, str(REPO / "tests/accelerator/trainer_job.py"), str(work / "llama"), json.dumps(runs)]
        jobs.append(("trainer", _run(job, REPO, timeout)))
    return [{"job": name, **result} for name, result in jobs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=int(os.environ.get("STRESS_ROUNDS", "20")))
    parser.add_argument("--launches", type=int, default=4, help="real launches a round (exit job / Trainer)")
    parser.add_argument("--tests", nargs="*", default=DEFAULT_TESTS, help="test files for pytest -n 2 ([] none)")
    parser.add_argument("--burners", type=int, default=1, help="CPU-spinning processes beside the work")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    burners = [mp.Process(target=_burn, daemon=True) for _ in range(args.burners)]
    for burner in burners:
        burner.start()
    totals = {"rounds": 0, "pytest_runs": 0, "launches": 0, "native_crashes": 0, "failures": 0}
    try:
        with tempfile.TemporaryDirectory(prefix="ndp-stress-") as tmp:
            work = Path(tmp)
            if args.launches > 1:
                _trainer_model(work / "llama")
            for round_ in range(1, args.rounds + 1):
                results = _launches(args.launches, work, args.timeout)
                if args.tests:
                    pytest = [
                        sys.executable,
                        "-m",
                        "pytest",
                        "-q",
                        "-n",
                        "2",
                        "-p",
                        "no:cacheprovider",
                        "-m",
                        "not zoo",
                    ]
                    pytest += args.tests  # -m: every tier of those files, the jobs and slow ones included
                    results.append({"job": "pytest", **_run(pytest, REPO, args.timeout)})
                    totals["pytest_runs"] += 1
                totals["rounds"] += 1
                totals["launches"] += args.launches
                totals["native_crashes"] += sum(bool(r["native"]) or _signalled(r["rc"]) for r in results)
                totals["failures"] += sum(r["rc"] != 0 for r in results)
                print(json.dumps({"round": round_, "jobs": results}), flush=True)
    finally:
        for burner in burners:
            burner.kill()
    print(json.dumps({"summary": totals}), flush=True)
    return 0 if totals["native_crashes"] == totals["failures"] == 0 else 1


def _signalled(rc: int | str) -> bool:
    return isinstance(rc, int) and (rc < 0 or rc in (134, 139))


if __name__ == "__main__":
    sys.exit(main())
