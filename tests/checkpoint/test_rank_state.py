"""A rank's share of the checkpoint (``ndparallel/checkpoint/rank_state.py`` and ``keys.py``): several modules
per rank (pipeline stages), one optimizer each, their keys merged over the ranks, so a checkpoint reshards
across pp sizes. Save on pp 2 x dp_shard 2, load on the same mesh, on pp 1 x dp_shard 4, on pp 4, in one
process, and round-trip an interleaved layout (2 stages and 2 optimizers per rank); each continues on the
single-process trajectory, in float64 (1e-10). The refusals (a key no rank holds, ranks that disagree) and the
arguments (one optimizer per module, distinct names) are checked too.

Stage modules are built here, by hand (the project's pipeline package is not used, so these tests
prove the checkpoint format alone): a stage holds the reference Transformer's ``tok_embeddings``
(first stage), an ``nn.ModuleDict`` of its blocks keyed by the original block index, and
``norm``/``output`` (last stage), so its FQNs are the unsplit model's. Stages run under
``torch.distributed.pipelining`` (``Schedule1F1B`` / ``ScheduleInterleaved1F1B``) on a 5-D
``(pp, dp_replicate, dp_shard, cp, tp)`` DeviceMesh, each stage FSDP2-sharded over ``dp_shard``.

Every multi-rank check runs in ONE 4-rank group (several meshes over the same ranks), writing real
DCP directories under ``tmp_path``; the reference and the one-process loads run in the pytest process.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ndparallel import checkpoint as ckpt
from ndparallel.checkpoint import CheckpointError
from ndparallel.models import Transformer, TransformerConfig
from ndparallel.testing import run_distributed
from tests.checkpoint.test_checkpoint import _one_thread, _params

CFG = TransformerConfig(
    vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32, dtype="float64", seed=0
)
HP = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
WRONG_LR = 0.5  # fresh optimizers start from another lr: the checkpoint's must come back
BATCH, SEQ, MICRO = 8, 16, 4
DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
TOL = 1e-10  # float64: measured ~1e-16 (docs/checkpointing.md, "Pipeline parallelism")


def _batches(steps: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    return [
        (
            torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g),
            torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g),
        )
        for _ in range(steps)
    ]


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def reference() -> dict[str, Any]:
    """Plain PyTorch, one process: the whole model, the global batch, AdamW, 4 steps."""
    model = Transformer(CFG)
    opt = torch.optim.AdamW(model.parameters(), **HP)
    out: dict[str, Any] = {}
    for step, (x, y) in enumerate(_batches()):
        _loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out[f"after{step + 1}"] = _params(model)
    return out


# ----------------------------------------------------------------------------- stages, built by hand


class Stage(nn.Module):
    """A contiguous run of the Transformer's blocks under the unsplit model's FQNs."""

    def __init__(self, full: Transformer, blocks: range, first: bool, last: bool):
        super().__init__()
        if first:
            self.tok_embeddings = full.tok_embeddings
        self.layers = nn.ModuleDict({str(i): full.layers[i] for i in blocks})
        if last:
            self.norm, self.output = full.norm, full.output
        self.register_buffer("rope_cos", full.rope_cos, persistent=False)
        self.register_buffer("rope_sin", full.rope_sin, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope_cos[: h.shape[1]], self.rope_sin[: h.shape[1]]
        if hasattr(self, "tok_embeddings"):
            h = self.tok_embeddings(h)
        for block in self.layers.values():
            h = block(h, cos, sin)
        return self.output(self.norm(h)) if hasattr(self, "output") else h


def build_stages(
    stage_ids: list[int], n_stages: int, dp_mesh: Any, *, seed: int = 0, n_layers: int = 4, last: bool = True
) -> list[Stage]:
    """This rank's stages of a model initialised from ``seed``, each FSDP2-sharded over ``dp_mesh`` (if > 1)."""
    from torch.distributed.fsdp import fully_shard

    full = Transformer(dataclasses.replace(CFG, seed=seed, n_layers=n_layers))
    per, extra = divmod(n_layers, n_stages)
    bounds = [s * per + min(s, extra) for s in range(n_stages + 1)]
    stages = []
    for s in stage_ids:
        stage = Stage(full, range(bounds[s], bounds[s + 1]), s == 0, last and s == n_stages - 1)
        if dp_mesh is not None and dp_mesh.size() > 1:
            for block in stage.layers.values():
                fully_shard(block, mesh=dp_mesh)
            fully_shard(stage, mesh=dp_mesh)
        stages.append(stage)
    return stages


