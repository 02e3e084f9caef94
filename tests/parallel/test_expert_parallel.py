"""Expert parallel on 4 ranks, float64, against one process: ep 2 with the experts' FSDP over the other 2 ranks of
dp_shard (ep_fsdp 2), ep 4 (each rank owns one expert) with the sigmoid router, ep 2 x cp 2 (ep borrowing
from dp_shard x cp, ring attention) and ep 2 with HSDP; ep 2 in fp32 and bf16 within measured bounds; one 8-rank
group (HSDP x dp_shard 2 x tp 2 with ep 2, dp_shard 2 x cp 2 x tp 2 with ep 4). ep x tp and tp alone on 4 ranks.
Plus the mesh's ep views and the ep rules.

Each rank must hold only its own experts (n_experts / ep of them, never a replica), and the loss, grad norm
(clipped), step-1 gradients and parameters after 5 AdamW steps equal one process to 1e-10.
"""

from __future__ import annotations

import pytest

from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.distributed.mesh import format_rank_table, rank_groups
from ndparallel.errors import ConfigError
from tests.parallel.test_moe_parity import (
    COMMON,
    MODEL,
    SIGMOID,
    _reference,
    moe_cp_loss_fn,
    moe_loss_fn,
    param_error,
    print_worst,
)
from tests.parity import FLOAT64_TOL, assert_parity, run_cached

LAYOUTS = {
    "ep2 x ep_fsdp2": ({"dp_shard_size": 4, "ep_size": 2}, dict(model=MODEL, loss_fn=moe_loss_fn)),
    "ep4 sigmoid": ({"dp_shard_size": 4, "ep_size": 4}, dict(model=SIGMOID, loss_fn=moe_loss_fn)),
    # ep borrows from cp too: the ep ranks of dp_shard x cp, routed tokens from every cp shard
    "ep2 x cp2": ({"dp_shard_size": 2, "cp_size": 2, "ep_size": 2}, dict(model=MODEL, loss_fn=moe_cp_loss_fn)),
    # HSDP: the experts replicate over dp_replicate too, sharded over ep (ep_fsdp is 1)
    "ep2 hsdp": ({"dp_replicate_size": 2, "dp_shard_size": 2, "ep_size": 2}, dict(model=MODEL, loss_fn=moe_loss_fn)),
    # ep x tp: the experts sharded over (ep, tp), each ep group inside one tp index (docs/expert-parallel.md)
    "ep2 x tp2": ({"dp_shard_size": 2, "tp_size": 2, "ep_size": 2}, dict(model=MODEL, loss_fn=moe_loss_fn)),
    # tp without ep: every expert on every rank, its hidden width split over tp (the sigmoid router)
    "dp2 x tp2 sigmoid": ({"dp_shard_size": 2, "tp_size": 2}, dict(model=SIGMOID, loss_fn=moe_loss_fn)),
}
# Lower precision, against the fp32 one process. Measured (torch 2.13 CPU, 5 AdamW steps clipped at 0.5), worst
# rank: ep2 fp32 loss 9.5e-7, grad-norm rel 1.3e-7, step-1 grads 2.2e-8, params 1.3e-6 (FSDP 4 fp32: 4.8e-7,
# 6.8e-8, 2.2e-8, 1.3e-6); ep2 bf16 (FSDP's policy) 2.3e-4, 1.2e-3, 6.3e-4, 5.9e-3 (FSDP 4 bf16: 2.3e-4, 1.1e-3,
# 6.3e-4, 5.9e-3: ep adds nothing to bf16's rounding). Bounds 5-10x above.
F32 = dict(model=MODEL, loss_fn=moe_loss_fn, dtype="float32")
LOW_PRECISION = {
    "ep2 fp32": ({"dp_shard_size": 4, "ep_size": 2}, F32, dict(loss_tol=1e-5, norm_rtol=1e-5, grad_tol=1e-6), 1e-5),
    # the experts as torch's grouped GEMM (CPU fp32 kernel) on each owner's local experts
    "ep2 fp32 grouped_mm": (
        {"dp_shard_size": 4, "ep_size": 2},
        {**F32, "model": {**MODEL, "experts_impl": "grouped_mm"}},
        dict(loss_tol=1e-5, norm_rtol=1e-5, grad_tol=1e-6),
        1e-5,
    ),
    "ep2 bf16": (
        {"dp_shard_size": 4, "ep_size": 2, "mixed_precision": "bf16"},
        F32,
        dict(loss_tol=2e-3, norm_rtol=1e-2, grad_tol=5e-3),
        5e-2,
    ),
}
RUNS = {label: (parallel, {**COMMON, **kwargs}) for label, (parallel, kwargs) in LAYOUTS.items()}
RUNS |= {label: (parallel, {**COMMON, **kwargs}) for label, (parallel, kwargs, _, _) in LOW_PRECISION.items()}
# The fast tier's group: the two layouts that need 4 ranks to show (the experts' own FSDP, ep x tp); ep 2 alone is
# in test_moe_parity's 2-rank group. The other layouts and the fp32 / bf16 bounds are one `slow` group.
FAST = ("ep2 x ep_fsdp2", "ep2 x tp2")


