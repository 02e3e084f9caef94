"""Pipeline parallelism against one plain PyTorch process, on real gloo ranks.

Every case trains the tiny Transformer (or a tiny Hugging Face Llama) for 5 AdamW steps with clipping
active (the reference's norms are all above ``MAX_NORM``) on the same global batch and seed as the
reference, which is plain PyTorch in the pytest process (``F.cross_entropy``,
``torch.nn.utils.clip_grad_norm_``, ``torch.optim.AdamW``). float64 is the exactness proof (losses, clipped
global norms, step-1 gradients before clipping and the final parameters within ``TOL``); one fp32 case is a
smoke check with a measured bound. Several cases share one spawned group.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from ndparallel.config.pipeline import torch_supports_v_schedules
from ndparallel.parallel.pipeline.tied import one_process_parameters
from ndparallel.testing import run_distributed
from tests.parity import adamw

TOL = 1e-10  # float64; measured <= 2e-14 (docs/pipeline-parallel.md)
FP32_TOL = 1e-4  # fp32 smoke: measured 3e-7 on the losses
STEPS, BATCH, SEQ, MAX_NORM = 5, 8, 16, 0.5
OPTIM = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
TINY = dict(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32, seed=0)
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb"]
if torch_supports_v_schedules():
    SCHEDULES += ["zbv", "dualpipev"]


def _batches(vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1234)
    shape = (BATCH, SEQ)
    return [
        (torch.randint(0, vocab, shape, generator=generator),) * 1
        + (torch.randint(0, vocab, shape, generator=generator),)
        for _ in range(STEPS)
    ]


def _plain_training(model: torch.nn.Module, logits_of) -> dict:
    """The reference: one process, whole model, global batch, mean cross-entropy, clip, AdamW."""
    optimizer = adamw(model.parameters(), foreach=False, **OPTIM)
    out = {"losses": [], "norms": [], "grads": None}
    for step, (x, y) in enumerate(_batches(model.config.vocab_size)):
        loss = F.cross_entropy(logits_of(model, x).flatten(0, 1), y.flatten())
        loss.backward()
        if step == 0:
            out["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
    out["final"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _transformer_reference(dtype: str) -> dict:
    from ndparallel.models import Transformer, TransformerConfig

    ref = _plain_training(Transformer(TransformerConfig(dtype=dtype, **TINY)), lambda m, x: m(x))
    assert min(ref["norms"]) > MAX_NORM  # clipping is active on every step
    return ref


def _tiny_llama_config(tie_word_embeddings: bool = False):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tie_word_embeddings,
        attn_implementation="sdpa",
    )  # fmt: skip


def _tiny_llama():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_tiny_llama_config()).double()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (_full(a).double() - b.double()).abs().max().item()


_MESHES: dict = {}


def _mesh(cfg):
    """One mesh per shape in a spawned group (building one creates process groups: seconds on a loaded machine)."""
    from ndparallel.distributed.process import init_distributed

    key = tuple(cfg.sizes.values())
    if key not in _MESHES:
        _MESHES[key] = init_distributed(cfg)
    return _MESHES[key]


def _train_pipeline(pipe, ref: dict, vocab_size: int, dp: int = 1, dp_rank: int = 0) -> dict:
    """The reference recipe (AdamW, clipping at ``MAX_NORM``) on this rank's pipeline, its dp slice of each
    batch; the worst differences from ``ref``: loss and grad norm every step, step-1 grads, final params."""
    optimizers = [adamw(s.parameters(), foreach=False, **OPTIM) for s in pipe.stages]
    per = BATCH // dp
    err = {"loss": 0.0, "norm": 0.0, "grad": 0.0, "final": 0.0}
    for step, (x, y) in enumerate(_batches(vocab_size)):
        loss = pipe.step(x[dp_rank * per : (dp_rank + 1) * per], y[dp_rank * per : (dp_rank + 1) * per])
        if step == 0:
            for stage in pipe.stages:
                for name, param in one_process_parameters(stage):
                    assert param.grad is not None, f"{name} has no gradient after the step"
                    err["grad"] = max(err["grad"], _error(param.grad, ref["grads"][name]))
        norm = pipe.clip_grad_norm_(MAX_NORM)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        err["loss"] = max(err["loss"], abs(loss.item() - ref["losses"][step]))
        err["norm"] = max(err["norm"], abs(norm.item() - ref["norms"][step]))
    for stage in pipe.stages:
        for name, param in one_process_parameters(stage):
            err["final"] = max(err["final"], _error(param, ref["final"][name]))
    return err


def _run_case(case: dict, ref: dict) -> dict:
    """Train ``case`` on this rank's pipeline; the worst differences from ``ref``."""
    import torch.distributed as dist

    from ndparallel.config.parallelism import ParallelismConfig
    from ndparallel.models import Transformer, TransformerConfig
    from ndparallel.parallel.pipeline import build_pipeline

    cfg = ParallelismConfig(**case["parallel"])
    mesh = _mesh(cfg)
    if case.get("hf"):
        model = _tiny_llama()  # materialised: the stages keep its weights
    else:
        with torch.device("meta"):  # no rank allocates a block it does not own
            model = Transformer(TransformerConfig(dtype=case.get("dtype", "float64"), **TINY))
    pipe = build_pipeline(model, cfg, mesh, microbatches=case.get("microbatches", 4))
    err = _train_pipeline(pipe, ref, model.config.vocab_size, mesh.size("dp"), mesh.local_rank("dp"))
    names = sorted(n for s in pipe.stages for n, _ in s.named_parameters())
    dist.barrier()
    return {"err": err, "ids": pipe.stage_ids, "names": names, "pp_ranks": dist.get_process_group_ranks(pipe.pp_group)}


