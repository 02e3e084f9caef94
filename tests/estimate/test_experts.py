"""The estimator on a mixture of experts: parameter counts and active FLOPs, expert memory per rank (FSDP2's
padding of the expert dim included), what an MoE block saves for backward (saved-tensor hooks, one process), and
the validation against real gloo ranks: the reference MoE parallelized with ``ep``, its collectives counted by
``CommCounter`` and compared with the planner's rows exactly (all-to-all bytes as the mean over each ep group:
a rank's received rows depend on the routing, their mean is what every rank sends).

``PYTHONPATH=$PWD python -m tests.estimate.test_experts`` prints the predicted-vs-counted table of
docs/planning.md ("Mixture of experts").
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict

import pytest
import torch

from ndparallel.errors import ConfigError
from ndparallel.estimate import (
    ClusterSpec,
    MeshShape,
    TrainingSpec,
    collectives,
    estimate,
    estimate_memory,
    mesh_shapes,
    model_spec,
    params_per_rank,
    plan,
)
from ndparallel.estimate.cli import main as plan_main
from ndparallel.estimate.experts import expert_rows, moe_ffn_activation_bytes_per_token
from ndparallel.estimate.memory import layer_activation_bytes_per_token
from ndparallel.models import Transformer, TransformerConfig
from ndparallel.testing import run_distributed
from tests.estimate.tables import comparison_row, table_header
from tests.estimate.test_estimate import LLAMA3_8B_HF, measure_activations

MIXTRAL_HF = {
    **LLAMA3_8B_HF, "model_type": "mixtral", "vocab_size": 32000, "rope_theta": 1e6, "num_local_experts": 8,
    "num_experts_per_tok": 2,
}  # fmt: skip


# ------------------------------------------------------------------------------------------ the model
def test_moe_counts_match_the_reference_model_and_hf_configs():
    spec, cfg = model_spec("tiny-moe"), TransformerConfig.from_preset("tiny-moe")
    assert spec.num_params() == cfg.num_params() == 119_616
    assert spec.flops_per_token(4096) == cfg.flops_per_token(4096)  # top_k experts a token, not all of them
    assert spec.moe_layers == (0, 1) and spec.shared_ffn_dim == 32
    mixtral = model_spec(MIXTRAL_HF)  # Mixtral 8x7B: 46.7B parameters, 12.9B active
    assert (
        mixtral.num_params() == 46_702_792_704
        and mixtral.num_active_params() == 46_702_792_704 - 32 * 6 * 3 * 4096 * 14336
    )
    assert mixtral.expert_ffn_dim == 14336 and mixtral.n_moe_layers == 32
    deepseek = model_spec({**MIXTRAL_HF, "model_type": "deepseek_v3", "num_local_experts": None,
                           "n_routed_experts": 16, "moe_intermediate_size": 512, "n_shared_experts": 2,
                           "first_k_dense_replace": 3})  # fmt: skip
    assert deepseek.moe_layers == tuple(range(3, 32)) and deepseek.shared_ffn_dim == 1024
    assert deepseek.block_params(0) == deepseek.layer_matmul_params + 2 * 4096  # the first 3 blocks stay dense
    qwen = model_spec({**MIXTRAL_HF, "model_type": "qwen3_moe", "decoder_sparse_step": 2, "mlp_only_layers": [1]})
    assert qwen.moe_layers == tuple(range(3, 32, 2))
    # parallelize cannot split a Hugging Face model's MoE blocks over tp: the planner refuses it in its words
    hf_tp = estimate(mixtral, TrainingSpec(global_batch=8), MeshShape(dp_shard=4, tp=2, ep=4), ClusterSpec(num_gpus=8))
    assert any("model family 'huggingface' has no tensor-parallel plan for its MoE blocks" in p for p in hf_tp.problems)
    # tp splits the shared experts' width too: the pre-flight names it
    odd_shared = dataclasses.replace(model_spec("tiny-moe"), shared_ffn_dim=33)
    odd = estimate(odd_shared, TrainingSpec(global_batch=8), MeshShape(dp_shard=2, tp=2, ep=2), ClusterSpec(num_gpus=4))
    assert odd.problems == ["tp_size=2 does not divide model.shared_ffn_dim=33; choose a tp_size that divides it"]
    with pytest.raises(ConfigError, match="num_experts_per_tok=None"):
        model_spec({**MIXTRAL_HF, "num_experts_per_tok": None})
    with pytest.raises(ConfigError, match=r"model.top_k=5 must be between 1 and model.n_experts=4"):
        model_spec({"preset": "tiny", "n_experts": 4, "top_k": 5})


def test_a_dense_spec_keeps_its_numbers_and_an_moe_one_is_planned():
    dense = model_spec("tiny")
    assert not dense.is_moe and dense.moe_layers == () and dense.num_active_params() == dense.num_params()
    result = plan(model_spec("tiny-moe"), TrainingSpec(global_batch=16, seq_len=64), ClusterSpec(num_gpus=8))
    ranked = {e.mesh for e in result.ranked}
    assert MeshShape(dp_shard=8, ep=4) in ranked and MeshShape(dp_shard=2, cp=2, tp=2, ep=2) in ranked
    reasons = {e.mesh: e.reason() for e in result.rejected}
    assert "ep_size=8 does not divide model.n_experts=4" in reasons[MeshShape(dp_shard=8, ep=8)]
    # dense models search no ep; a pinned one is refused with the trainer's words
    assert {s.ep for s in mesh_shapes(8)} == {1}
    refused = plan(dense, TrainingSpec(global_batch=16, seq_len=64), ClusterSpec(num_gpus=8), fixed={"ep": 2})
    assert not refused.ranked
    for e in refused.rejected:  # the config's rule on the mesh first, then the pre-flight's on the model
        rule = "the model is dense" if e.mesh.fsdp % 2 == 0 else "does not divide dp_shard_size x cp_size"
        assert rule in e.reason(), e.mesh


def test_all_to_all_rows_time_and_the_cli(capsys):
    model, cluster = model_spec("tiny-moe"), ClusterSpec(num_gpus=16, gpus_per_node=8)
    train = TrainingSpec(global_batch=32, seq_len=64)
    e = estimate(model, train, MeshShape(dp_shard=16, ep=4), cluster)
    rows = {row.name: row for row in e.comms}
    routed = rows["EP all-to-all (routed tokens)"]  # 2 MoE blocks x 2 micro-batches x 4 all-to-alls of T k d e
    assert routed.payload_bytes == 2 * 2 * 4 * 64 * 2 * 64 * 2 and routed.calls == 16
    assert routed.bus_bytes == routed.payload_bytes * 3 / 4 and routed.link == "intra"  # (ep - 1) / ep cross ranks
    assert rows["FSDP all-gather (experts, forward)"].group_size == 4 and rows["Router all-reduce"
        " (tokens per expert)"].link == "inter"  # fmt: skip
    assert e.time.exposed_s["ep"] == pytest.approx(sum(r.time_s for r in e.comms if r.phase == "ep"))
    argv = ["plan", "--model", "tiny-moe", "--gpus", "8", "--seq", "64", "--global-batch", "16", "--no-pp"]
    assert plan_main([*argv, "--ep", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["n_experts"] == 4 and {row["mesh"]["ep"] for row in data["ranked"]} == {2}
    assert plan_main([*argv, "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "4 experts, top-2, expert ffn 32, shared ffn 32, 2 of 2 blocks MoE" in text and "[epN]" in text
    raw = ["plan", "--gpus", "8", "--dim", "64", "--layers", "2", "--heads", "8", "--kv-heads", "4", "--ffn-dim", "192"]
    assert (
        plan_main(
            [*raw, "--vocab", "256", "--experts", "4", "--expert-ffn-dim", "32", "--shared-ffn-dim", "32", "--json"]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["model"]["num_params"] == model.num_params()


# ------------------------------------------------------------------------------------------ memory
def test_expert_memory_per_rank_follows_ep_and_fsdp_padding():
    mixtral = model_spec(MIXTRAL_HF)
    train = TrainingSpec(global_batch=64, seq_len=4096)
    expert, router = 3 * 4096 * 14336, 8 * 4096
    even = mixtral.num_params() - 32 * (8 * expert + router)  # what FSDP shards evenly over dp_shard x cp
    # FSDP2 shards the stacked experts [8, F, d] (and the router's gate [8, d]) on dim 0 and pads it: over 64 ranks
    # each rank holds one whole expert and one gate row, 8 times its even share
    assert expert_rows(mixtral, MeshShape(dp_shard=64)) == 1
    assert params_per_rank(mixtral, MeshShape(dp_shard=64)) == pytest.approx(even / 64 + 32 * (expert + 4096))
    assert expert_rows(mixtral, MeshShape(dp_shard=4)) == 2 and expert_rows(mixtral, MeshShape(dp_shard=8, ep=2)) == 1
    # ep 8 on 64 ranks: 1 expert a rank, its own FSDP over the 8 ep_fsdp ranks: padded to the whole expert again
    assert expert_rows(mixtral, MeshShape(dp_shard=64, ep=8)) == 1
    # tp splits every expert's hidden width; the router's gate stays whole on every tp rank
    whole = 32 * (2 * 4096 + router) + 4096  # norms and routers
    assert params_per_rank(mixtral, MeshShape(tp=2)) == (mixtral.num_params() - whole) / 2 + whole
    mem = estimate_memory(mixtral, train, MeshShape(dp_shard=8, ep=8))
    assert mem.params == 4 * (even / 8 + 32 * (expert + 4096))


def test_moe_block_saved_activations_match_autograd_exactly():
    base = dict(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
    for experts in (
        dict(n_experts=4, top_k=2, n_shared_experts=1, expert_ffn_dim=16),
        dict(n_experts=8, top_k=1, expert_ffn_dim=16),
        dict(n_experts=8, top_k=3, n_shared_experts=2, expert_ffn_dim=8),
    ):
        cfg = TransformerConfig(**base, **experts)
        for dtype, precision in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            got = measure_activations(Transformer(cfg).to(dtype), seq=16, batch=2)["block"]
            spec, train = model_spec(cfg), TrainingSpec(precision=precision, fused_norm=False)
            want = layer_activation_bytes_per_token(spec, train, tp=1, moe=True) * 32
            assert got == want + 4 * cfg.n_experts, (experts, precision)  # + the balancing loss's fp32 fractions
    assert (
        moe_ffn_activation_bytes_per_token(model_spec("tiny-moe"), TrainingSpec(precision="fp32"), 1)
        == 2 * (4 * 4 * 32 + 3 * 4 * 64 + 4 + 28) + 8 * 4 + 8 + 4 * 4 * 32
    )


# ------------------------------------------------------------------------------------------ validation on gloo
VALIDATION_MOE = dict(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64, n_experts=4, top_k=2,
    n_shared_experts=1, expert_ffn_dim=16,
)  # fmt: skip
BATCH, SEQ = 2, 16  # per data-parallel rank and micro-batch
Run = tuple[MeshShape, str, int, int]  # mesh shape, precision, micro-batches per step, routed experts
MOE_RUNS: dict[int, list[Run]] = {
    2: [(MeshShape(dp_shard=2, ep=2), "fp32", 1, 4), (MeshShape(dp_shard=2, ep=2), "bf16", 2, 4)],
    4: [
        (MeshShape(dp_shard=4, ep=2), "fp32", 1, 4),
        (MeshShape(dp_shard=2, tp=2, ep=2), "fp32", 1, 4),
        (MeshShape(dp_shard=2, tp=2, ep=2), "bf16", 1, 4),  # the norms' and the routers' tp all-reduces in bf16
        (MeshShape(dp_replicate=2, dp_shard=2, ep=2), "fp32", 1, 4),
        (MeshShape(dp_shard=2, cp=2, ep=4), "fp32", 1, 4),
        (MeshShape(dp_shard=4), "fp32", 1, 2),  # 2 experts over 4 FSDP ranks: padded to one a rank
    ],
}
GROUPS = ("dp_replicate", "dp_shard_cp", "cp", "tp", "ep", "ep_fsdp", "dp_cp")


def _model_config(experts: int) -> TransformerConfig:
    return TransformerConfig(**{**VALIDATION_MOE, "n_experts": experts, "top_k": min(2, experts - 1)})


def _groups(mesh) -> dict[str, tuple[int, ...]]:
    """This rank's group (global ranks) of every planner group label its mesh has."""
    import torch.distributed as dist

    names = [name for name in GROUPS if mesh.size(name) > 1 and (mesh.config.ep_size > 1 or "ep" not in name)]
    return {name: tuple(dist.get_process_group_ranks(mesh[name].get_group())) for name in names}