def results(label: str) -> list[dict]:
    """``label``'s per-rank results, from its tier's 4-rank group (spawned once per pytest run)."""
    labels = [name for name in RUNS if (name in FAST) == (label in FAST)]
    per_rank = run_cached(4, [RUNS[name] for name in labels])
    return [rank[labels.index(label)] for rank in per_rank]


@pytest.mark.parametrize(
    "label", [name if name in FAST else pytest.param(name, marks=pytest.mark.slow) for name in LAYOUTS]
)
def test_expert_parallel_four_ranks_equals_one_process(label):
    parallel, kwargs = LAYOUTS[label]
    ref = _reference({**COMMON, **kwargs})
    ep, tp = parallel.get("ep_size", 1), parallel.get("tp_size", 1)
    ranks = results(label)
    for rank, got in enumerate(ranks):
        assert_parity(got, ref, label=f"{label} rank {rank}", max_norm=COMMON["max_norm"])
        assert param_error(got, ref) <= FLOAT64_TOL["grad_tol"], f"{label}: params after 5 steps differ"
        assert got["coordinate"].get("ep", 0) == (rank // tp) % ep, label
        dims, placements, local = got["layouts"]["layers.0.feed_forward.experts.w1"]
        if tp > 1:  # 4 experts [4, 32, 64]: 2 a rank (over ep, or FSDP's dp 2 without it), hidden width over tp
            want = ("ep_fsdp", "ep", "tp") if ep > 1 else ("dp_shard_cp", "tp")
            assert (dims, local) == (want, (2, 16, 64)) and placements[-1] == "S(1)", (label, dims, local)
            assert "R" not in placements, (label, placements)
            gate = got["layouts"]["layers.0.feed_forward.router.gate.weight"]
            assert gate[0][-1] == "tp" and gate[1][-1] == "R", (label, gate)  # the router: whole on each tp rank
            continue
        if parallel.get("dp_replicate_size", 1) > 1:  # replicated over ep_replicate only, as HSDP does
            assert dims == ("ep_replicate", "ep_fsdp", "ep") and placements[0] == "R", (label, dims, placements)
            assert placements[-1] == "S(0)" and local == (2, 32, 64), (label, placements, local)
            continue
        assert dims == ("ep_fsdp", "ep") and "R" not in placements, (label, dims, placements)
        assert placements[-1] == "S(0)" and local == (1, 32, 64), (label, placements, local)
    print_worst(label, ranks, ref)


@pytest.mark.slow
def test_expert_parallel_in_fp32_and_bf16_within_measured_bounds():
    for label, (_parallel, kwargs, tol, param_tol) in LOW_PRECISION.items():
        ref = _reference({**COMMON, **kwargs})
        ranks = results(label)
        for rank, got in enumerate(ranks):
            assert_parity(got, ref, label=f"{label} rank {rank}", max_norm=COMMON["max_norm"], **tol)
            assert param_error(got, ref) <= param_tol, label
        print_worst(label, ranks, ref)
    bf16 = results("ep2 bf16")[0]
    assert param_error(bf16, _reference({**COMMON, **F32})) > 1e-4  # bf16 really ran: it is not fp32


# One 8-rank group, two composed shapes: HSDP x tp with ep borrowing from dp_shard (the experts' HSDP over the 4-D
# (ep_replicate, ep_fsdp, ep, tp) mesh), and dp_shard x cp x tp with ep 4 borrowing all of dp_shard x cp (ring
# attention, the sigmoid router)
EIGHT = {
    "hsdp2 x dp_shard2 x tp2, ep2": (
        {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2, "ep_size": 2},
        dict(model=MODEL, loss_fn=moe_loss_fn),
        (("ep_replicate", "ep_fsdp", "ep", "tp"), (2, 16, 64)),  # 4 experts / ep 2, hidden 32 / tp 2
    ),
    "dp_shard2 x cp2 x tp2, ep4 sigmoid": (  # one expert a rank: a size-1 block (it once kept a strided view)
        {"dp_shard_size": 2, "cp_size": 2, "tp_size": 2, "ep_size": 4},
        dict(model=SIGMOID, loss_fn=moe_cp_loss_fn),
        (("ep_fsdp", "ep", "tp"), (1, 16, 64)),  # 4 experts / ep 4, hidden 32 / tp 2
    ),
}


@pytest.mark.slow
def test_expert_parallel_on_eight_ranks_composed_with_tp():
    results = run_cached(8, [(parallel, {**COMMON, **kwargs}) for parallel, kwargs, _ in EIGHT.values()])
    for index, (label, (_parallel, kwargs, (want_dims, want_local))) in enumerate(EIGHT.items()):
        ref = _reference({**COMMON, **kwargs})
        for rank, per_rank in enumerate(results):
            got = per_rank[index]
            assert_parity(got, ref, label=f"{label}, rank {rank}", max_norm=COMMON["max_norm"])
            assert param_error(got, ref) <= FLOAT64_TOL["grad_tol"], f"{label}: params after 5 steps differ"
            dims, placements, local = got["layouts"]["layers.0.feed_forward.experts.w1"]
            assert dims == want_dims and local == want_local, (label, dims, local)
            assert placements[-2:] == ("S(0)", "S(1)"), (label, placements)
        print_worst(label, [per_rank[index] for per_rank in results], ref)


def test_mesh_ep_views():
    cfg = ParallelismConfig(dp_shard_size=4, ep_size=2).resolve(4)
    groups = rank_groups(cfg)
    assert groups["ep"] == [[0, 1], [2, 3]]
    assert groups["ep_fsdp"] == [[0, 2], [1, 3]]
    table = format_rank_table(cfg)
    assert "ep (inner part of dp_shard_cp)" in table and "ep_fsdp (outer part of dp_shard_cp)" in table
    assert "(ep=2)" in cfg.describe()


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"dp_shard_size": 4, "ep_size": 3}, "ep_size=3 does not divide dp_shard_size x cp_size = 4"),
        ({"cp_size": 2, "dp_replicate_size": 2, "ep_size": 4}, "ep_size=4 does not divide dp_shard_size x cp_size = 2"),
    ],
)
def test_ep_mesh_rules(fields, message):
    with pytest.raises(ConfigError, match=message):
        ParallelismConfig(**fields).resolve(4)


