"""The Accelerator under pipeline parallelism (``ndparallel/accelerator/pipeline.py``): a hand-written Accelerate
loop equals one plain PyTorch process, on each pp layout (the test's parametrisation).

The loop is Accelerate's (prepare, ``model(...)``, ``accelerator.backward``, ``clip_grad_norm_``,
``optimizer.step``, ``scheduler.step``, ``zero_grad``); under pp the model call runs the pipeline step and
``backward`` is a no-op. float64, on real gloo ranks, against plain PyTorch in the pytest process over the
same global batches, with ``-100`` labels spread unevenly over micro-batches and dp ranks: losses, clipped
norms, step-1 gradients, the eval loss and the final parameters (gathered by ``get_state_dict`` and
``save_model``) within ``TOL``. The run saves its state after step 2; a fresh model, optimizer and scheduler
load it and repeat steps 3-4 exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ndparallel.config.pipeline import torch_supports_v_schedules
from ndparallel.testing import run_distributed

TOL = 1e-10  # float64
V_OR_LOOPED = "zbv" if torch_supports_v_schedules() else "interleaved_1f1b"  # V: both tied copies on one rank
STEPS, BATCH, SEQ, MAX_NORM = 4, 8, 16, 0.5
OPTIM = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
TINY = dict(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32, seed=0)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels for every step (global batch k = rows 8k..8k+7); ~30% of labels ignored, unevenly,
    and one sequence entirely ignored."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 64, (STEPS * BATCH, SEQ), generator=g)
    labels = torch.randint(0, 64, (STEPS * BATCH, SEQ), generator=g)
    labels[torch.rand(labels.shape, generator=g) < 0.3] = -100
    labels[3] = -100
    return tokens, labels


def _model(kind: str):
    if kind == "hf":
        from tests.parallel.pipeline.test_parity import _tiny_llama

        return _tiny_llama()
    if kind == "hf-tied":  # the embedding and lm_head one tensor: under pp a copy on each end stage
        from transformers import LlamaForCausalLM

        from tests.parallel.pipeline.test_parity import _tiny_llama_config

        torch.manual_seed(0)
        return LlamaForCausalLM(_tiny_llama_config(tie_word_embeddings=True)).double()
    from ndparallel.models import Transformer, TransformerConfig

    return Transformer(TransformerConfig(dtype="float64", **TINY))


def _loss(model, hf: bool, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if hf:  # Hugging Face's labels: shifted inside (transformers' own loss upcasts to fp32 only; this is fp64)
        logits = model(input_ids=x).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), y[:, 1:].flatten(), ignore_index=-100)
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)


def _schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))


def _reference(kind: str) -> dict:
    """One process, the whole model, each global batch at once."""
    hf = kind != "transformer"
    model = _model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False, **OPTIM)
    scheduler = _schedule(optimizer)
    tokens, labels = _data()
    out: dict = {"losses": [], "norms": []}
    for step in range(STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        loss = _loss(model, hf, tokens[rows], labels[rows])
        loss.backward()
        if step == 0:
            out["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
    model.eval()
    with torch.no_grad():
        out["eval"] = _loss(model, hf, tokens[:BATCH], labels[:BATCH]).item()
    out["final"] = {n: p.detach().clone() for n, p in model.state_dict().items()}
    return out


def _v_schedule(name: str) -> bool:
    """A V schedule (zbv, dualpipev): its forward-only eval is refused."""
    from ndparallel.config.pipeline import schedule_spec

    return schedule_spec(name).style == "v"


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _train(acc, kind: str, ref: dict, ckpt: str, resume_from: int | None = None) -> dict:
    """The Accelerate loop on this rank; steps ``resume_from``.. after loading ``ckpt`` when given."""
    from torch.utils.data import DataLoader, TensorDataset

    from ndparallel.errors import ConfigError

    hf = kind != "transformer"
    if hf:
        model = _model(kind)  # Hugging Face stages keep the weights of the model built on every rank
    else:
        with torch.device("meta"):  # no rank allocates a block it does not hold
            model = _model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False, **OPTIM)  # built before prepare
    scheduler = _schedule(optimizer)
    tokens, labels = _data()
    loader = DataLoader(TensorDataset(tokens, labels), batch_size=BATCH, shuffle=False)
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
    held = {id(p) for p in model.parameters()}
    # the stages' parameters exactly, a tied weight's copies included (others dropped)
    assert held == {id(p) for g in optimizer.param_groups for p in g["params"]}
    err = {"loss": 0.0, "norm": 0.0, "grad": 0.0, "eval": 0.0, "final": 0.0}
    first = None
    start = 0
    if resume_from is not None:
        acc.load_state(ckpt)
        start = resume_from
    for step, (x, y) in enumerate(loader):
        if step < start:
            continue
        first = first if first is not None else x.clone()
        model.train()
        with acc.accumulate(model):  # Accelerate's canonical loop: a no-op for a pipeline model
            out = model(input_ids=x, labels=y) if hf else model(x, shift_labels=y)
            acc.backward(out.loss)
        if step == 0:
            for name, param in model.one_process_parameters():  # a tied copy: the one weight's gradient
                err["grad"] = max(err["grad"], (_full(param.grad) - ref["grads"][name]).abs().max().item())
        norm = acc.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        err["loss"] = max(err["loss"], abs(out.loss.item() - ref["losses"][step]))
        err["norm"] = max(err["norm"], abs(norm.item() - ref["norms"][step]))
        if step == 1 and resume_from is None:
            acc.save_state(ckpt)
    model.eval()
    eval_x, eval_y = next(iter(loader))
    refusals = []
    wrong_calls: tuple = ()
    if _v_schedule(acc._config.pp_schedule):
        # torch's V schedules cannot run forward-only: refused on every rank before the schedule starts
        with pytest.raises(ConfigError, match="fails inside torch's V schedules"), torch.no_grad():
            model(input_ids=eval_x, labels=eval_y)
    else:
        with torch.no_grad():
            out = model(input_ids=eval_x, labels=eval_y) if hf else model(eval_x, shift_labels=eval_y)
        err["eval"] = abs(out.loss.item() - ref["eval"])
        assert out.logits is None
        wrong_calls = (
            lambda: model(eval_x),
            lambda: acc.backward(out.loss),
            lambda: acc.backward(out.loss * 1.0),
            lambda: acc.no_sync(model),
            # one rank's batch shape changes: every rank refuses it before the schedule (else the others would hang)
            lambda: (
                model(eval_x[:, :-1], shift_labels=eval_y[:, :-1])
                if acc.process_index == 0
                else model(eval_x, shift_labels=eval_y)
            ),
        )
    for bad in wrong_calls:
        try:
            bad()
        except ConfigError as e:
            refusals.append(str(e))
    state = acc.get_state_dict(model)
    acc.save_model(model, f"{ckpt}-weights")  # rank 0 writes every stage's full weights
    if state:
        from safetensors.torch import load_file

        saved = load_file(f"{ckpt}-weights/model.safetensors")
        assert state.keys() == ref["final"].keys() == saved.keys()
        assert all(torch.equal(saved[n], state[n]) for n in state)
        err["final"] = max((state[n] - ref["final"][n]).abs().max().item() for n in state)
    acc._models.clear()
    acc._optimizers.clear()
    acc._schedulers.clear()
    return {"err": err, "first_batch": first, "refusals": refusals, "main": bool(state)}


def _cases(cases: list[dict], refs: dict, root: str) -> list[dict]:
    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.distributed.process import init_distributed

    meshes: dict = {}
    results = []
    for i, case in enumerate(cases):
        cfg = ParallelismConfig(**case["parallel"])
        key = tuple(cfg.sizes.values())
        meshes[key] = meshes.get(key) or init_distributed(cfg)
        acc = Accelerator(
            cfg, mesh=meshes[key], split_batches=True, use_seedable_sampler=True
        )  # rank r: rows r, r + dp ...
        kind = case.get("ref", "transformer")
        ref, ckpt = refs[kind], f"{root}/ckpt{i}"
        run = _train(acc, kind, ref, ckpt)
        resumed = _train(acc, kind, ref, ckpt, resume_from=2)
        results.append({**run, "resumed": resumed["err"], "dp_rank": acc.mesh.local_rank("dp")})
    return results


@pytest.fixture(scope="module")
def refs() -> dict:
    out = {kind: _reference(kind) for kind in ("transformer", "hf", "hf-tied")}  # transformers: the [hf] extra
    assert min(out["transformer"]["norms"]) > MAX_NORM  # clipping is active on every step
    return out


def _check(results: list[list[dict]], cases: list[dict]) -> None:
    for index, case in enumerate(cases):
        per_rank = [r[index] for r in results]
        worst = {k: max(r["err"][k] for r in per_rank) for k in per_rank[0]["err"]}
        resumed = {k: max(r["resumed"][k] for r in per_rank) for k in ("loss", "norm", "final")}
        print(case, {k: f"{v:.1e}" for k, v in worst.items()}, "resumed", {k: f"{v:.1e}" for k, v in resumed.items()})
        assert max(worst.values()) < TOL and max(resumed.values()) < TOL, (case, worst, resumed)
        assert per_rank[0]["main"] and not any(r["main"] for r in per_rank[1:])  # full weights on rank 0 only
        for r in per_rank:  # ranks of one dp index (the pp ranks) get the same batch, other dp indices another
            same = [o for o in per_rank if o["dp_rank"] == r["dp_rank"]]
            assert all(torch.equal(o["first_batch"], r["first_batch"]) for o in same)
            assert len(same) == 2  # pp2
        if _v_schedule(case["parallel"].get("pp_schedule", "1f1b")):
            continue  # eval refused (asserted in _train), so no eval output to misuse
        for r in per_rank:
            assert "pipeline batch shape changed" in r["refusals"][4], r["refusals"]
        refusals = per_rank[0]["refusals"]
        assert len(refusals) == 5, refusals
        assert "pass exactly one of labels= (Hugging Face's convention" in refusals[0]
        assert all("pass its outputs.loss unchanged to accelerator.backward" in r for r in refusals[1:3])
        assert "no_sync() has no meaning under pp_size > 1" in refusals[3]


LAYOUTS = {  # layout: (ranks, cases, each rank's dp index)
    "pp2": (
        2,
        [
            {"parallel": {"pp_size": 2, "pp_schedule": "1f1b"}},
            {"parallel": {"pp_size": 2, "pp_schedule": "gpipe"}, "ref": "hf"},
            # tied word embeddings: the embedding on pp rank 0, the head's copy on pp rank 1; then both on one rank
            {"parallel": {"pp_size": 2}, "ref": "hf-tied"},
            {"parallel": {"pp_size": 2, "pp_schedule": V_OR_LOOPED, "pp_stages_per_rank": 2}, "ref": "hf-tied"},
        ],
        None,
    ),
    # Two stages per rank: the one prepared optimizer is checkpointed as one view per stage.
    "pp2-dp_shard2-interleaved": (
        4,
        [{"parallel": {"pp_size": 2, "dp_shard_size": 2, "pp_schedule": "interleaved_1f1b"}}],
        [0, 1, 0, 1],
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_accelerate_loop_under_pp_matches_one_process(refs, tmp_path, layout):
    world, cases, dp_ranks = LAYOUTS[layout]
    results = run_distributed(_cases, world, cases, refs, str(tmp_path), timeout=600)
    _check(results, cases)
    if dp_ranks is not None:
        assert [r[0]["dp_rank"] for r in results] == dp_ranks