def _measure_moe_run(shape: MeshShape, precision: str, micro_batches: int, experts: int) -> dict:
    """parallelize the MoE on ``shape``, train one step, count the second step's collectives by (group ranks,
    kind); the local parameter, gradient and AdamW bytes after it."""
    from contextlib import nullcontext

    import ndparallel as ndp
    from ndparallel.distributed.counter import CommCounter
    from ndparallel.parallel.grad_sync import micro_batch_sync
    from ndparallel.parallel.loss import auxiliary_loss
    from ndparallel.parallel.parallelize import parallelize
    from tests.parity import context_parallel_loss_fn, default_loss_fn, local_bytes

    cfg = shape.to_config(TrainingSpec(precision=precision))
    mesh = ndp.init_distributed(cfg)
    model = parallelize(Transformer(_model_config(experts)), mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = context_parallel_loss_fn if shape.cp > 1 else default_loss_fn
    generator = torch.Generator().manual_seed(mesh.coordinate["dp"])

    def step(counter: CommCounter | None = None) -> None:
        opt.zero_grad()
        for micro in range(micro_batches):
            data = torch.randint(0, VALIDATION_MOE["vocab_size"], (BATCH, SEQ + 1), generator=generator)
            with counter or nullcontext(), micro_batch_sync(model, last=micro == micro_batches - 1):
                loss = loss_fn(model, data[:, :-1].contiguous(), data[:, 1:].contiguous(), mesh)
                (loss + auxiliary_loss(model)).backward()
        opt.step()

    step()
    counter = CommCounter()
    step(counter)
    comm: dict[tuple[tuple[int, ...], str], int] = defaultdict(int)
    for call in counter.calls:
        comm[(call.ranks, call.kind)] += call.payload_bytes
    states = [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor) and v.ndim]
    params = list(model.parameters())
    return {
        "params": local_bytes(params), "grads": local_bytes(p.grad for p in params),
        "optimizer": local_bytes(states), "comm": dict(comm), "groups": _groups(mesh),
    }  # fmt: skip