class Layout:
    """A 5-D mesh of the 4 ranks and this rank's stages on it: ``stages_per_rank`` 1 (1F1B) or 2 (interleaved)."""

    def __init__(self, pp: int, dp_shard: int, stages_per_rank: int = 1):
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh("cpu", (pp, 1, dp_shard, 1, 1), mesh_dim_names=DIMS)
        self.pp, self.n_stages = pp, pp * stages_per_rank
        pp_rank = self.mesh["pp"].get_local_rank()
        self.stage_ids = [pp_rank + i * pp for i in range(stages_per_rank)]

    def build(self, seed: int, lr: float = WRONG_LR, **kw: Any) -> tuple[list[Stage], list[torch.optim.Optimizer]]:
        stages = build_stages(self.stage_ids, self.n_stages, self.mesh["dp_shard"], seed=seed, **kw)
        return stages, [torch.optim.AdamW(s.parameters(), **{**HP, "lr": lr}) for s in stages]

    def train(self, stages: list[Stage], opts: list[torch.optim.Optimizer], steps: range) -> None:
        """Steps ``steps`` of the global batches: this rank's dp slice, ``MICRO`` micro-batches through the pipeline."""
        import torch.distributed.pipelining as pipelining

        dp = self.mesh["dp_shard"]
        per = BATCH // dp.size()
        schedule = None
        if self.pp > 1:
            group = self.mesh["pp"].get_group()
            pipe = [
                pipelining.PipelineStage(s, i, self.n_stages, torch.device("cpu"), group=group)
                for s, i in zip(stages, self.stage_ids, strict=True)
            ]
            if len(pipe) == 1:
                schedule = pipelining.Schedule1F1B(pipe[0], MICRO, loss_fn=_loss)
            else:
                schedule = pipelining.ScheduleInterleaved1F1B(pipe, MICRO, loss_fn=_loss)
        batches = _batches()
        for step in steps:
            x, y = (t[dp.get_local_rank() * per : (dp.get_local_rank() + 1) * per] for t in batches[step])
            if schedule is None:
                _loss(stages[0](x), y).backward()
            elif 0 in self.stage_ids:
                schedule.step(x, target=y)
            else:
                schedule.step(target=y)
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)


def _error_vs(stages: list[Stage], expected: dict[str, torch.Tensor]) -> float:
    """Max |param - expected| over this rank's stages (a collective over dp_shard for DTensors)."""
    worst = 0.0
    for stage in stages:
        for name, p in stage.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            worst = max(worst, (full.detach() - expected[name]).abs().max().item())
    return worst


def _local_snapshot(stages: list[Stage]) -> list[torch.Tensor]:
    return [(p.to_local() if isinstance(p, DTensor) else p).detach().clone() for s in stages for p in s.parameters()]


def _refused(fn: Any, *args: Any, **kwargs: Any) -> str | None:
    try:
        fn(*args, **kwargs)
    except CheckpointError as e:
        return str(e)
    return None


