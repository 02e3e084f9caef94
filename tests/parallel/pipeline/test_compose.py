"""Pipeline parallelism composed with activation checkpointing, torch.compile, Ulysses / all-gather context
parallel and HSDP, against one plain PyTorch process in float64 (docs/pipeline-parallel.md, "Composition
order").

The reference, the training loop and the bound are tests/parallel/pipeline/test_parity.py's (5 AdamW steps, clipping
active on every step, losses, clipped norms, step-1 gradients and final parameters within ``TOL``). Each
case also proves its feature ran: checkpointed blocks recompute their forward in backward (counted), compiled
stages produce dynamo graphs, HSDP stages shard on a 2-D (dp_replicate, dp_shard_cp) FSDP mesh.
"""

from __future__ import annotations

from collections import Counter

import pytest

import tests.parallel.pipeline.test_parity as parity
from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.config.pipeline import torch_compiles_pipeline_stages
from ndparallel.errors import ConfigError
from ndparallel.testing import run_distributed
from tests.parallel.pipeline.test_parity import STEPS, _check, _transformer_reference

M = 4  # micro-batches per step in the 2- and 4-rank cases


def _mesh_for(cfg) -> None:
    """Drop parity's cached mesh of these sizes when its cp settings differ: the mesh's settings shard inputs."""
    key = tuple(cfg.sizes.values())
    held = parity._MESHES.get(key)
    if held is not None and held.config.cp_rotate_method != cfg.cp_rotate_method:
        del parity._MESHES[key]


def _run_compose(cases: list[dict], refs: dict) -> list[dict]:
    """parity._run_case for each case, plus what shows the feature ran on this rank."""
    import torch
    from torch.nn.modules.module import register_module_forward_hook

    from ndparallel.config.parallelism import ParallelismConfig

    out = []
    for case in cases:
        cfg = ParallelismConfig(**case["parallel"])
        _mesh_for(cfg)
        calls: Counter = Counter()
        hook = None
        if cfg.compile == "none":  # a global hook would be traced into compiled graphs: eager cases only
            hook = register_module_forward_hook(lambda m, a, o, calls=calls: calls.update([type(m).__name__]))
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        try:
            result = parity._run_case(case, refs[case.get("ref", "float64")])
        finally:
            if hook is not None:
                hook.remove()
        fsdp = parity._MESHES[tuple(cfg.sizes.values())].without_pp().fsdp
        result["attention_calls"] = calls["Attention"]
        result["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        result["fsdp_dims"] = None if fsdp is None else fsdp.mesh_dim_names
        out.append(result)
    return out


@pytest.fixture(scope="module")
def refs() -> dict:
    return {"float64": _transformer_reference("float64")}


def _blocks(result: dict) -> list[int]:
    """The block indices this rank's stages hold (from the parameter names ``layers.<i>.``)."""
    return sorted({int(n.split(".")[1]) for n in result["names"] if n.startswith("layers.")})


def test_pp2_activation_checkpointing_matches_one_process(refs):
    cases = [
        {"parallel": {"pp_size": 2, "pp_schedule": schedule, "activation_checkpointing": mode}}
        for schedule in ("1f1b", "interleaved_zb")  # interleaved_zb: backward split into input and weight halves
        for mode in ("none", "full", "selective")
    ]
    results = run_distributed(_run_compose, 2, cases, refs, timeout=600)
    _check(results, cases, refs)
    # selective checkpoints every other block of each stage, from its first: 1f1b's one stage of 2 blocks per
    # rank -> 1 block; interleaved_zb's 2 stages of 1 block per rank -> both (selective is full there)
    selective_blocks = {0: 1, 3: 2}
    for rank in results:
        for base in (0, 3):  # each schedule's none, full, selective
            blocks = len(_blocks(rank[base]))
            calls = [rank[base + i]["attention_calls"] for i in range(3)]
            full, selective = calls[1] - calls[0], calls[2] - calls[0]
            if base == 0:  # 1f1b: one recompute per checkpointed block and micro-batch (+1 on torch >= 2.12: the
                # last stage's backward shape inference at the first step; torch 2.11 has none)
                last = "output.weight" in rank[base]["names"]
                per_step = [STEPS * M, STEPS * M + 1] if last else [STEPS * M]
                expected = [(per * blocks, per * selective_blocks[base]) for per in per_step]
                assert (full, selective) in expected, calls
            else:  # interleaved_zb recomputes more often (measured 221 and 402 for 2 blocks x 20 micro-batches)
                assert full >= STEPS * M * blocks and selective == full, calls


@pytest.mark.slow  # inductor builds C++ kernels: 22-97 s with a warm cache, 207 s cold (2 loaded cores)
def test_pp2_compile_matches_one_process(refs):
    # compile=model only, on 1f1b: compiling dominates the time (a cold inductor cache, as in CI, costs minutes).
    # It compiles each stage module, the composition pp adds; compile=blocks compiles the same blocks as without
    # pp (tests/parallel/test_parallelize.py) and was measured exact under pp too (docs/pipeline-parallel.md).
    cases = [{"parallel": {"pp_size": 2, "pp_schedule": "1f1b", "compile": "model"}}]
    if not torch_compiles_pipeline_stages():  # torch 2.11: refused by name (tests/config/test_pipeline_config.py)
        with pytest.raises(ConfigError, match="needs torch >= 2.12"):
            ParallelismConfig(**cases[0]["parallel"])
        return
    results = run_distributed(_run_compose, 2, cases, refs, timeout=900)
    _check(results, cases, refs)
    for rank in results:
        assert all(r["graphs"] > 0 for r in rank), [r["graphs"] for r in rank]  # dynamo compiled the stages


@pytest.mark.slow
def test_pp2_cp2_ulysses_and_allgather_match_one_process(refs):
    cases = [
        {"parallel": {"pp_size": 2, "cp_size": 2, "pp_schedule": schedule, "cp_rotate_method": method}}
        for method in ("alltoall", "allgather")
        for schedule in ("1f1b", "interleaved_zb")
    ]
    results = run_distributed(_run_compose, 4, cases, refs, timeout=600)
    _check(results, cases, refs)


@pytest.mark.slow
def test_pp2_hsdp_on_eight_ranks_matches_one_process(refs):
    hsdp = {"pp_size": 2, "dp_replicate_size": 2, "dp_shard_size": 2}
    cases = [  # 2 micro-batches: the per-rank batch is 8 / dp 4 = 2 with dp_shard, 4 with cp (cp is not dp)
        {"parallel": {**hsdp, "pp_schedule": "1f1b"}, "microbatches": 2},
        {"parallel": {**hsdp, "pp_schedule": "interleaved_zb"}, "microbatches": 2},
        {"parallel": {"pp_size": 2, "dp_replicate_size": 2, "cp_size": 2, "pp_schedule": "1f1b"}, "microbatches": 2},
    ]
    results = run_distributed(_run_compose, 8, cases, refs, timeout=600)
    _check(results, cases, refs)
    for rank in results:
        dims = [r["fsdp_dims"] for r in rank]  # HSDP: FSDP on a 2-D mesh (not the replicate path's all-reduce)
        assert dims == [("dp_replicate", "dp_shard")] * 2 + [("dp_replicate", "dp_shard_cp")], dims