def measure_moe_runs(runs: list[Run]) -> list[dict]:
    """Rank entry point: every run in one spawned group."""
    return [_measure_moe_run(*run) for run in runs]


def predicted_moe(run: Run, groups: dict[str, tuple[int, ...]]) -> dict:
    """The estimator's numbers for ``run`` on a rank whose groups are ``groups``, comm keyed as measured."""
    shape, precision, micro_batches, experts = run
    model = model_spec(_model_config(experts))
    train = TrainingSpec(
        global_batch=BATCH * shape.dp * micro_batches, seq_len=SEQ, micro_batch=BATCH, precision=precision
    )
    memory = estimate_memory(model, train, shape)
    comm: dict[tuple[tuple[int, ...], str], float] = defaultdict(float)
    for row in collectives(model, train, shape, ClusterSpec(num_gpus=shape.world_size)):
        comm[(groups[row.group], row.kind)] += row.payload_bytes
    assert estimate(model, train, shape).valid, shape
    return {"params": memory.params, "grads": memory.grads, "optimizer": memory.optimizer, "comm": dict(comm)}


def measured_moe(per_rank: list[list[dict]], i: int, rank: int) -> dict[tuple[tuple[int, ...], str], float]:
    """Rank ``rank``'s counted bytes of run ``i``; all-to-all bytes as the mean over the ep group's ranks."""
    got = dict(per_rank[rank][i]["comm"])
    for key in [k for k in got if k[1] == "all_to_all"]:
        got[key] = sum(per_rank[r][i]["comm"][key] for r in key[0]) / len(key[0])
    return got


