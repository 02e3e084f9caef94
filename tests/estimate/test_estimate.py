"""The estimator and planner: hand-computed numbers, monotonicity, planner ranking, the CLI, and
validation against real gloo ranks (per-rank state bytes and counted collective bytes within 10%)."""

from __future__ import annotations

import json

import pytest
import torch

from ndparallel.errors import ConfigError
from ndparallel.estimate import (
    ClusterSpec,
    MeshShape,
    ModelSpec,
    TrainingSpec,
    collectives,
    estimate,
    estimate_memory,
    group_link,
    model_spec,
    params_per_rank,
    parse_bandwidth,
    parse_bytes,
    plan,
)
from ndparallel.estimate.cli import main as plan_main
from ndparallel.estimate.memory import (
    activation_parts,
    head_activation_bytes_per_token,
    layer_activation_bytes_per_token,
    rotary_copy_bytes,
)
from ndparallel.models import Transformer, TransformerConfig
from ndparallel.testing import run_distributed
from tests.estimate.tables import comparison_row, table_header

GiB = 1024**3
LLAMA3_8B_HF = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "tie_word_embeddings": False, "model_type": "llama",
}  # fmt: skip


# ------------------------------------------------------------------------------------------ inputs
def test_presets_match_transformer_config():
    for name in ("tiny", "small", "125m", "1b", "8b", "70b"):
        spec, cfg = model_spec(name), TransformerConfig.from_preset(name)
        assert spec.num_params() == cfg.num_params()
        assert spec.flops_per_token(4096) == cfg.flops_per_token(4096)
    assert model_spec("1b").num_params() == 953_223_168


def test_model_from_hf_config_raw_counts_and_file(tmp_path):
    assert model_spec(LLAMA3_8B_HF).num_params() == model_spec("8b").num_params()
    path = tmp_path / "llama" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(LLAMA3_8B_HF))
    assert model_spec(str(path)).num_params() == 8_030_261_248
    raw = model_spec(dict(dim=2048, n_layers=16, n_heads=16, ffn_dim=5632, vocab_size=32000))
    assert raw.num_params() == 953_223_168 and raw.n_kv_heads == 16
    tied = model_spec({**LLAMA3_8B_HF, "tie_word_embeddings": True})
    assert tied.num_params() == 8_030_261_248 - 128256 * 4096


def test_bad_model_input_names_the_fix():
    with pytest.raises(ConfigError, match=r"unknown model preset '9b'; choose one of \['125m', '1b'"):
        model_spec("9b")
    with pytest.raises(ConfigError, match="missing"):
        model_spec({"hidden_size": 8})
    with pytest.raises(ConfigError, match="n_kv_heads=3 does not divide model.n_heads=8"):
        ModelSpec(dim=64, n_layers=1, n_heads=8, n_kv_heads=3, ffn_dim=64, vocab_size=8)
    with pytest.raises(ConfigError, match="does not exist"):
        model_spec("missing/config.json")


def test_a_mixture_of_experts_is_planned_and_dense_numbers_stay():
    moe = model_spec("tiny-moe")  # planned now: experts, all-to-all and ep (tests/estimate/test_experts.py)
    assert moe.is_moe and (moe.n_experts, moe.top_k, moe.expert_ffn_dim) == (4, 2, 32)
    mixtral = model_spec({**LLAMA3_8B_HF, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2})
    assert mixtral.n_moe_layers == 32 and mixtral.num_active_params() < mixtral.num_params() / 3
    e = estimate(moe, TrainingSpec(global_batch=8, seq_len=64), MeshShape(dp_shard=4, ep=2), ClusterSpec(num_gpus=4))
    assert e.valid and {"ep", "ep_fsdp", "dp_cp"} <= {row.group for row in e.comms}
    # A dense model gets no MoE row and the numbers docs/planning.md records: 1B at micro-batch 4 x 4096 on one
    # GPU, 40.0 GiB peak; 8B's best shape on 64 GPUs (8x4x2x1), 44.4 GiB and 565,573 tok/s.
    one = estimate(model_spec("1b"), TrainingSpec(global_batch=4, seq_len=4096, micro_batch=4), MeshShape())
    assert round(one.memory.peak / GiB, 1) == 40.0 and round(one.memory.state / GiB, 1) == 14.2
    best = estimate(
        model_spec("8b"), TrainingSpec(global_batch=512, seq_len=8192), MeshShape(8, 4, 2, 1), ClusterSpec(num_gpus=64)
    )
    assert round(best.memory.peak / GiB, 1) == 44.4 and round(best.time.tokens_per_s) == 565_573
    assert not {"ep", "ep_fsdp", "dp_cp"} & {row.group for row in best.comms}