def _train_losses(parallel: dict) -> list[float]:
    """``ndparallel train``'s loop (3 steps, float64, clipping active) on this group's mesh."""
    from ndparallel.train.job_config import TrainConfig
    from ndparallel.train.loop import train

    cfg = TrainConfig.from_dict({
        "parallelism": parallel,
        "model": {**TINY, "vocab_size": 256, "dtype": "float64"},
        "data": {"seq_len": SEQ, "max_bytes": 100_000},
        "train": {"steps": 3, "global_batch": BATCH, "micro_batch": 2, "warmup_steps": 0, "max_grad_norm": 0.5},
    })  # fmt: skip
    return train(cfg).losses


def _refusals() -> list[str]:
    """What the step refuses before torch would crash or hang: a batch the micro-batches do not divide, a
    shape different from the first step's."""
    from ndparallel.config.parallelism import ParallelismConfig
    from ndparallel.errors import ConfigError
    from ndparallel.models import Transformer, TransformerConfig
    from ndparallel.parallel.pipeline import build_pipeline

    cfg = ParallelismConfig(pp_size=2)
    with torch.device("meta"):
        model = Transformer(TransformerConfig(dtype="float64", **TINY))
    pipe = build_pipeline(model, cfg, _mesh(cfg), microbatches=4)
    tokens = torch.zeros(8, SEQ, dtype=torch.long)
    errors = []
    for x in (tokens[:6], None, tokens[:, :8]):
        try:
            pipe.step(tokens, tokens) if x is None else pipe.step(x, x)
        except ConfigError as err:
            errors.append(str(err))
    return errors


def _mesh_groups(parallel: dict) -> dict:
    """This rank's group of every dim and view, and what the mesh of its pp slice says."""
    import torch.distributed as dist

    from ndparallel.config.dims import MESH_DIMS
    from ndparallel.config.parallelism import ParallelismConfig
    from ndparallel.distributed.mesh import VIEWS

    mesh = _mesh(ParallelismConfig(**parallel))
    groups = {name: dist.get_process_group_ranks(mesh[name].get_group()) for name in (*MESH_DIMS, *VIEWS)}
    inner = mesh.without_pp()
    return {"groups": groups, "sizes": (mesh.size("pp"), inner.size(), inner.size("pp"), mesh.size())}


def _run_cases(cases: list[dict], refs: dict) -> list:
    out = []
    for case in cases:
        if "mesh" in case:
            out.append(_mesh_groups(case["mesh"]))
        elif "train" in case:
            out.append(_train_losses(case["train"]))
        elif "refusals" in case:
            out.append(_refusals())
        else:
            out.append(_run_case(case, refs[case.get("ref", "float64")]))
    return out


def _check(results: list[list[dict]], cases: list[dict], refs: dict) -> None:
    for index, case in enumerate(cases):
        tol = FP32_TOL if case.get("dtype") == "float32" else TOL
        per_rank = [rank_results[index] for rank_results in results]
        worst = {k: max(r["err"][k] for r in per_rank) for k in per_rank[0]["err"]}
        print(case, {k: f"{v:.1e}" for k, v in worst.items()})  # the measured numbers, shown with -s
        assert max(worst.values()) < tol, (case, worst)
        held = sorted(n for r in per_rank for n in r["names"])
        every = sorted(refs[case.get("ref", "float64")]["final"])
        assert set(held) == set(every), case  # every parameter lives on some stage, under its unsplit name