@pytest.mark.parametrize(  # 4 ranks: about 30 s on 2 loaded cores (make test, not make test-fast)
    "world_size", [pytest.param(w, marks=pytest.mark.slow) if w > 2 else w for w in sorted(MOE_RUNS)]
)
def test_moe_predictions_equal_counted_bytes_on_parallelized_ranks(world_size):
    runs = MOE_RUNS[world_size]
    per_rank = run_distributed(measure_moe_runs, world_size, runs, timeout=240)
    for i, run in enumerate(runs):
        for key in ("params", "grads", "optimizer"):  # ranks past the last expert hold FSDP2's padding only
            largest = max(per_rank[rank][i][key] for rank in range(world_size))
            assert largest == predicted_moe(run, per_rank[0][i]["groups"])[key], (run, key)
        for rank in range(world_size):
            want = predicted_moe(run, per_rank[rank][i]["groups"])
            got = measured_moe(per_rank, i, rank)
            assert got == want["comm"], (run, rank, got, want["comm"])
            assert any(kind == "all_to_all" for _, kind in got) == (run[0].ep > 1)


def validation_table() -> str:
    """Predicted vs counted (rank 0; all-to-all: the mean over its ep group) for every run."""
    lines = table_header("world", "mesh (rep x shard x cp x tp, ep)", "precision", "micro-batches", "experts")
    for world_size, runs in sorted(MOE_RUNS.items()):
        per_rank = run_distributed(measure_moe_runs, world_size, runs, timeout=240)
        for i, run in enumerate(runs):
            groups = per_rank[0][i]["groups"]
            names = {ranks: "=".join(n for n in GROUPS if groups.get(n) == ranks) for ranks in groups.values()}
            want, got = predicted_moe(run, groups), measured_moe(per_rank, i, 0)
            rows = [(k, max(r[i][k] for r in per_rank), want[k]) for k in ("params", "grads", "optimizer")]
            rows += [
                (f"{names[ranks]}/{kind}", got.get((ranks, kind), 0), v) for (ranks, kind), v in want["comm"].items()
            ]
            cells = (world_size, run[0].describe(), *run[1:4])
            lines += [comparison_row(cells, *row) for row in sorted(rows, key=lambda row: row[0])]
    return "\n".join(lines)


if __name__ == "__main__":
    print(validation_table())