def test_parse_sizes_and_bandwidths():
    assert parse_bytes("80GiB") == 80 * GiB
    assert parse_bytes("80GB") == 80e9
    assert parse_bytes("141G") == 141 * GiB
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bandwidth("450GB/s") == 450e9
    assert parse_bandwidth("400Gbit/s") == parse_bandwidth("400Gbps") == 50e9
    for bad in ("80XB", "eighty", "-5GB", ""):
        with pytest.raises(ConfigError, match="gpu-mem"):
            parse_bytes(bad, "gpu-mem")


def test_cluster_validation():
    with pytest.raises(ConfigError, match="gpus=12 is not a multiple of gpus_per_node=8: use 8 or 16"):
        ClusterSpec(num_gpus=12)
    with pytest.raises(ConfigError, match="mfu"):
        ClusterSpec(mfu=1.5)
    with pytest.raises(ConfigError, match="unknown gpu 'v100'"):
        ClusterSpec.from_gpu("v100")
    with pytest.raises(ConfigError, match="activation_checkpointing='some'"):
        TrainingSpec(activation_checkpointing="some")


# ------------------------------------------------------------------------------------------ memory
def test_hand_computed_1b_numbers():
    model = model_spec("1b")
    train = TrainingSpec(global_batch=8, seq_len=4096, micro_batch=4, precision="bf16")
    single = estimate_memory(model, train, MeshShape())
    # fp32 params + fp32 grads + AdamW m, v: 16 bytes per parameter.
    assert single.params == 953_223_168 * 4
    assert single.state == 953_223_168 * 16 == 15_251_570_688
    fsdp8 = estimate_memory(model, train, MeshShape(dp_shard=8))
    assert fsdp8.state == pytest.approx(15_251_570_688 / 8)
    # Per block and token, bf16, fused RMSNorm: norms 2 x (2d + 4 + 2d), q k v out 2 x 4d, lse 4 x heads, SwiGLU 2 x 4f.
    assert layer_activation_bytes_per_token(model, train, tp=1) == 2 * 8196 + 16_384 + 64 + 45_056 == 77_896
    # No checkpointing: 16 blocks + loss head (final norm, bf16 logits, fp32 log-softmax and its grad), 4 x 4096 tokens.
    head = 8196 + 32000 * (2 + 4 + 4)
    assert single.activations == 16_384 * (16 * 77_896 + head)
    # Full checkpointing: block inputs (2d bytes per token) of 16 blocks + the larger of the head (start of backward)
    # and one block recomputed beside the bf16 logits the caller holds (the head's backward has freed the rest).
    assert 77_896 + 32000 * 2 < head
    assert single.activations_by_mode["full"] == 16_384 * (16 * 2 * 2048 + head)
    # tp=2 halves the block matmuls, embedding and output; norms stay replicated.
    per_rank = params_per_rank(model, MeshShape(tp=2))
    assert per_rank == (953_223_168 - 33 * 2048) / 2 + 33 * 2048