def test_ep_size_from_sources():
    cfg = ParallelismConfig.from_sources({"parallelism": {"dp_shard_size": -1}}, {"NDP_EP_SIZE": "2"}, [])
    assert cfg.ep_size == 2 and cfg.resolve(4).dp_shard_size == 4
    assert ParallelismConfig.from_sources({}, {}, ["ep_size=4", "dp_shard_size=4"]).ep_size == 4
    with pytest.raises(ConfigError, match="ep_size=0 must be an integer >= 1"):
        ParallelismConfig(ep_size=0)


def test_moe_tensor_parallel_rules_name_the_field():
    from ndparallel.config.preflight import tp_fields_problem
    from ndparallel.models import Transformer, TransformerConfig
    from ndparallel.models.transformer.family import FAMILY, MOE_TENSOR_PARALLEL
    from ndparallel.parallel.moe_tensor_parallel import moe_tp_problem

    cfg = TransformerConfig.from_preset("tiny-moe", expert_ffn_dim=18)
    layers = FAMILY.moe_layers(Transformer(cfg))
    assert moe_tp_problem(layers, MOE_TENSOR_PARALLEL, 2, "transformer") is None
    assert "does not divide the experts' hidden width 18" in moe_tp_problem(layers, MOE_TENSOR_PARALLEL, 4, "x")
    assert "has no tensor-parallel plan for its MoE blocks" in moe_tp_problem(layers, None, 2, "hf")
    # the job pre-flight (before any rank starts) checks the experts' width, not the unused dense ffn_dim
    assert "does not divide model.expert_ffn_dim=18" in tp_fields_problem(cfg.preflight_shape().tp_fields, 4)
