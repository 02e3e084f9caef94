"""All-to-all (DeepSpeed-Ulysses) context parallel: ``cp_rotate_method: alltoall``.

* The op against full attention in one process: output and dQ/dK/dV in float64 (1e-10) and fp32 (1e-5),
  with and without load balancing, causal and not, kv heads that cp divides and kv heads it does not
  (repeated); a negative control (the right rows, the wrong layout flag) that must fail; a float64
  ``gradcheck`` of the distributed op.
* The whole model in float64 against one plain-PyTorch process (5 AdamW steps: losses, grad norms,
  step-1 gradients within 1e-10): cp 2 (set through Accelerate's ``cp_comm_strategy``), cp 2 without
  load balancing and one kv head, cp 4, cp 2 x tp 2, cp 2 x tp 2 with kv heads repeated, dp_shard 2 x cp 2
  with activation checkpointing, and a Hugging Face tiny Llama on cp 2.
* Counted bytes on real ranks against the estimator (``ndparallel.estimate``) for the three methods.
* The ConfigErrors, raised before the model is touched.

Two spawned groups: 2 ranks and 4 ranks.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ndparallel.distributed.ulysses import chunk_positions, kv_heads_sent
from ndparallel.errors import ConfigError
from ndparallel.models import Transformer, TransformerConfig
from ndparallel.testing import run_distributed
from tests.parity import build_model, make_batches
from tests.sequence_functions import GatherRows, ShardRows

STEPS, BATCH, SEQ, LR = 5, 4, 16, 1e-2
ALLTOALL = {"cp_rotate_method": "alltoall"}
HF_LLAMA = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, intermediate_size=128,
    vocab_size=256, max_position_embeddings=128, initializer_range=0.1, tie_word_embeddings=False,
)  # fmt: skip
# label -> (parallel config fields, model: None = tiny preset, a dict of overrides, or "hf_llama")
RUNS = {
    2: {
        "cp2_accelerate_name": ({"cp_size": 2, "cp_comm_strategy": "alltoall"}, None),
        "cp2_unbalanced_kv1": ({"cp_size": 2, "cp_load_balance": False, **ALLTOALL}, {"n_kv_heads": 1}),
        "hf_llama_cp2": ({"cp_size": 2, **ALLTOALL}, "hf_llama"),
    },
    4: {
        "cp4": ({"cp_size": 4, **ALLTOALL}, None),
        "cp2_tp2_kv_repeated": ({"cp_size": 2, "tp_size": 2, **ALLTOALL}, {"n_kv_heads": 2}),  # 1 kv head per tp rank
        "dp_shard2_cp2_ac": ({"dp_shard_size": 2, "cp_size": 2, "activation_checkpointing": "full", **ALLTOALL}, None),
    },
}
# Estimator check in fp32 on 2 ranks: (mesh sizes, method, activation checkpointing, model overrides). The
# float64 runs above also count their all-to-all bytes (tp, repeated kv heads, recompute, dp_shard).
BYTES_RUNS = [({"cp_size": 2}, method, "none", {}) for method in ("ring", "allgather", "alltoall")]


# ------------------------------------------------------------------------------------------ the op


def full_attention(q, k, v, causal: bool):
    """The reference: CoreAttention's math on the whole sequence (``[batch, seq, heads, dim]``), one process."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    repeats = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)