def test_memory_is_monotone_in_each_dim():
    model = model_spec("8b")
    train = TrainingSpec(global_batch=64, seq_len=8192)
    # more tp (other dims fixed): strictly less parameter memory; with FSDP too
    for shard in (1, 4):
        params = [estimate_memory(model, train, MeshShape(dp_shard=shard, tp=tp)).params for tp in (1, 2, 4, 8)]
        assert _decreasing(params)
    tp_only = [estimate_memory(model, train, MeshShape(tp=tp)).params for tp in (1, 2, 4, 8)]
    assert _decreasing(tp_only)
    acts = [estimate_memory(model, train, MeshShape(cp=cp)).activations for cp in (1, 2, 4, 8)]
    assert _decreasing(acts)
    by_mode = estimate_memory(model, train, MeshShape()).activations_by_mode
    assert by_mode["none"] > by_mode["selective"] > by_mode["full"]
    fsdp = [estimate_memory(model, train, MeshShape(dp_replicate=8 // s, dp_shard=s)).state for s in (1, 2, 4, 8)]
    assert _decreasing(fsdp)


def test_each_block_saves_its_own_cast_rotary_tables():
    """Under FSDP's mixed precision FSDP2 casts each block's floating inputs: every block saves its own bf16 cos
    and sin (checkpointed: beside its input), seq / cp rows, not split over tp; the dry run sees them
    (tests/dryrun/test_planner_matrix.py). Without the cast the blocks share one table (not counted)."""
    model, train = model_spec("8b"), TrainingSpec(seq_len=4096, activation_checkpointing="full")
    tables = 2 * model.head_dim * 4096  # cos + sin, head_dim / 2 each, bf16
    fsdp = MeshShape(dp_shard=8)
    assert rotary_copy_bytes(model, train, fsdp) == tables
    assert rotary_copy_bytes(model, train, MeshShape(dp_shard=2, cp=4)) == tables / 4
    assert rotary_copy_bytes(model, train, MeshShape(dp_shard=2, tp=4)) == tables
    assert rotary_copy_bytes(model, train, MeshShape(tp=8)) == 0  # autocast, no FSDP cast
    assert rotary_copy_bytes(model, TrainingSpec(seq_len=4096, precision="fp32"), fsdp) == 0
    held, _ = activation_parts(model, train, fsdp, head=False)
    assert held == model.n_layers * (2 * model.dim * 4096 + tables)


# ------------------------------------------------------------------------------------------ comm
def test_links_follow_mesh_order():
    cluster = ClusterSpec(num_gpus=64)
    mesh = MeshShape(dp_replicate=2, dp_shard=4, cp=2, tp=4)
    assert group_link(mesh, ("tp",), cluster) == "intra"
    assert group_link(mesh, ("cp",), cluster) == "intra"  # stride 4, span 8
    assert group_link(mesh, ("dp_shard", "cp"), cluster) == "inter"  # span 32
    assert group_link(mesh, ("dp_replicate",), cluster) == "inter"
    assert group_link(MeshShape(dp_replicate=8, dp_shard=8), ("dp_shard",), cluster) == "intra"


def test_collective_volumes_and_ring_factors():
    model = model_spec("1b")
    train = TrainingSpec(global_batch=8, seq_len=4096, micro_batch=1, precision="bf16")
    cluster = ClusterSpec(num_gpus=8)
    rows = {r.name: r for r in collectives(model, train, MeshShape(dp_shard=8), cluster)}
    gather = rows["FSDP all-gather (forward)"]
    assert gather.payload_bytes == 953_223_168 * 2  # bf16 gathered once per micro-batch (1 here)
    assert gather.bus_bytes == pytest.approx(953_223_168 * 2 * 7 / 8)
    assert rows["FSDP reduce-scatter (grads)"].payload_bytes == 953_223_168 * 4  # reduced in fp32
    # Backward re-gathers every unit but the last block, which stays gathered (parallel/fully_shard.py).
    block = 4 * 2048 * 2048 + 3 * 2048 * 5632 + 2 * 2048
    assert rows["FSDP all-gather (backward)"].payload_bytes == (953_223_168 - block) * 2
    ddp = {r.name: r for r in collectives(model, train, MeshShape(dp_replicate=8), cluster)}
    assert ddp["replicate all-reduce (grads)"].bus_bytes == pytest.approx(953_223_168 * 4 * 2 * 7 / 8)
    tp = {r.name: r for r in collectives(model, train, MeshShape(dp_shard=4, tp=2), cluster)}
    per_call = 4096 * 2048 * 2
    # 2 all-gathers per block forward and 2 backward, + output (fwd) and embedding (bwd); 8 / dp 4 = 2 micro-batches
    assert tp["TP all-gather (SP activations)"].payload_bytes == (2 * 2 * 16 + 2) * per_call * 2


def test_gradient_accumulation_sync_policy():
    model, mesh, cluster = model_spec("1b"), MeshShape(dp_shard=8), ClusterSpec(num_gpus=8, mfu=0.5)
    # 4 micro-batches per rank: reduce-scatter each (the default), or sync on the last (train.defer_grad_sync)
    deferred = TrainingSpec(global_batch=32, seq_len=4096, defer_grad_sync=True)
    every = TrainingSpec(global_batch=32, seq_len=4096)
    # FSDP keeps the unsharded fp32 gradient between micro-batches when sync waits for the last one.
    assert estimate_memory(model, deferred, mesh).accumulated_grads == 953_223_168 * 4
    assert estimate_memory(model, every, mesh).accumulated_grads == 0
    assert estimate_memory(model, TrainingSpec(global_batch=8, seq_len=4096), mesh).accumulated_grads == 0
    reduce = {t: next(r for r in collectives(model, t, mesh, cluster) if r.kind == "reduce_scatter")
              for t in (deferred, every)}  # fmt: skip
    assert reduce[every].payload_bytes == 4 * reduce[deferred].payload_bytes == 4 * 953_223_168 * 4
    for train in (deferred, every):
        time = estimate(model, train, mesh, cluster).time
        assert time.step_s >= time.compute_s > 0 and 0 < time.mfu <= cluster.mfu
    # With the --mfu override compute time follows FLOPs / (peak x MFU): 32 x 4096 tokens on 8 GPUs.
    expected = 32 * 4096 * model.flops_per_token(4096) / (8 * 989e12 * 0.5)
    assert estimate(model, deferred, mesh, cluster).time.compute_s == pytest.approx(expected)


# ------------------------------------------------------------------------------------------ planner
def test_planner_ranks_infeasible_and_invalid_shapes_out():
    model, cluster = model_spec("8b"), ClusterSpec(num_gpus=8, gpu_memory=80 * GiB)
    result = plan(model, TrainingSpec(global_batch=64, seq_len=8192, activation_checkpointing="full"), cluster)
    ranked = [e.mesh for e in result.ranked]
    assert MeshShape(dp_replicate=8) not in ranked  # 8B x 16 bytes of state = 120 GiB per GPU
    oom = next(e for e in result.rejected if e.mesh == MeshShape(dp_replicate=8))
    assert oom.valid and not oom.fits and "out of memory" in oom.reason()
    assert all(e.memory.peak <= cluster.usable_memory for e in result.ranked)
    times = [e.time.step_s for e in result.ranked]
    assert times == sorted(times)
    assert result.best is not None and result.best.feasible
    assert MeshShape(tp=8) in ranked  # tp=8 divides the 8 kv heads: valid
    many = plan(model, TrainingSpec(global_batch=64, seq_len=8192), ClusterSpec(num_gpus=32))
    reasons = {e.mesh.describe(): e.reason() for e in many.rejected}
    assert reasons["1x1x1x32"] == "tp_size=32 does not divide model.n_kv_heads=8; choose a tp_size that divides it"


def test_planner_shape_rules_and_pins():
    model = model_spec("tiny")
    cluster = ClusterSpec(num_gpus=8)
    result = plan(model, TrainingSpec(global_batch=6, seq_len=100), cluster, fixed={"tp": 2})
    assert {e.mesh.tp for e in result.ranked + result.rejected} == {2}
    reasons = {e.mesh: e.reason() for e in result.rejected}
    assert "seq_len 100 is not divisible by 2 x cp_size = 8" in reasons[MeshShape(cp=4, tp=2)]
    assert "train.global_batch=6 is not divisible" in reasons[MeshShape(dp_shard=4, tp=2)]
    with pytest.raises(ConfigError, match="matches the pinned sizes"):
        plan(model, TrainingSpec(), cluster, fixed={"tp": 3})


def test_estimate_rejects_mismatched_world():
    with pytest.raises(ConfigError, match="has 4 ranks but the cluster has num_gpus=8"):
        estimate(model_spec("tiny"), TrainingSpec(), MeshShape(dp_shard=4), ClusterSpec(num_gpus=8))


# ------------------------------------------------------------------------------------------ CLI
def test_cli_table_json_and_errors(capsys):
    argv = ["plan", "--model", "8b", "--gpus", "64", "--gpu-mem", "80GiB", "--seq", "8192", "--global-batch", "512"]
    assert plan_main(argv) == 0
    text = capsys.readouterr().out
    assert "shapes fit; fastest first" in text and "headroom" in text and "out of memory" in text
    assert plan_main([*argv, "--json", "--top", "3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["ranked"]) == 3 and data["model"]["num_params"] == 8_030_261_248
    steps = [row["time"]["step_s"] for row in data["ranked"]]
    assert steps == sorted(steps)
    for bad, message in [
        (["--model", "9b", "--gpus", "8"], "unknown model preset '9b'; choose one of"),
        (["--model", "8b", "--gpus", "12"], "gpus=12 is not a multiple of gpus_per_node=8"),
        (["--model", "8b", "--gpus", "8", "--gpu-mem", "80XB"], "--gpu-mem='80XB' is not a size"),
        (["--gpus", "8", "--dim", "64"], "raw model counts need --layers"),
    ]:
        assert plan_main(["plan", *bad]) == 2
        assert message in capsys.readouterr().err
    raw = ["plan", "--gpus", "8", "--dim", "2048", "--layers", "16", "--heads", "16", "--ffn-dim", "5632"]
    assert plan_main([*raw, "--vocab", "32000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["num_params"] == 953_223_168


# ------------------------------------------------------------------------------------------ validation on gloo
VALIDATION_MODEL = dict(vocab_size=512, dim=128, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=384, max_seq_len=64)
BATCH, SEQ = 2, 64  # per data-parallel rank: one micro-batch of 2 sequences of 64 tokens
# (mesh shape, precision, activation checkpointing), by world size: one spawned group each.
Run = tuple[MeshShape, str, str, int]  # mesh shape, precision, activation checkpointing, micro-batches per step
VALIDATION_RUNS: dict[int, list[Run]] = {
    2: [
        (MeshShape(dp_shard=2), "fp32", "none", 1),
        (MeshShape(tp=2), "fp32", "none", 1),
        (MeshShape(cp=2), "fp32", "none", 1),
    ],
    4: [
        (MeshShape(dp_shard=4), "fp32", "none", 1),
        (MeshShape(dp_shard=4), "bf16", "none", 1),
        (MeshShape(dp_replicate=2, dp_shard=2), "fp32", "none", 1),
        (MeshShape(dp_replicate=2, dp_shard=2), "fp32", "none", 2),
        (MeshShape(dp_shard=2, tp=2), "fp32", "none", 1),
        (MeshShape(dp_shard=2, tp=2), "bf16", "none", 1),  # the norms' tp all-reduce in bf16
        (MeshShape(dp_shard=2, cp=2), "fp32", "full", 1),
        (MeshShape(dp_replicate=4), "fp32", "none", 1),
        (MeshShape(dp_replicate=4), "fp32", "none", 2),
        (MeshShape(cp=2, tp=2), "fp32", "selective", 1),
    ],
}


def saved_activation_bytes(fn, exclude: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves while ``fn()`` runs (DTensors counted by their local
    shard), excluding ``exclude`` (weights and rotary tables are not activations)."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    excluded = {local(t).untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        tensor = local(t)
        try:
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except RuntimeError:  # a not-yet-waited async collective result: count its local elements
            key, size = id(t), tensor.numel() * tensor.element_size()
        if key not in excluded:
            seen[key] = size
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def measure_activations(model: Transformer, seq: int = SEQ, batch: int = BATCH) -> dict[str, int]:
    """Saved bytes of block 0 and of the loss head (final norm, output, cross-entropy) for one micro-batch."""
    from ndparallel.parallel.loss import cross_entropy_loss

    data = torch.randint(0, model.config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    exclude = [*model.parameters(), model.rope_cos, model.rope_sin]
    x = model.tok_embeddings(data[:, :-1])
    cos, sin = model.rope_cos[:seq], model.rope_sin[:seq]
    block = saved_activation_bytes(lambda: model.layers[0](x, cos, sin), exclude)
    head = saved_activation_bytes(lambda: cross_entropy_loss(model.output(model.norm(x)), data[:, 1:]), exclude)
    return {"block": block, "head": head}


def predicted_activations(
    cfg: TransformerConfig, precision: str, tp: int, tokens: int, cp: int = 1
) -> dict[str, float]:
    """Estimator's block and head numbers for a CPU run (composite RMSNorm); the head's saved part only:
    its logits and fp32 gradient are live at the start of backward but not saved by autograd."""
    model, train = model_spec(cfg), TrainingSpec(precision=precision, fused_norm=False)
    head = head_activation_bytes_per_token(model, train, tp) - model.vocab_size / tp * (train.bytes.compute + 4)
    return {"block": layer_activation_bytes_per_token(model, train, tp, cp) * tokens, "head": head * tokens}


def test_activation_bytes_match_autograd_saved_tensors():
    for kv_heads in (4, 8):  # grouped-query attention repeats k and v; plain attention does not
        cfg = TransformerConfig(**{**VALIDATION_MODEL, "n_kv_heads": kv_heads})
        for dtype, precision in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            measured = measure_activations(Transformer(cfg).to(dtype))
            want = predicted_activations(cfg, precision, tp=1, tokens=BATCH * SEQ)
            assert measured["block"] == want["block"], (kv_heads, precision)
            assert measured["head"] == pytest.approx(want["head"], rel=0.10), (kv_heads, precision, measured, want)


def _decreasing(values: list[float]) -> bool:
    return all(a > b for a, b in zip(values, values[1:], strict=False))


def _group_dims(mesh) -> dict[tuple[int, ...], str]:
    """This rank's group (as global ranks) of each mesh dim -> the estimator's group label."""
    import torch.distributed as dist

    labels = {"dp_replicate": "dp_replicate", "dp_shard_cp": "dp_shard_cp", "tp": "tp"}
    return {
        tuple(dist.get_process_group_ranks(mesh[name].get_group())): label
        for name, label in labels.items()
        if mesh.size(name) > 1
    }


def _measure_run(shape: MeshShape, precision: str, checkpointing: str, micro_batches: int) -> dict:
    """parallelize the validation model on ``shape``, train one step, count the second step's collectives.

    With several micro-batches, gradients sync as ``ndparallel train`` syncs them
    (``ndparallel.parallel.grad_sync.micro_batch_sync``: FSDP reduce-scatters every micro-batch, HSDP all-reduces and
    replicate all-reduces on the last)."""
    from contextlib import nullcontext

    import ndparallel as ndp
    from ndparallel.distributed.counter import CommCounter
    from ndparallel.parallel.grad_sync import micro_batch_sync
    from ndparallel.parallel.parallelize import parallelize
    from tests.parity import context_parallel_loss_fn, default_loss_fn, local_bytes

    cfg = ndp.ParallelismConfig(
        dp_replicate_size=shape.dp_replicate, dp_shard_size=shape.dp_shard, cp_size=shape.cp, tp_size=shape.tp,
        mixed_precision="no" if precision == "fp32" else precision, activation_checkpointing=checkpointing,
    )  # fmt: skip
    mesh = ndp.init_distributed(cfg)
    model = parallelize(Transformer(TransformerConfig(**VALIDATION_MODEL)), mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = context_parallel_loss_fn if shape.cp > 1 else default_loss_fn
    generator = torch.Generator().manual_seed(mesh.coordinate["dp"])

    def step(counter: CommCounter | None = None) -> None:
        opt.zero_grad()  # at the start, so the gradients are still there to measure after the last step
        for micro in range(micro_batches):
            data = torch.randint(0, VALIDATION_MODEL["vocab_size"], (BATCH, SEQ + 1), generator=generator)
            with counter or nullcontext(), micro_batch_sync(model, last=micro == micro_batches - 1):
                loss_fn(model, data[:, :-1].contiguous(), data[:, 1:].contiguous(), mesh).backward()
        opt.step()

    step()
    counter = CommCounter()
    step(counter)
    groups = _group_dims(mesh)
    comm: dict[str, int] = {}
    for call in counter.calls:
        label = "cp" if call.kind == "send_recv" else groups.get(call.ranks, str(call.ranks))
        key = f"{label}/{call.kind}"
        comm[key] = comm.get(key, 0) + call.payload_bytes
    states = [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor) and v.ndim]
    params = list(model.parameters())
    return {
        "params": local_bytes(params),
        "grads": local_bytes(p.grad for p in params),
        "optimizer": local_bytes(states),
        "comm": comm,
    }


def measure_runs(runs: list[Run]) -> tuple[list[dict], dict[str, dict[str, int]]]:
    """Rank entry point: every run in one spawned group, then saved activations under tp=2 and cp=2."""
    import ndparallel as ndp
    from ndparallel.models.transformer.family import transformer_tp_plan
    from ndparallel.parallel.context_parallel import apply_context_parallel
    from ndparallel.parallel.tensor_parallel import apply_tensor_parallel

    results = [_measure_run(*run) for run in runs]
    mesh = ndp.init_distributed(ndp.ParallelismConfig(dp_shard_size=-1, tp_size=2))
    model = Transformer(TransformerConfig(**VALIDATION_MODEL))
    apply_tensor_parallel(model, mesh["tp"], transformer_tp_plan())
    acts = {"tp2": measure_activations(model)}
    mesh = ndp.init_distributed(ndp.ParallelismConfig(dp_shard_size=-1, cp_size=2))
    model = apply_context_parallel(Transformer(TransformerConfig(**VALIDATION_MODEL)), mesh, mesh.config)
    acts["cp2"] = measure_activations(model, seq=SEQ // 2)  # this rank's half of the sequence (ring attention)
    return results, acts


def predicted(shape: MeshShape, precision: str, checkpointing: str, micro_batches: int) -> dict:
    """The estimator's numbers for the same run."""
    model = model_spec(TransformerConfig(**VALIDATION_MODEL))
    train = TrainingSpec(
        global_batch=BATCH * shape.dp * micro_batches, seq_len=SEQ, micro_batch=BATCH, precision=precision,
        activation_checkpointing=checkpointing,
    )  # fmt: skip
    memory = estimate_memory(model, train, shape)
    comm: dict[str, float] = {}
    for row in collectives(model, train, shape, ClusterSpec(num_gpus=shape.world_size)):
        key = f"{row.group}/{row.kind}"
        comm[key] = comm.get(key, 0) + row.payload_bytes
    return {"params": memory.params, "grads": memory.grads, "optimizer": memory.optimizer, "comm": comm}


@pytest.mark.parametrize(  # 4 ranks: over 10 s on 2 loaded cores (make test, not make test-fast)
    "world_size", [pytest.param(w, marks=pytest.mark.slow) if w > 2 else w for w in sorted(VALIDATION_RUNS)]
)
def test_predictions_match_parallelized_ranks_within_10_percent(world_size):
    runs = VALIDATION_RUNS[world_size]
    per_rank = run_distributed(measure_runs, world_size, runs, timeout=240)
    cfg = TransformerConfig(**VALIDATION_MODEL)
    want_acts = {
        "tp2": predicted_activations(cfg, "fp32", tp=2, tokens=BATCH * SEQ),
        "cp2": predicted_activations(cfg, "fp32", tp=1, tokens=BATCH * SEQ // 2, cp=2),
    }
    for rank, (_, acts) in enumerate(per_rank):
        for label, want in want_acts.items():
            assert acts[label]["block"] == want["block"], (rank, label, acts, want)
            assert acts[label]["head"] == pytest.approx(want["head"], rel=0.10), (rank, label, acts, want)
    for i, run in enumerate(runs):
        want = predicted(*run)
        for rank, (measured, _) in enumerate(per_rank):
            got = measured[i]
            for key in ("params", "grads", "optimizer"):
                assert got[key] == pytest.approx(want[key], rel=0.10), (run, rank, key, got[key], want[key])
            assert got["comm"].keys() == want["comm"].keys(), (run, rank, got["comm"], want["comm"])
            for key, value in want["comm"].items():
                assert got["comm"][key] == pytest.approx(value, rel=0.10), (run, rank, key, got["comm"][key], value)


def validation_table() -> str:
    """Predicted vs measured (rank 0) for every validation run: ``python -m tests.estimate.test_estimate``."""
    lines = table_header("world", "mesh (rep x shard x cp x tp)", "precision", "ckpt", "micro-batches")
    for world_size, runs in sorted(VALIDATION_RUNS.items()):
        measured, acts = run_distributed(measure_runs, world_size, runs, timeout=240)[0]
        for run, got in zip(runs, measured, strict=True):
            want = predicted(*run)
            rows = [(k, got[k], want[k]) for k in ("params", "grads", "optimizer")]
            rows += [(k, got["comm"].get(k, 0), want["comm"].get(k, 0)) for k in sorted(want["comm"])]
            cells = (world_size, run[0].describe(), *run[1:4])
            lines += [comparison_row(cells, key, value, guess) for key, value, guess in rows]
    cfg = TransformerConfig(**VALIDATION_MODEL)
    checks = [
        ("1", "1 process", measure_activations(Transformer(cfg)), predicted_activations(cfg, "fp32", 1, BATCH * SEQ)),
        ("2", "tp=2", acts["tp2"], predicted_activations(cfg, "fp32", 2, BATCH * SEQ)),
        ("2", "cp=2", acts["cp2"], predicted_activations(cfg, "fp32", 1, BATCH * SEQ // 2, cp=2)),
    ]
    for world, label, got, want in checks:
        cells = (world, label, "fp32", "none", 1)
        lines += [comparison_row(cells, f"saved activations, {k}", got[k], want[k]) for k in ("block", "head")]
    return "\n".join(lines)


if __name__ == "__main__":
    print(validation_table())
