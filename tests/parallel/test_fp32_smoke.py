"""fp32 smoke check: a few composed shapes in fp32 against one process, at ``tests.parity.FP32_TOL``.

float64 is the exactness proof (tests/parallel/test_parallelize.py, test_context_parallel.py, test_hf.py, ...);
fp32 shows the everyday dtype still trains like one process, within a bound measured on several CPU
kernel sets (docs/parallelize.md, "Numerical guarantees"). These tests carry the ``capability`` marker:
``make test`` runs them a second time under ``ATEN_CPU_CAPABILITY=default`` (the first pass uses the
machine's best kernels), together with two float64 shapes, so both bounds are checked on two kernel sets.

``python -m tests.parallel.test_fp32_smoke`` prints the measured differences (run it under each
``ATEN_CPU_CAPABILITY`` to reproduce the table in docs/parallelize.md).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest

from ndparallel.testing import run_distributed
from tests.parity import assert_parity, context_parallel_loss_fn, parity_error, reference, run_many

pytestmark = [pytest.mark.capability, pytest.mark.slow]

STEPS = 3
CP_DATA = {"lr": 1e-2, "global_batch": 8, "seq_len": 32}
RUNS = {
    "dp_shard2_tp2_clip_ac": (
        {"dp_shard_size": 2, "tp_size": 2, "activation_checkpointing": "full"},
        {"max_norm": 0.5},
    ),
    "hsdp2x2_accum2": ({"dp_replicate_size": 2, "dp_shard_size": 2}, {"grad_accum": 2}),
    "cp2_tp2": ({"cp_size": 2, "tp_size": 2}, {"loss_fn": context_parallel_loss_fn, **CP_DATA}),
    "dp_shard2_cp2_allgather_unbalanced": (
        {"dp_shard_size": 2, "cp_size": 2, "cp_rotate_method": "allgather", "cp_load_balance": False},
        {"loss_fn": context_parallel_loss_fn, **CP_DATA},
    ),
}
FLOAT64_RUNS = ("dp_shard2_tp2_clip_ac", "cp2_tp2")  # the exactness bound, on this pass's kernels too
HAS_HF = importlib.util.find_spec("transformers") is not None


def _runs() -> list[tuple[str, str, dict, dict]]:
    """(label, dtype, parallel, train_steps kwargs) for every run of the group."""
    runs = [(label, "float32", parallel, kwargs) for label, (parallel, kwargs) in RUNS.items()]
    runs += [(label, "float64", *RUNS[label]) for label in FLOAT64_RUNS]
    return runs


def _group() -> dict:
    """On every rank of the 4-rank group: the reference-model runs, then Qwen2 (tied embeddings) on dp 2 x tp 2."""
    import torch

    out = {"capability": torch.backends.cpu.get_cpu_capability()}
    out["runs"] = run_many([(p, {"steps": STEPS, "dtype": d, **k}) for _, d, p, k in _runs()])
    if HAS_HF:
        from tests.models.test_hf import MESHES
        from tests.models.test_hf import train as hf_train

        out["qwen2"] = hf_train("qwen2", MESHES["dp2_tp2"], steps=STEPS, dtype="float32")
    return out


@functools.cache
def _results() -> list[dict]:
    return run_distributed(_group, 4, timeout=600)


def _reference(dtype: str, kwargs: dict) -> dict:
    same = {k: v for k, v in kwargs.items() if k in ("max_norm", "lr", "global_batch", "seq_len")}
    return reference(steps=STEPS, dtype=dtype, **{"max_norm": None, **same})


def test_fp32_and_float64_parity_on_this_cpu_capability():
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    assert os.environ.get("ATEN_CPU_CAPABILITY", capability).upper() == capability, "torch ignored the variable"
    assert [r["capability"] for r in _results()] == [capability] * 4, "the ranks must run the same kernels"
    for i, (label, dtype, _, kwargs) in enumerate(_runs()):
        for rank, result in enumerate(_results()):
            got = result["runs"][i]
            assert got["dtype"] == dtype
            assert_parity(
                got, _reference(dtype, kwargs), label=f"{label} {dtype} rank {rank}", max_norm=kwargs.get("max_norm")
            )


@pytest.mark.skipif(not HAS_HF, reason="needs the hf extra: pip install 'ndparallel[hf]' (make test does)")
def test_fp32_hugging_face_qwen2_tp2():
    from tests.models.test_hf import STEPS as HF_STEPS
    from tests.models.test_hf import reference as hf_reference

    assert HF_STEPS == STEPS, "the one-process reference trains tests/models/test_hf.py's number of steps"
    ref = hf_reference("qwen2", "float32")
    for rank, result in enumerate(_results()):
        assert_parity(result["qwen2"], ref, label=f"qwen2 dp2_tp2 fp32 rank {rank}")


def measured_table() -> str:
    """Markdown rows of the measured differences on this machine's (or ATEN_CPU_CAPABILITY's) kernels."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    rows = []
    results = _results()
    for i, (label, dtype, _, kwargs) in enumerate(_runs()):
        err = max((parity_error(r["runs"][i], _reference(dtype, kwargs)) for r in results), key=lambda e: e["dloss"])
        rows.append((label, dtype, err))
    if HAS_HF:
        from tests.models.test_hf import reference as hf_reference

        ref = hf_reference("qwen2", "float32")
        err = max((parity_error(r["qwen2"], ref) for r in results), key=lambda e: e["dloss"])
        rows.append(("hf qwen2 dp2_tp2", "float32", err))
    return "\n".join(
        f"| {capability} | {label} | {dtype} | {e['dloss']:.1e} | {e['dnorm']:.1e} | {e['dgrad']:.1e} |"
        for label, dtype, e in rows
    )


if __name__ == "__main__":
    print(measured_table())