def _inputs(seq: int, kv_heads: int, dtype: torch.dtype, batch: int = 2, heads: int = 4, dim: int = 8):
    """q, k, v, dout of the full sequence, equal on every rank (a fixed generator)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seq, heads, dim, generator=gen, dtype=dtype)
    k = torch.randn(batch, seq, kv_heads, dim, generator=gen, dtype=dtype)
    v = torch.randn(batch, seq, kv_heads, dim, generator=gen, dtype=dtype)
    return q, k, v, torch.randn(batch, seq, heads, dim, generator=gen, dtype=dtype)


def _op_errors(group, shard_balanced: bool, op_balanced: bool, causal: bool, kv_heads: int, dtype, seq: int):
    """Max abs difference of this rank's out, dq, dk, dv from full attention; rows sharded with
    ``shard_balanced``, the op told ``op_balanced`` (they differ only in the negative control)."""
    from ndparallel.distributed.ring import ring_attention
    from ndparallel.parallel.context_parallel import shard_sequence

    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, dout = _inputs(seq, kv_heads, dtype)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = full_attention(*full, causal)
    ref_out.backward(dout)
    expected = [ref_out.detach(), *(t.grad for t in full)]

    def shard(t):
        return shard_sequence(t, 1, cp, rank, shard_balanced)

    local = [shard(t).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, group, causal=causal, rotate="alltoall", load_balanced=op_balanced)
    out.backward(shard(dout))
    got = [out.detach(), *(t.grad for t in local)]
    return max((g - shard(e)).abs().max().item() for g, e in zip(got, expected, strict=True))


def op_checks() -> dict[str, float]:
    """Every case on the world group (4 query heads; kv 4, 2, 1), the negative control, and on 4 ranks the
    cp groups of a dp_shard 2 x cp 2 mesh."""
    import ndparallel as ndp

    cp, seq = dist.get_world_size(), 4 * dist.get_world_size()
    errors = {}
    for balanced, causal, kv_heads in itertools.product((True, False), (True, False), (4, 2, 1)):
        name = f"lb{int(balanced)}-causal{int(causal)}-kv{kv_heads}"
        errors[f"fp64-{name}"] = _op_errors(None, balanced, balanced, causal, kv_heads, torch.float64, seq)
        errors[f"fp32-{name}"] = _op_errors(None, balanced, balanced, causal, kv_heads, torch.float32, seq)
    errors["control-wrong-layout"] = _op_errors(None, True, False, True, 2, torch.float64, seq)
    if cp == 4:
        mesh = ndp.init_distributed(ndp.ParallelismConfig(dp_shard_size=2, cp_size=2))
        errors["fp64-subgroup"] = _op_errors(mesh["cp"].get_group(), True, True, True, 2, torch.float64, 8)
    return errors


def gradcheck_alltoall() -> list[str]:
    """``gradcheck`` of q, k, v -> gather(alltoall(shard(q), shard(k), shard(v))), every rank perturbing the same
    element in lockstep (as tests/distributed/test_ring_attention.py does); 2 query heads, 1 kv head: repeated for cp 2.
    The full Jacobian for the load-balanced causal case; fast mode (random projections, the same seed on every
    rank so every rank perturbs alike) for the others."""
    from ndparallel.distributed.ring import ring_attention

    checked = []
    for balanced, causal, fast in [(True, True, False), (False, True, True), (True, False, True)]:
        q, k, v, _ = _inputs(seq=4, kv_heads=1, dtype=torch.float64, batch=1, heads=2, dim=4)

        def fn(q, k, v, balanced=balanced, causal=causal):
            local = [ShardRows.apply(t, balanced) for t in (q, k, v)]
            out = ring_attention(*local, None, causal=causal, rotate="alltoall", load_balanced=balanced)
            return GatherRows.apply(out, balanced)

        torch.manual_seed(0)
        inputs = tuple(t.requires_grad_() for t in (q, k, v))
        assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, rtol=1e-6, fast_mode=fast)
        checked.append(f"lb{int(balanced)}-causal{int(causal)}{'-fast' if fast else ''}")
    return checked


# ------------------------------------------------------------------------- whole model, float64


def _build(model: dict | str | None):
    """The float64 model: the tiny reference Transformer (with ``model`` overrides) or a tiny random HF Llama."""
    if model == "hf_llama":
        import transformers

        torch.manual_seed(0)
        config = transformers.LlamaConfig(**HF_LLAMA)
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double()
    return build_model(model, seed=0).double()


def _logits(net, tokens, positions):
    if hasattr(net, "base_model_prefix"):  # Hugging Face: ndparallel derives each rank's position ids
        return net(input_ids=tokens).logits
    return net(tokens, positions) if positions is not None else net(tokens)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """float64 mean cross entropy; vocab-sharded (TP) logits are gathered first, so no op downcasts."""
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def train64(parallel: dict | None, model: dict | str | None) -> dict:
    """5 AdamW steps in float64. ``parallel=None``: plain PyTorch in this process (the reference: no process
    group, no ndparallel code). Else ``parallelize`` on the mesh, tokens/labels/positions sharded over cp by
    ``context_parallel``; the loss mean over this rank's tokens, averaged over dp x cp in float64."""
    from ndparallel.distributed.counter import CommCounter

    net = _build(model)
    mesh, dp, dp_rank = None, 1, 0
    if parallel is not None:
        import ndparallel as ndp

        mesh = ndp.init_distributed(ndp.ParallelismConfig.from_dict(parallel))
        net = ndp.parallelize(net, mesh.config, mesh)
        dp, dp_rank = mesh.size("dp"), mesh.local_rank("dp")
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
    per_rank = BATCH // dp
    result: dict = {"losses": [], "grad_norms": []}
    for step, (tokens, labels) in enumerate(make_batches(STEPS, BATCH, SEQ, net.config.vocab_size)):
        rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        tokens, labels = tokens[rows], labels[rows]
        if mesh is None:
            loss = _loss(_logits(net, tokens, None), labels)
            loss.backward()
            result["losses"].append(loss.item())
        else:
            from ndparallel.parallel.context_parallel import context_parallel

            buffers = [tokens.clone(), labels.clone(), torch.arange(SEQ)]
            counter = CommCounter() if step == 0 else None
            with counter or torch.enable_grad():
                with context_parallel(mesh, buffers, seq_dims=[1, 1, 0], no_restore=buffers):
                    loss = _loss(_logits(net, buffers[0], buffers[2]), buffers[1])
                loss.backward()
            if counter is not None:
                cp_ranks = tuple(dist.get_process_group_ranks(mesh["cp"].get_group()))
                on_cp = [c for c in counter.calls if c.ranks == cp_ranks]
                result["cp_kinds"] = sorted({c.kind for c in on_cp})
                result["all_to_all_bytes"] = sum(c.payload_bytes for c in on_cp if c.kind == "all_to_all")
            total = loss.detach().clone()
            dist.all_reduce(total, group=mesh["dp_cp"].get_group())
            result["losses"].append(total.item() / mesh.size("dp_cp"))
        grads = {name: _full(p.grad).detach() for name, p in net.named_parameters()}
        if step == 0:
            result["grads"] = {name: g.numpy().copy() for name, g in grads.items()}
        result["grad_norms"].append(math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values())))
        optimizer.step()
        optimizer.zero_grad()
    return result