@pytest.fixture(scope="module")
def refs() -> dict:
    return {"float64": _transformer_reference("float64"), "float32": _transformer_reference("float32")}


def test_pp2_every_schedule_matches_one_process(refs):
    cases = [{"parallel": {"pp_size": 2, "pp_schedule": s}} for s in SCHEDULES]
    cases.append({"parallel": {"pp_size": 2, "pp_schedule": "1f1b"}, "dtype": "float32", "ref": "float32"})
    cases.append({"parallel": {"pp_size": 2, "pp_split": [[0, 1], [1, 4]]}, "microbatches": 2})
    extra = [{"train": {"pp_size": 2}}, {"train": {"dp_shard_size": 2}}, {"refusals": True}]
    results = run_distributed(_run_cases, 2, cases + extra, refs, timeout=600)
    pp_losses, dp_losses, refusals = results[0][len(cases) :]
    results = [r[: len(cases)] for r in results]
    _check(results, cases, refs)
    # ndparallel train on pp2 (4 pipeline micro-batches) follows the dp_shard2 run (exact in float64)
    assert max(abs(a - b) for a, b in zip(pp_losses, dp_losses, strict=True)) < TOL, (pp_losses, dp_losses)
    assert "pp_microbatches=4 does not divide this rank's batch of 6" in refusals[0]
    assert "batch shape changed from [8, 16] to [8, 8]" in refusals[1] and len(refusals) == 2
    assert [r[SCHEDULES.index("interleaved_1f1b")]["ids"] for r in results] == [[0, 2], [1, 3]]  # loop placement
    if "zbv" in SCHEDULES:
        assert [r[SCHEDULES.index("zbv")]["ids"] for r in results] == [[0, 3], [1, 2]]  # V placement


@pytest.mark.slow
def test_pp2_composes_with_every_dim_and_pp4_on_four_ranks(refs):
    cases = [
        {"parallel": {"pp_size": 2, "dp_shard_size": 2, "pp_schedule": "1f1b"}},
        {"parallel": {"pp_size": 2, "dp_shard_size": 2, "pp_schedule": "interleaved_zb"}},
        {"parallel": {"pp_size": 2, "tp_size": 2, "pp_schedule": "interleaved_1f1b"}},
        {"parallel": {"pp_size": 2, "cp_size": 2, "pp_schedule": "1f1b"}},
        {"parallel": {"pp_size": 2, "dp_replicate_size": 2, "pp_schedule": "gpipe"}},
        {"parallel": {"pp_size": 4, "pp_schedule": "1f1b"}},  # middle stages: no embedding, no head
    ]
    if torch_supports_v_schedules():  # FSDP re-gathering after forward made DualPipeV silently wrong: forced off
        cases.append({"parallel": {"pp_size": 2, "dp_shard_size": 2, "pp_schedule": "dualpipev"}})
    if importlib.util.find_spec("transformers") is not None:  # Hugging Face Llama pp2 x tp2, in the same group
        model = _tiny_llama()
        refs = {**refs, "hf": _plain_training(model, lambda m, x: m(input_ids=x).logits)}
        assert min(refs["hf"]["norms"]) > MAX_NORM
        cases.append({"parallel": {"pp_size": 2, "tp_size": 2}, "hf": True, "ref": "hf"})
    results = run_distributed(_run_cases, 4, cases, refs, timeout=600)
    _check(results, cases, refs)
    assert results[0][0]["pp_ranks"] == [0, 2]  # pp outermost: ranks 0 and 2 hold stages 0 and 1
    assert cases[-1].get("hf") or importlib.util.find_spec("transformers") is None


@pytest.mark.slow
def test_pp2_dp_shard2_tp2_on_eight_ranks(refs):
    from ndparallel.config.parallelism import ParallelismConfig
    from ndparallel.distributed.mesh import rank_groups

    sizes = {"pp_size": 2, "dp_shard_size": 2, "tp_size": 2}
    cases = [{"parallel": {**sizes, "pp_schedule": "1f1b"}}]
    results = run_distributed(_run_cases, 8, [*cases, {"mesh": sizes}], refs, timeout=600)
    _check([r[:1] for r in results], cases, refs)
    expected = rank_groups(ParallelismConfig(**sizes).resolve(8))
    for rank, result in enumerate(results):
        meshes = result[1]
        assert meshes["sizes"] == (2, 4, 1, 8)  # mesh.size("pp"); the pp slice: 4 ranks, no pp
        for name, groups in expected.items():  # every dim and view: the groups rank_groups predicts
            assert meshes["groups"][name] == next(g for g in groups if rank in g), (rank, name)