def job_pp(root: str, ref: dict[str, Any]) -> dict[str, Any]:
    """On 4 ranks: every layout, one after the other (each builds its own 5-D mesh over the same ranks)."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {"rank": dist.get_rank()}
    saved = f"{root}/pp2xdp2/step-2"
    pp2 = Layout(pp=2, dp_shard=2)

    # pp 2 x dp_shard 2, 1F1B: steps 1-2 from the reference's initial weights, then save.
    stages, opts = pp2.build(seed=0, lr=HP["lr"])
    pp2.train(stages, opts, range(0, 2))
    out["trained_pp2xdp2"] = _error_vs(stages, ref["after2"])
    ckpt.save(saved, stages, opts, step=2, data={"position": 2 * BATCH})
    pp2.train(stages, opts, range(2, 4))
    uninterrupted = _local_snapshot(stages)

    # Resume on the same mesh, and on pp 1 x dp_shard 4 and pp 4: fresh weights (another seed), another lr.
    for name, layout in (("pp2xdp2", pp2), ("pp1xdp4", Layout(pp=1, dp_shard=4)), ("pp4", Layout(pp=4, dp_shard=1))):
        stages, opts = layout.build(seed=7)
        extra = ckpt.load(saved, stages, opts)
        assert extra == {"step": 2, "data": {"position": 2 * BATCH}}, extra
        assert all(g["lr"] == HP["lr"] for o in opts for g in o.param_groups)
        layout.train(stages, opts, range(2, 4))
        out[f"resumed_{name}"] = _error_vs(stages, ref["after4"])
        if layout is pp2:  # the same mesh: bit-identical to the run that was not interrupted
            out["bitwise_same_mesh"] = all(map(torch.equal, _local_snapshot(stages), uninterrupted))

    # Interleaved pp 2 x dp_shard 2 (4 stages, 2 stages and 2 optimizers per rank): load the 1F1B
    # checkpoint (another split), step 3, save (async); fresh stages load that, step 4.
    inter = Layout(pp=2, dp_shard=2, stages_per_rank=2)
    stages, opts = inter.build(seed=7)
    ckpt.load(saved, stages, opts)
    inter.train(stages, opts, range(2, 3))
    ckpt.save_async(f"{root}/interleaved/step-3", stages, opts, step=3).wait()
    stages, opts = inter.build(seed=11)
    assert ckpt.load(f"{root}/interleaved/step-3", stages, opts)["step"] == 3
    inter.train(stages, opts, range(3, 4))
    out["interleaved_round_trip"] = _error_vs(stages, ref["after4"])

    # Refusals, on every rank, model untouched: (a) no rank holds the stored norm/output;
    # (b) ranks 2 and 3 hold a block the checkpoint lacks; (c) another optimizer class.
    stages, opts = pp2.build(seed=7, last=False)
    before = _local_snapshot(stages)
    out["no_rank_holds"] = _refused(ckpt.load, saved, stages, opts)
    out["untouched"] = all(torch.equal(a, b) for a, b in zip(before, _local_snapshot(stages), strict=True))
    stages, opts = pp2.build(seed=7, n_layers=5)
    out["extra_block"] = _refused(ckpt.load, saved, stages, opts)
    stages, _ = pp2.build(seed=7)
    sgd = [torch.optim.SGD(s.parameters(), lr=0.1, momentum=0.9) for s in stages]
    out["other_optimizer"] = _refused(ckpt.load, saved, stages, sgd)
    out["export_live"] = _refused(ckpt.export_safetensors, stages[0], f"{root}/live.safetensors")
    # Saves refused on every rank, nothing written: rank 3 without an optimizer; rank 3 with another lr
    # than rank 2, which holds the same stage.
    stages, opts = pp2.build(seed=7)
    out["optimizer_on_some"] = _refused(ckpt.save, f"{root}/bad", stages, None if dist.get_rank() == 3 else opts)
    if dist.get_rank() == 3:
        opts[0].param_groups[0]["lr"] = 0.02
    out["ranks_disagree"] = _refused(ckpt.save, f"{root}/bad", stages, opts)
    return out


@pytest.mark.slow
@_one_thread()
def test_pp_checkpoints_reshard_across_pp_sizes_and_resume_exactly(tmp_path):
    ref = reference()
    results = run_distributed(job_pp, 4, str(tmp_path), ref, threads_per_rank=1)
    for key in ("trained_pp2xdp2", "resumed_pp2xdp2", "resumed_pp1xdp4", "resumed_pp4", "interleaved_round_trip"):
        worst = max(r[key] for r in results)
        assert worst <= TOL, f"{key}: parameters differ from the single-process run by {worst:.3g}"

    # One error text per refusal, the same on every rank.
    for key in (
        "no_rank_holds",
        "extra_block",
        "other_optimizer",
        "export_live",
        "optimizer_on_some",
        "ranks_disagree",
    ):
        assert len({r[key] for r in results}) == 1 and results[0][key], key
    assert all(r["untouched"] and r["bitwise_same_mesh"] for r in results)
    assert (
        "does not fit the model: missing [] (0), unexpected ['model.norm.weight', 'model.output.weight'] (2)"
        in (results[0]["no_rank_holds"])
    )
    assert "rank 2 of 4: " in results[0]["extra_block"] and "(ranks [3] failed too)" in results[0]["extra_block"]
    assert "missing ['model.layers.4." in results[0]["extra_block"]
    assert "does not fit the optimizer: missing ['optimizer.param_groups." in results[0]["other_optimizer"]
    assert "unexpected ['optimizer.state." in results[0]["other_optimizer"]
    assert "some ranks pass an optimizer and others do not" in results[0]["optimizer_on_some"]
    assert "ranks disagree on optimizer key 'param_groups.layers.2." in results[0]["ranks_disagree"]
    assert not list(tmp_path.glob("bad*")), "a refused save writes nothing"

    # The state JSON lists every stage's keys (not rank 0's only), the optimizer flat per parameter.
    saved = tmp_path / "pp2xdp2" / "step-2"
    state = json.loads((saved / ckpt.STATE_FILE).read_text())
    assert set(state["model"]) == set(ref["after2"])
    assert {k for k in state["optimizer"] if k.startswith("state.")} == {
        f"state.{n}.{s}" for n in ref["after2"] for s in ("step", "exp_avg", "exp_avg_sq")
    }
    assert state["optimizer"]["param_groups.output.weight.betas"] == {"__tuple__": [0.9, 0.95]}
    ckpt.validate(saved, checksums=True)
    assert "the ranks hold different parameters (pipeline stages?)" in results[0]["export_live"]
    from safetensors.torch import load_file

    exported = load_file(ckpt.export_safetensors(saved, tmp_path / "w.safetensors"))
    assert exported.keys() == ref["after2"].keys()
    assert max((exported[n] - p).abs().max().item() for n, p in ref["after2"].items()) <= TOL

    # One process, no process group: the plain Transformer loads the pp checkpoints and continues.
    for path, steps in ((saved, range(2, 4)), (tmp_path / "interleaved" / "step-3", range(3, 4))):
        model = Transformer(dataclasses.replace(CFG, seed=5))
        opt = torch.optim.AdamW(model.parameters(), **{**HP, "lr": WRONG_LR})
        ckpt.load(path, model, opt)
        for step in steps:
            x, y = _batches()[step]
            _loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        worst = max((p.detach() - ref["after4"][n]).abs().max().item() for n, p in model.named_parameters())
        assert worst <= TOL, f"{path.name} in one process: {worst:.3g}"


# ----------------------------------------------------------------------------- one process: arguments


@_one_thread()
def test_several_modules_need_one_optimizer_each_and_distinct_names(tmp_path):
    stages = build_stages([0, 1], 2, None)
    opts = [torch.optim.AdamW(s.parameters(), **HP) for s in stages]
    path = ckpt.save(tmp_path / "two", stages, opts, step=0)  # two stages in one process: the whole model
    whole = Transformer(dataclasses.replace(CFG, seed=3))
    ckpt.load(path, whole, torch.optim.AdamW(whole.parameters(), **HP))
    assert all(torch.equal(p, Transformer(CFG).state_dict()[n]) for n, p in whole.state_dict().items())
    with pytest.raises(CheckpointError, match=r"2 module\(s\) but 1 optimizer\(s\): pass one torch.optim.Optimizer"):
        ckpt.save(tmp_path / "bad", stages, opts[0])
    with pytest.raises(CheckpointError, match=r"2 module\(s\) but 1 optimizer\(s\)"):
        ckpt.load(path, stages, opts[:1])
    with pytest.raises(CheckpointError, match=r"module 1 repeats model key\(s\) \['layers.0.attention.wk.weight'"):
        ckpt.save(tmp_path / "bad", [stages[0], stages[0]])
    with pytest.raises(CheckpointError, match="non-empty sequence"):
        ckpt.save(tmp_path / "bad", [])
    assert not (tmp_path / "bad").exists()