def reference(model: dict | str | None) -> dict:
    """The single-process float64 run, once per model per pytest process."""
    return _reference(tuple(sorted(model.items())) if isinstance(model, dict) else model)


@functools.cache
def _reference(model: tuple | str | None) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: on a busy machine, idle OpenMP threads cost seconds, one thread ms
    try:
        return train64(None, dict(model) if isinstance(model, tuple) else model)
    finally:
        torch.set_num_threads(threads)


def assert_parity64(got: dict, ref: dict, label: str, tol: float = 1e-10) -> None:
    """Losses (absolute), grad norms (relative) and every step-1 gradient (max absolute) within ``tol``."""
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= tol, f"{label}: losses {got['losses']} vs {ref['losses']}"
    for a, b in zip(got["grad_norms"], ref["grad_norms"], strict=True):
        assert math.isclose(a, b, rel_tol=tol), f"{label}: grad norm {a!r} vs {b!r}"
    assert got["grads"].keys() == ref["grads"].keys(), label
    for name, grad in ref["grads"].items():
        diff = float(np.abs(got["grads"][name] - grad).max())
        assert diff <= tol, f"{label}: step-1 gradient of {name} differs by {diff:.3g}"


# ---------------------------------------------------------------------------------- counted bytes


def count_cp_bytes(sizes: dict, method: str, checkpointing: str, model: dict) -> dict[str, int]:
    """fp32 payload bytes by kind on the cp group's ranks over one training step (after a warm-up step)."""
    import ndparallel as ndp
    from ndparallel.distributed.counter import CommCounter
    from ndparallel.parallel.context_parallel import context_parallel

    mesh = ndp.init_distributed(
        ndp.ParallelismConfig(**sizes, cp_rotate_method=method, activation_checkpointing=checkpointing)
    )
    net = ndp.parallelize(build_model(model), mesh.config, mesh)
    tokens, labels = make_batches(1, BATCH, SEQ, net.config.vocab_size)[0]
    counter = CommCounter()
    for ctx in (torch.enable_grad(), counter):
        with ctx:
            buffers = [tokens.clone(), labels.clone(), torch.arange(SEQ)]
            with context_parallel(mesh, buffers, seq_dims=[1, 1, 0], no_restore=buffers):
                loss = _loss(net(buffers[0], buffers[2]), buffers[1])
            loss.backward()
        net.zero_grad()
    cp_ranks = tuple(dist.get_process_group_ranks(mesh["cp"].get_group()))
    totals: dict[str, int] = {}
    for call in counter.calls:
        if call.ranks == cp_ranks:
            totals[call.kind] = totals.get(call.kind, 0) + call.payload_bytes
    return totals


