"""Pipeline parallelism with mixed precision and CPU offload, on real gloo ranks.

The precision rule is the training step's (:func:`ndparallel.config.precision.forward_autocast_dtype`): without FSDP
every stage forward autocasts to bf16; with FSDP (pp2 x dp_shard2) its policy casts the stage's parameters to
bf16 (or fp16) and reduces gradients in fp32. Each bf16 run is compared with (a) the same precision without pp,
written as one plain PyTorch process that does what that rule does (autocast forward, or a bf16 copy of the
fp32 weights per micro-batch with fp32 gradient accumulation), on the same micro-batches, and (b) the float64
reference: how far bf16 lands from exact. Plus ``ndparallel train`` with bf16 on pp2 x dp_shard2 against the
same config with pp_size=1 (dp_shard4) on the same 4 ranks and global batch. CPU offload is proved exact in
float64. Measured numbers: docs/pipeline-parallel.md, "Mixed precision and CPU offload".
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from ndparallel.testing import run_distributed
from tests.parallel.pipeline.test_parity import (
    MAX_NORM,
    OPTIM,
    TINY,
    TOL,
    _batches,
    _full,
    _mesh,
    _plain_training,
    _transformer_reference,
)
from tests.parity import adamw

MICRO = 4  # pipeline micro-batches (= the reference's accumulation steps)
# Tolerances: the measured worst (torch 2.13 CPU, 5 AdamW steps, clipping active) is in the comments; bounds sit
# 3-10x above it. "1" = step 1 (same weights everywhere). Later steps drift at bf16's resolution: the global norm
# is summed over stages in another order, so the clip coefficient differs in the last fp32 bit, and some bf16
# cast of a weight then rounds the other way (which run it hits first is chance).
# (a) pp2 bf16 vs the same precision without pp, through the trainer's step or one plain process, on the same
#     micro-batches. Step 1: autocast (1f1b, gpipe, interleaved_1f1b; x dp_replicate2 interleaved_zb) loss 0,
#     grads <= 3.7e-9 (bitwise without dp), norm <= 4.3e-8; FSDP policy (pp2 x dp_shard2 1f1b, interleaved_1f1b
#     vs dp_shard4) loss 6.0e-8, norm 8.4e-8; pp2 x tp2 vs tp2 x dp_replicate2: loss 1.2e-7, norm 1.7e-8. Over 5
#     steps: loss 1.3e-4, norm 1.0e-3, params 2.4e-3 (pp2 1f1b autocast: 4.6e-5, 1.0e-3, 1.1e-3).
SAME_TOL = {"loss1": 1e-6, "norm1": 1e-6, "grad": 1e-6, "loss": 1e-3, "norm": 1e-2, "final": 2e-2}
# (a') pp2 x dp_shard2 bf16 (FSDP policy) vs one process imitating the policy (bf16 copy of the weights, fp32
#     gradient sum): loss1 1.5e-5, norm1 1.0e-5, grad 1.8e-4, loss 6.3e-4, norm 9.7e-2, final 3.1e-2; dp_shard4
#     without pp is exactly as far from it (FSDP's compute, not pp).
FSDP_TOL = {"loss1": 1e-4, "norm1": 1e-4, "grad": 1e-3, "loss": 5e-3, "norm": 0.3, "final": 0.1}
# (b) vs float64, worst of bf16 autocast, bf16 FSDP and fp16 FSDP: loss1 1.6e-5, norm1 2.9e-4, grad 7.2e-4,
#     loss 3.2e-3, norm 0.12, final 4.7e-2. Also held to it: pp2 x tp2 and tp2 x dp_replicate2 (no pp) against
#     the plain autocast process, both grad 1.7e-4, loss 1.9e-3, norm 6.9e-2, final 4.2e-2 (TP's own rounding).
F64_TOL = {"loss1": 1e-4, "norm1": 2e-3, "grad": 5e-3, "loss": 2e-2, "norm": 0.5, "final": 0.2}
# ndparallel train, 3 steps: pp2 x dp_shard2 bf16 vs dp_shard4 bf16 (pp_size=1): measured 3.0e-7 (the same pp
# run in fp32 is 1.2e-3 away).
TRAIN_TOL = 1e-5


def _low_precision_reference(autocast: bool, dp: int) -> dict:
    """One process doing what the step rule does without pp, micro-batch by micro-batch (``dp`` ranks' slices
    in turn, each in ``MICRO`` micro-batches). ``autocast``: fp32 weights, forward under bf16 autocast (no
    FSDP). Else FSDP's bf16 policy: a bf16 copy of the fp32 weights computes, gradients summed in fp32."""
    from ndparallel.models import Transformer, TransformerConfig

    model = Transformer(TransformerConfig(dtype="float32", **TINY))
    optimizer = adamw(model.parameters(), foreach=False, **OPTIM)
    out = {"losses": [], "norms": [], "grads": None}
    chunks = dp * MICRO
    for step, (x, y) in enumerate(_batches(TINY["vocab_size"])):
        compute = model
        if not autocast:  # parameters cast as FSDP casts them (buffers, e.g. rope tables, stay fp32)
            compute = copy.deepcopy(model)
            for param in compute.parameters():
                param.data = param.data.to(torch.bfloat16)
        total = 0.0
        for xs, ys in zip(x.chunk(chunks), y.chunk(chunks), strict=True):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = compute(xs)
            loss = F.cross_entropy(logits.float().flatten(0, 1), ys.flatten()) / chunks
            loss.backward()
            total += loss.item()
            if not autocast:  # each micro-batch's bf16 gradient joins an fp32 sum (FSDP's reduce dtype)
                for master, low in zip(model.parameters(), compute.parameters(), strict=True):
                    master.grad = low.grad.float() if master.grad is None else master.grad + low.grad.float()
                    low.grad = None
        if step == 0:
            out["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out["losses"].append(total)
    out["final"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _exact_reference() -> dict:
    """float64 plain PyTorch from the same fp32-initialised weights (a float64 model initialises differently)."""
    from ndparallel.models import Transformer, TransformerConfig

    ref = _plain_training(Transformer(TransformerConfig(dtype="float32", **TINY)).double(), lambda m, x: m(x))
    assert min(ref["norms"]) > MAX_NORM  # clipping is active on every step
    return ref


def _train(parallel: dict) -> list[float]:
    """``ndparallel train`` (3 steps, fp32 weights, clipping active) on this group's ranks."""
    from ndparallel.train.job_config import TrainConfig
    from ndparallel.train.loop import train

    cfg = TrainConfig.from_dict({
        "parallelism": parallel,
        "model": {**TINY, "vocab_size": 256, "dtype": "float32"},
        "data": {"seq_len": 16, "max_bytes": 100_000},
        "train": {"steps": 3, "global_batch": 8, "micro_batch": 1, "warmup_steps": 0, "max_grad_norm": 0.5},
    })  # fmt: skip
    return train(cfg).losses


def _run_without_pp(parallel: dict, accumulation: int) -> dict:
    """The same precision without pp, through the trainer's step (1-sequence micro-batches, as the pp runs)."""
    import torch.distributed as dist

    from ndparallel.config.parallelism import ParallelismConfig
    from ndparallel.config.precision import parallelize_config
    from ndparallel.models import Transformer, TransformerConfig
    from ndparallel.parallel.parallelize import parallelize
    from ndparallel.train.step import TrainStep

    cfg = ParallelismConfig(**parallel)
    mesh = _mesh(cfg)
    model = parallelize(Transformer(TransformerConfig(dtype="float32", **TINY)), parallelize_config(cfg), mesh=mesh)
    step = TrainStep(model, torch.optim.AdamW(model.parameters(), foreach=False, **OPTIM), mesh, max_grad_norm=MAX_NORM)
    dp, dp_rank = mesh.size("dp"), mesh.local_rank("dp")
    per = 8 // dp
    out = {"losses": [], "norms": [], "grads": {}}
    for index, (x, y) in enumerate(_batches(TINY["vocab_size"])):
        result = step(
            x[dp_rank * per : (dp_rank + 1) * per], y[dp_rank * per : (dp_rank + 1) * per], accumulation, index + 1
        )
        loss = result.loss.detach().reshape(1).double()
        dist.all_reduce(loss, group=mesh["dp"].get_group())  # the mean over dp (tp ranks hold the same loss)
        out["losses"].append(loss.item() / dp)
        out["norms"].append(result.grad_norm)
    out["final"] = {n: _full(p).clone() for n, p in model.named_parameters()}
    return out


def _run(case: dict) -> dict:
    """Train ``case`` on this rank's pipeline (5 AdamW steps); its losses, norms, step-1 grads, final params."""
    import torch.distributed as dist

    from ndparallel.config.parallelism import ParallelismConfig
    from ndparallel.models import Transformer, TransformerConfig
    from ndparallel.parallel.pipeline import build_pipeline

    if "train" in case:
        return {"train": _train(case["train"])}
    if "without_pp" in case:
        return _run_without_pp(case["without_pp"], case["accumulation"])
    cfg = ParallelismConfig(**case["parallel"])
    mesh = _mesh(cfg)
    with torch.device("meta"):
        model = Transformer(TransformerConfig(dtype=case["dtype"], **TINY))
    if "refuse" in case:
        try:
            build_pipeline(model, cfg, mesh, microbatches=MICRO)
        except Exception as err:  # noqa: BLE001 - the message is the result
            return {"refused": f"{type(err).__name__}: {err}"}
        return {"refused": None}
    pipe = build_pipeline(model, cfg, mesh, microbatches=MICRO)
    optimizers = [adamw(s.parameters(), foreach=False, **OPTIM) for s in pipe.stages]
    dp, dp_rank = mesh.size("dp"), mesh.local_rank("dp")
    per = 8 // dp
    out = {"losses": [], "norms": [], "grads": {}, "final": {}}
    for step, (x, y) in enumerate(_batches(TINY["vocab_size"])):
        out["losses"].append(
            pipe.step(x[dp_rank * per : (dp_rank + 1) * per], y[dp_rank * per : (dp_rank + 1) * per]).item()
        )
        if step == 0:
            out["grads"] = {n: _full(p.grad).clone() for s in pipe.stages for n, p in s.named_parameters()}
        out["norms"].append(pipe.clip_grad_norm_(MAX_NORM).item())
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    out["final"] = {n: _full(p).clone() for s in pipe.stages for n, p in s.named_parameters()}
    out["param_dtypes"] = sorted({str(p.dtype) for s in pipe.stages for p in s.parameters()})
    out["offload"] = sorted(_offload_policies(pipe.stages))
    dist.barrier()
    return out


def _offload_policies(stages) -> set[str]:
    """The offload policy of every FSDP unit of ``stages`` (CPUOffloadPolicy: parameters kept on the host)."""
    groups = [
        m._get_fsdp_state()._fsdp_param_group for s in stages for m in s.modules() if hasattr(m, "_get_fsdp_state")
    ]
    return {type(g.offload_policy).__name__ for g in groups if g is not None}


def _run_cases(cases: list[dict]) -> list[dict]:
    return [_run(case) for case in cases]


def _errors(per_rank: list[dict], ref: dict) -> dict:
    """The worst differences over ranks between a run and a reference."""
    err = {"loss1": 0.0, "norm1": 0.0, "grad": 0.0, "loss": 0.0, "norm": 0.0, "final": 0.0}
    for result in per_rank:  # step 1 (same weights everywhere), then the whole run
        err["loss1"] = max(err["loss1"], abs(result["losses"][0] - ref["losses"][0]))
        err["norm1"] = max(err["norm1"], abs(result["norms"][0] - ref["norms"][0]))
        err["loss"] = max(err["loss"], *(abs(a - b) for a, b in zip(result["losses"], ref["losses"], strict=True)))
        err["norm"] = max(err["norm"], *(abs(a - b) for a, b in zip(result["norms"], ref["norms"], strict=True)))
        for key in ("grads", "final"):
            for name, value in result[key].items() if ref[key] else ():  # no step-1 grads from TrainStep
                diff = (value.double() - ref[key][name].double()).abs().max().item()
                err[key.rstrip("s")] = max(err[key.rstrip("s")], diff)
    return err


def _check(name: str, per_rank: list[dict], ref: dict, tol: dict) -> dict:
    held = {n for r in per_rank for n in r["final"]}
    assert held == set(ref["final"]), name  # every parameter on some stage
    err = _errors(per_rank, ref)
    print(name, {k: f"{v:.1e}" for k, v in err.items()})  # the measured numbers, shown with -s
    assert all(err[k] < tol[k] for k in err), (name, err, tol)
    return err


def test_pp2_bf16_autocast_matches_the_same_precision_without_pp():
    bf16 = {"mixed_precision": "bf16"}
    # schedule, extra settings: the last one is bf16 with activation checkpointing (the recompute autocasts too)
    variants = [("1f1b", {}), ("gpipe", {}), ("interleaved_1f1b", {}), ("1f1b", {"activation_checkpointing": "full"})]
    schedules = [f"{s} {extra}" if extra else s for s, extra in variants]
    cases = [
        {"parallel": {"pp_size": 2, "pp_schedule": s, **bf16, **extra}, "dtype": "float32"} for s, extra in variants
    ]
    cases += [
        {"without_pp": {"dp_replicate_size": 2, **bf16}, "accumulation": 2},  # autocasts too; 2-sequence micro-batches
        {"parallel": {"pp_size": 2, "mixed_precision": "fp16"}, "dtype": "float32", "refuse": True},
    ]
    results = run_distributed(_run_cases, 2, cases, timeout=600)
    same, exact = _low_precision_reference(autocast=True, dp=1), _exact_reference()
    without_pp = results[0][len(schedules)]
    _check("dp_replicate2 bf16 (no pp) vs bf16 autocast", [without_pp], same, SAME_TOL)
    for index, schedule in enumerate(schedules):
        per_rank = [r[index] for r in results]
        assert all(r["param_dtypes"] == ["torch.float32"] for r in per_rank)  # fp32 masters; autocast casts
        _check(f"pp2 {schedule} bf16 vs bf16 autocast", per_rank, same, SAME_TOL)
        _check(f"pp2 {schedule} bf16 vs dp_replicate2 bf16 (no pp)", per_rank, without_pp, SAME_TOL)
        assert _check(f"pp2 {schedule} bf16 vs float64", per_rank, exact, F64_TOL)["grad"] > 1e-5  # bf16 computed
    refused = results[0][-1]["refused"]
    assert refused and "ConfigError" in refused and "mixed_precision=fp16 without FSDP" in refused, refused


@pytest.mark.slow
def test_pp2_dp_shard2_bf16_fp16_and_cpu_offload_on_four_ranks():
    pp_dp = {"pp_size": 2, "dp_shard_size": 2, "pp_schedule": "1f1b"}
    bf16 = {"mixed_precision": "bf16"}
    cases = {
        "pp_dp_bf16": {"parallel": {**pp_dp, **bf16}, "dtype": "float32"},
        "pp_dp_i1f1b_bf16": {"parallel": {**pp_dp, **bf16, "pp_schedule": "interleaved_1f1b"}, "dtype": "float32"},
        "pp_dp_fp16": {"parallel": {**pp_dp, "mixed_precision": "fp16"}, "dtype": "float32"},
        "pp_dp_offload": {"parallel": {**pp_dp, "cpu_offload": True}, "dtype": "float64"},
        "pp_tp_bf16": {"parallel": {"pp_size": 2, "tp_size": 2, **bf16}, "dtype": "float32"},  # autocast
        # zero-bubble without FSDP: autocast, fp32 weight gradients (with FSDP's policy refused: config/pipeline.py)
        "pp_rep_zb_bf16": {
            "parallel": {"pp_size": 2, "dp_replicate_size": 2, "pp_schedule": "interleaved_zb", **bf16},
            "dtype": "float32",
        },
        # the same precision without pp, through the trainer's step, on the pp run's micro-batches
        "dp4_bf16": {"without_pp": {"dp_shard_size": 4, **bf16}, "accumulation": 2},  # 1 sequence each
        "tp_rep_bf16": {"without_pp": {"tp_size": 2, "dp_replicate_size": 2, **bf16}, "accumulation": 2},  # 2 each
        "train_pp_dp_bf16": {"train": {**pp_dp, **bf16, "pp_schedule": "gpipe"}},
        "train_dp4_bf16": {"train": {"dp_shard_size": 4, **bf16}},
    }
    results = run_distributed(_run_cases, 4, list(cases.values()), timeout=600)
    run = {name: [r[i] for r in results] for i, name in enumerate(cases)}  # name -> per-rank results
    policy, exact = _low_precision_reference(autocast=False, dp=2), _exact_reference()
    autocast_2, autocast_1 = _low_precision_reference(autocast=True, dp=1), _low_precision_reference(True, dp=2)

    _check("pp2 x dp_shard2 bf16 vs dp_shard4 bf16 (no pp)", run["pp_dp_bf16"], run["dp4_bf16"][0], SAME_TOL)
    _check(
        "pp2 x dp_shard2 interleaved_1f1b bf16 vs dp_shard4 bf16",
        run["pp_dp_i1f1b_bf16"],
        run["dp4_bf16"][0],
        SAME_TOL,
    )
    _check("pp2 x dp_shard2 bf16 vs FSDP bf16 policy", run["pp_dp_bf16"], policy, FSDP_TOL)
    _check("dp_shard4 bf16 (no pp) vs FSDP bf16 policy", run["dp4_bf16"][:1], policy, FSDP_TOL)  # FSDP's gap
    assert _check("pp2 x dp_shard2 bf16 vs float64", run["pp_dp_bf16"], exact, F64_TOL)["grad"] > 1e-5  # bf16 ran
    assert _check("pp2 x dp_shard2 fp16 vs float64", run["pp_dp_fp16"], exact, F64_TOL)["grad"] > 1e-6  # fp16 ran

    _check("pp2 x tp2 bf16 vs tp2 x dp_replicate2 bf16 (no pp)", run["pp_tp_bf16"], run["tp_rep_bf16"][0], SAME_TOL)
    _check("pp2 x tp2 bf16 vs bf16 autocast", run["pp_tp_bf16"], autocast_2, F64_TOL)  # TP's own rounding
    _check("tp2 x dp_replicate2 bf16 (no pp) vs bf16 autocast", run["tp_rep_bf16"][:1], autocast_2, F64_TOL)
    _check("pp2 x dp_replicate2 interleaved_zb bf16 vs bf16 autocast", run["pp_rep_zb_bf16"], autocast_1, SAME_TOL)

    offload = run["pp_dp_offload"]
    assert all(r["offload"] == ["CPUOffloadPolicy"] for r in offload), [r["offload"] for r in offload]
    assert all(r["offload"] == ["OffloadPolicy"] for r in run["pp_dp_bf16"])  # the default: no offload
    f64 = _transformer_reference("float64")
    _check("pp2 x dp_shard2 cpu_offload float64 vs float64", offload, f64, dict.fromkeys(F64_TOL, TOL))

    pp_losses, dp_losses = run["train_pp_dp_bf16"][0]["train"], run["train_dp4_bf16"][0]["train"]
    worst = max(abs(a - b) for a, b in zip(pp_losses, dp_losses, strict=True))
    print("train pp2 x dp_shard2 bf16 vs dp_shard4 bf16", f"{worst:.1e}")
    assert worst < TRAIN_TOL, (pp_losses, dp_losses)