def predicted_cp_bytes(sizes: dict, method: str, checkpointing: str, model: dict) -> dict[str, float]:
    """The estimator's fp32 payload bytes by kind on the cp ranks (context parallel, and FSDP's over the same
    ranks when dp_shard is 1); ``sizes`` by dim name or ``*_size`` field."""
    from ndparallel.estimate import ClusterSpec, MeshShape, TrainingSpec, collectives, model_spec

    dims = {dim: sizes.get(dim, sizes.get(f"{dim}_size", 1)) for dim in ("dp_shard", "cp", "tp")}
    mesh = MeshShape(**dims)
    spec = model_spec(TransformerConfig.from_preset("tiny", **model))
    groups = ("cp", "dp_shard_cp") if mesh.dp_shard == 1 else ("cp",)
    train = TrainingSpec(
        global_batch=BATCH, seq_len=SEQ, micro_batch=BATCH // mesh.dp, precision="fp32",
        activation_checkpointing=checkpointing, cp_rotate_method=method,
    )  # fmt: skip
    totals: dict[str, float] = {}
    for row in collectives(spec, train, mesh, ClusterSpec(num_gpus=mesh.world_size)):
        if row.group in groups:
            totals[row.kind] = totals.get(row.kind, 0) + row.payload_bytes
    return totals


def saved_activations() -> dict[int, int]:
    """Bytes one block saves for backward under alltoall on cp 2 (this rank's half of the sequence), by kv heads."""
    import ndparallel as ndp
    from ndparallel.parallel.context_parallel import apply_context_parallel
    from tests.estimate.test_estimate import SEQ as EST_SEQ
    from tests.estimate.test_estimate import VALIDATION_MODEL, measure_activations

    mesh = ndp.init_distributed(ndp.ParallelismConfig(cp_size=2, **ALLTOALL))
    saved = {}
    for kv_heads in (4, 1):  # cp divides 4; 1 kv head is repeated to 2
        model = Transformer(TransformerConfig(**{**VALIDATION_MODEL, "n_kv_heads": kv_heads}))
        saved[kv_heads] = measure_activations(apply_context_parallel(model, mesh, mesh.config), seq=EST_SEQ // 2)[
            "block"
        ]
    return saved


# ------------------------------------------------------------------------------------- refusals


def _raised(call) -> str:
    try:
        call()
    except ConfigError as err:
        return str(err)
    return "no error"


def refusals() -> dict:
    """ConfigErrors that need ranks: heads not divisible at parallelize time (model untouched) and in the op."""
    import ndparallel as ndp
    from ndparallel.distributed.ring import ring_attention

    world = dist.get_world_size()
    mesh = ndp.init_distributed(ndp.ParallelismConfig(cp_size=2, tp_size=world // 2, **ALLTOALL))
    if world == 4:  # the reference Transformer: n_heads=6 / tp 2 = 3 per tp rank, on cp 2
        model = build_model({"dim": 48, "n_heads": 6, "n_kv_heads": 2})
    elif _hf_available():  # a Hugging Face Llama with num_attention_heads=3 on cp 2 (its group imports HF anyway)
        import transformers

        config = transformers.LlamaConfig(**{**HF_LLAMA, "hidden_size": 48, "num_attention_heads": 3,
                                             "num_key_value_heads": 1})  # fmt: skip
        model = transformers.AutoModelForCausalLM.from_config(config)
    else:
        model = build_model({"dim": 48, "n_heads": 3, "n_kv_heads": 1})
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    out: dict = {"parallelize": _raised(lambda: ndp.parallelize(model, mesh.config, mesh))}
    out["untouched"] = all(
        not isinstance(p, DTensor) and torch.equal(p, before[name]) for name, p in model.named_parameters()
    ) and not any(type(m).__name__ == "RingAttention" for m in model.modules())
    if world == 2:
        q, k, v, _ = _inputs(seq=4, kv_heads=1, dtype=torch.float32, heads=3)
        out["op"] = _raised(lambda: ring_attention(q, k, v, None, rotate="alltoall"))
        q, k, v, _ = _inputs(seq=4, kv_heads=2, dtype=torch.float32)
        out["kernel"] = _raised(lambda: ring_attention(q, k, v, None, rotate="alltoall", kernel="math"))
    return out


# ---------------------------------------------------------------------------------------- groups


def rank_job(world: int) -> dict:
    return {
        "op": op_checks(),
        "gradcheck": gradcheck_alltoall() if world == 2 else [],
        "refusals": refusals(),
        "runs": {
            label: train64(parallel, model)
            for label, (parallel, model) in RUNS[world].items()
            if model != "hf_llama" or _hf_available()
        },
        "bytes": [count_cp_bytes(*run) for run in BYTES_RUNS] if world == 2 else [],
        "saved": saved_activations() if world == 2 else {},
    }


@functools.cache
def _results(world: int) -> list[dict]:
    return run_distributed(rank_job, world, world, timeout=600)


def _hf_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------------------------------- tests


# 4 ranks: one more group of the same cases, over 10 s on 2 loaded cores (make test, not make test-fast).
WORLDS = [2, pytest.param(4, marks=pytest.mark.slow)]


@pytest.mark.parametrize("world", WORLDS)
def test_op_matches_full_attention(world):
    for rank, result in enumerate(_results(world)):
        errors = result["op"]
        assert errors.pop("control-wrong-layout") > 1e-2, "the negative control passed: the check cannot fail"
        for name, err in errors.items():
            tol = 1e-5 if name.startswith("fp32") else 1e-10
            assert err <= tol, f"world {world} rank {rank} {name}: max error {err:.3g} > {tol}"
        assert len(errors) == 24 + (1 if world == 4 else 0)


def test_gradcheck_float64():
    results = _results(2)
    assert results[0]["gradcheck"] == results[1]["gradcheck"] and len(results[0]["gradcheck"]) == 3


def _check_runs(world: int, labels: list[str]) -> None:
    for label in labels:
        ref = reference(RUNS[world][label][1])
        for rank, result in enumerate(_results(world)):
            got = result["runs"][label]
            assert "all_to_all" in got["cp_kinds"] and "send_recv" not in got["cp_kinds"], (label, got["cp_kinds"])
            assert_parity64(got, ref, f"{label} rank {rank}")


@pytest.mark.parametrize("world", WORLDS)
def test_whole_model_float64_matches_one_process(world):
    _check_runs(world, [label for label, (_, model) in RUNS[world].items() if model != "hf_llama"])


def test_hf_llama_float64_matches_one_process():
    pytest.importorskip("transformers", reason="Hugging Face tests need the hf extra (make test installs it)")
    _check_runs(2, ["hf_llama_cp2"])


def test_estimator_matches_counted_bytes():
    """fp32, one step on cp 2: every kind on the cp ranks (context parallel and FSDP), for the three methods."""
    for run, counted in zip(BYTES_RUNS, _results(2)[0]["bytes"], strict=True):
        want = predicted_cp_bytes(*run)
        assert counted.keys() == want.keys(), (run, counted, want)
        for kind, value in want.items():
            assert counted[kind] == pytest.approx(value, rel=1e-9), (run, kind, counted, want)


@pytest.mark.parametrize("world", WORLDS)
def test_estimator_matches_all_to_all_bytes_of_the_float64_runs(world):
    """The all-to-all bytes of each float64 run's first step: twice the estimator's fp32 figure (8-byte elements)."""
    for label, (parallel, model) in RUNS[world].items():
        if model == "hf_llama":
            continue
        checkpointing = parallel.get("activation_checkpointing", "none")
        want = 2 * predicted_cp_bytes(parallel, "alltoall", checkpointing, model or {})["all_to_all"]
        for rank, result in enumerate(_results(world)):
            assert result["runs"][label]["all_to_all_bytes"] == want, (label, rank, want)


def test_estimator_matches_saved_activations():
    from ndparallel.estimate import TrainingSpec, model_spec
    from ndparallel.estimate.memory import layer_activation_bytes_per_token
    from tests.estimate.test_estimate import BATCH as EST_BATCH
    from tests.estimate.test_estimate import SEQ as EST_SEQ
    from tests.estimate.test_estimate import VALIDATION_MODEL

    train = TrainingSpec(precision="fp32", fused_norm=False, cp_rotate_method="alltoall")  # CPU: composite RMSNorm
    for rank, result in enumerate(_results(2)):
        for kv_heads, measured in result["saved"].items():
            spec = model_spec(TransformerConfig(**{**VALIDATION_MODEL, "n_kv_heads": kv_heads}))
            want = layer_activation_bytes_per_token(spec, train, tp=1, cp=2) * EST_BATCH * EST_SEQ // 2
            assert measured == want, (rank, kv_heads, measured, want)


@pytest.mark.parametrize("world", WORLDS)
def test_heads_that_do_not_divide_are_refused_before_the_model_is_touched(world):
    for out in (r["refusals"] for r in _results(world)):
        assert out["untouched"], out
        message = out["parallelize"]
        assert "cp_rotate_method='alltoall'" in message and "cp_size=2" in message and "'ring'" in message, out
        if world == 2:
            name = "num_attention_heads" if _hf_available() else "n_heads"
            assert f"{name}=3 query heads per tp rank" in message, out
            assert "query heads on this rank=3" in out["op"], out
            assert "kernel='math'" in out["kernel"], out
        else:
            assert "n_heads=6 / tp_size=2 = 3 query heads per tp rank" in message, out


def test_chunk_positions_follow_the_sequence_layout():
    from ndparallel.parallel.context_parallel import sequence_indices

    for cp, balanced in itertools.product(range(1, 7), (True, False)):
        chunks = 2 * cp if balanced else cp
        starts = torch.cat([sequence_indices(chunks * 3, cp, r, balanced)[::3] // 3 for r in range(cp)])
        assert chunk_positions(cp, balanced).tolist() == starts.tolist(), (cp, balanced)


def test_kv_heads_sent_keeps_each_query_head_on_its_kv_head():
    for heads, kv, cp in itertools.product((4, 8, 12, 16), (1, 2, 3, 4, 6, 8), (2, 3, 4, 8)):
        if heads % kv or heads % cp:
            continue
        sent = kv_heads_sent(kv, cp)
        assert sent % cp == 0 and heads % sent == 0 and sent % kv == 0, (heads, kv, cp)
        for head in range(heads):  # after repeating, query head h reads sent head h // (heads / sent)
            assert (head // (heads // sent)) // (sent // kv) == head // (heads // kv), (heads, kv, cp, head)


def test_config_values_names_and_refusals(tmp_path):
    from ndparallel.config.parallelism import ParallelismConfig
    from ndparallel.train.job_config import TrainConfig

    assert ParallelismConfig(cp_rotate_method="alltoall").cp_rotate_method == "alltoall"
    path = tmp_path / "accelerate.yaml"
    path.write_text(
        "parallelism_config:\n  parallelism_config_cp_size: 2\n  parallelism_config_cp_comm_strategy: alltoall\n"
    )
    assert ParallelismConfig.from_yaml(path).cp_rotate_method == "alltoall"
    env = {"PARALLELISM_CONFIG_CP_COMM_STRATEGY": "alltoall"}
    assert ParallelismConfig.from_env(env).cp_rotate_method == "alltoall"
    with pytest.raises(ConfigError, match="one of \\['ring', 'allgather', 'alltoall'\\]"):
        ParallelismConfig(cp_rotate_method="ulysses")
    with pytest.raises(ConfigError, match="needs cp_backend='ndparallel'"):
        ParallelismConfig(cp_size=2, cp_rotate_method="alltoall", cp_backend="torch")
    job = TrainConfig.from_dict({"model": {"preset": "tiny"}, "data": {"seq_len": 64}})  # 8 heads
    sizes = ParallelismConfig(cp_size=4, tp_size=4, **ALLTOALL).resolve(16)
    with pytest.raises(ConfigError, match=r"model.n_heads=8 / tp_size=4 = 2 query heads per tp rank.*cp_size=4"):
        job.check_mesh(sizes)
    job.check_mesh(ParallelismConfig(cp_size=4, tp_size=4).resolve(16))  # ring: no rule on heads


def test_planner_knows_the_method_and_its_rule(capsys):
    from ndparallel.estimate import ClusterSpec, MeshShape, TrainingSpec, estimate, model_spec, shape_problems
    from ndparallel.estimate.cli import main as plan_main

    model = model_spec("8b")  # 32 heads, 8 kv heads
    cluster = ClusterSpec.from_gpu("h100", num_gpus=16)
    train = {"global_batch": 64, "seq_len": 32768}
    ulysses = TrainingSpec(**train, cp_rotate_method="alltoall")
    assert any(
        "model.n_heads=32 / tp_size=8 = 4 query heads per tp rank do not divide by cp_size=8" in p
        for p in shape_problems(model, ulysses, MeshShape(cp=8, tp=8))
    )
    assert not shape_problems(model, TrainingSpec(**train), MeshShape(cp=8, tp=8))  # ring: no rule on heads
    by_method = {}
    for method in ("ring", "allgather", "alltoall"):
        e = estimate(model, TrainingSpec(**train, cp_rotate_method=method), MeshShape(dp_shard=2, cp=8), cluster)
        cp_rows = [row for row in e.comms if row.group == "cp"]
        by_method[method] = sum(row.bus_bytes for row in cp_rows)
        assert {row.phase for row in cp_rows} == {"cp_ring" if method == "ring" else "cp"}, method
    assert by_method["alltoall"] < by_method["allgather"] < by_method["ring"], by_method  # cp 8: Ulysses sends least
    argv = ["plan", "--model", "8b", "--gpus", "16", "--seq", "32768", "--global-batch", "64", "--cp", "4"]
    assert plan_main([*argv, "--cp-rotate-method", "alltoall"]) == 0
    assert "CP all-to-all" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        plan_main([*argv, "--cp-rotate-method", "ulysses"])
