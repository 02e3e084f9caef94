"""Packed and padded batches on the reference Transformer, float64, every dimension against one process.

Each batch packs documents of several lengths per row (``document_ids``, rotary positions restarting per
document) with padding tails (negative ids, labels -100), so every attention block kind occurs: skipped,
unmasked, causal and masked. The loss is the mean over the global batch's real tokens (each rank scales its
token sum by the global count), as one process computes it. make test: tp 2, cp 2 (ring), pp 2 (the mask split
with the micro-batches), pp 2 x cp 2, pp 2 x tp 2 and, on the MoE preset, ep 2 x cp 2; make zoo: cp 2 on
allgather (not load-balanced) and alltoall, dp_shard 2 x cp 2 and tp 2 x cp 2. Losses, grad norms and step-1
gradients within 1e-10.
The one-process reference itself equals running each document alone (the sanity anchor).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from ndparallel.errors import ConfigError
from ndparallel.testing import run_distributed
from tests.parity import FLOAT64_TOL, NO_CLIP, adamw, assert_parity, build_model, full_grads

STEPS, BATCH, SEQ, MICRO = 2, 4, 16, 2
DOCUMENTS = [[3, 7, 4], [16], [5, 5, 2], [9, 7]]  # lengths per row; the rest of a row is padding
MOE = {"preset": "tiny-moe", "aux_loss_coef": 0.1}
# make test; the rotate methods and tp x cp are also proved at the op level (test_attention_masks.py) and on
# Hugging Face models (test_hf_masks.py): here under make zoo
LAYOUTS = {
    2: {"tp2": {"tp_size": 2}, "cp2_ring": {"cp_size": 2}, "pp2": {"pp_size": 2}},
    4: {
        "pp2_cp2": {"pp_size": 2, "cp_size": 2},
        "pp2_tp2": {"pp_size": 2, "tp_size": 2},
        "ep2_cp2_moe": {"dp_shard_size": 2, "cp_size": 2, "ep_size": 2},
    },
}
ZOO_LAYOUTS = {
    2: {
        "cp2_allgather_contiguous": {"cp_size": 2, "cp_rotate_method": "allgather", "cp_load_balance": False},
        "cp2_alltoall": {"cp_size": 2, "cp_rotate_method": "alltoall"},
    },
    4: {"dp2_cp2": {"dp_shard_size": 2, "cp_size": 2}, "tp2_cp2": {"tp_size": 2, "cp_size": 2}},
}


def packed_batch(step: int) -> dict[str, torch.Tensor]:
    """The global batch of ``step``: tokens, labels, restarting positions and document ids (-1: padding)."""
    generator = torch.Generator().manual_seed(step)
    data = torch.randint(0, 256, (BATCH, SEQ + 1), generator=generator)
    tokens, labels = data[:, :-1].clone(), data[:, 1:].clone()
    ids = torch.full((BATCH, SEQ), -1)
    positions = torch.zeros(BATCH, SEQ, dtype=torch.long)
    for row, lengths in enumerate(DOCUMENTS):
        start = 0
        for doc, n in enumerate(lengths):
            ids[row, start : start + n] = doc
            positions[row, start : start + n] = torch.arange(n)
            labels[row, start + n - 1] = -100  # a document's last token does not predict the next one's first
            start += n
    labels[ids < 0] = -100
    return {"tokens": tokens, "labels": labels, "positions": positions, "document_ids": ids}


def _scaled_loss(logits, labels, total: int, ranks: int) -> torch.Tensor:
    """This rank's token-sum of the cross entropy over the global count, times the ranks averaging gradients:
    averaged over dp x cp it is the one-process mean over the global batch's real tokens."""
    from ndparallel.parallel.loss import cross_entropy_loss

    count = int((labels != -100).sum())
    return cross_entropy_loss(logits, labels) * (count * ranks / total)


def train(parallel: dict | None, steps: int = STEPS, moe: bool = False) -> dict:
    """``steps`` AdamW steps on the packed batches; ``parallel=None``: one process (``moe``: the MoE preset)."""
    import ndparallel as ndp
    from ndparallel.distributed.reduce import average_over
    from ndparallel.parallel.clip import clip_grad_norm_
    from ndparallel.parallel.context_parallel import context_parallel
    from ndparallel.parallel.loss import auxiliary_loss

    model_fields = MOE if moe or (parallel and parallel.get("ep_size", 1) > 1) else None
    if parallel and parallel.get("pp_size", 1) > 1:
        return _train_pipeline(parallel, steps)
    model, mesh, dp, rank = build_model(model_fields, dtype="float64"), None, 1, 0
    if parallel is not None:
        mesh = ndp.init_distributed(ndp.ParallelismConfig(**parallel))
        model = ndp.parallelize(model, mesh.config, mesh)
        dp, rank = mesh.size("dp"), mesh.local_rank("dp")
    optimizer = adamw(model.parameters(), lr=1e-2)
    result = {"losses": [], "grad_norms": [], "dtype": "float64"}
    for step in range(steps):
        batch = packed_batch(step)
        total = int((batch["labels"] != -100).sum())
        rows = slice(rank * BATCH // dp, (rank + 1) * BATCH // dp)
        x, y, positions, ids = (batch[k][rows].clone() for k in ("tokens", "labels", "positions", "document_ids"))
        ranks = 1 if mesh is None else mesh.size("dp_cp")
        buffers = [x, y, positions, ids]
        sharded = context_parallel(mesh, buffers, [1] * 4, no_restore=buffers) if mesh else contextlib.nullcontext()
        with sharded:
            loss = _scaled_loss(model(x, positions, document_ids=ids), y, total, ranks)
            aux = auxiliary_loss(model)
            (loss if aux is None else loss + aux).backward()
        result["losses"].append(loss.item() if mesh is None else average_over(mesh["dp_cp"], loss))
        if step == 0:
            result["grads"] = full_grads(model)
        result["grad_norms"].append(clip_grad_norm_(model.parameters(), NO_CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
    return result


def _train_pipeline(parallel: dict, steps: int) -> dict:
    """The same on pipeline stages (``MICRO`` micro-batches, the mask split with them); gradients of this rank's
    stages under the unsplit names (the test joins the ranks')."""
    import ndparallel as ndp
    from ndparallel.models import Transformer, TransformerConfig
    from ndparallel.parallel.loss import cross_entropy_loss
    from ndparallel.parallel.pipeline import build_pipeline

    mesh = ndp.init_distributed(ndp.ParallelismConfig(**parallel))
    with torch.device("meta"):
        model = Transformer(TransformerConfig.from_dict({"preset": "tiny", "dtype": "float64", "seed": 0}))
    scale = {"total": 1, "ranks": mesh.without_pp().size("dp_cp")}

    def loss_fn(logits, labels):  # torch divides each micro-batch's gradient by MICRO: multiply it back
        count = int((labels != -100).sum())
        return cross_entropy_loss(logits, labels) * (count * scale["ranks"] * MICRO / scale["total"])

    pipe = build_pipeline(model, mesh.config, mesh, microbatches=MICRO, loss_fn=loss_fn)
    optimizer = adamw(list(pipe.parameters()), lr=1e-2)
    result = {"losses": [], "grad_norms": [], "dtype": "float64", "grads": {}}
    dp, rank = mesh.size("dp"), mesh.local_rank("dp")
    for step in range(steps):
        batch = packed_batch(step)
        scale["total"] = int((batch["labels"] != -100).sum())
        rows = slice(rank * BATCH // dp, (rank + 1) * BATCH // dp)
        x, y, positions, ids = (batch[k][rows] for k in ("tokens", "labels", "positions", "document_ids"))
        result["losses"].append(pipe.step(x, y, positions=positions, document_ids=ids).item())
        if step == 0:
            result["grads"] = {n: g for stage in pipe.stages for n, g in full_grads(stage).items()}
        result["grad_norms"].append(pipe.clip_grad_norm_(NO_CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
    return result


def run_group(layouts: dict) -> dict:
    out = {}
    for name, layout in layouts.items():
        try:
            out[name] = train(layout)
        except Exception as err:  # reported per layout by the test
            out[name] = {"error": f"{type(err).__name__}: {err}"}
    return out


@pytest.fixture(scope="module")
def groups() -> dict:
    return {n: run_distributed(run_group, n, layouts, timeout=600) for n, layouts in LAYOUTS.items()}


@pytest.mark.slow  # two spawned groups (2 and 4 ranks), six layouts
@pytest.mark.parametrize(("world", "layout"), [(n, name) for n, layouts in LAYOUTS.items() for name in layouts])
def test_packed_batches_match_one_process(groups, world, layout):
    check(groups[world], layout)


@pytest.mark.zoo
def test_packed_batches_on_the_other_layouts():
    for world, layouts in ZOO_LAYOUTS.items():
        results = run_distributed(run_group, world, layouts, timeout=600)
        for layout in layouts:
            check(results, layout)


def check(results: list[dict], layout: str) -> None:
    """Every rank's run of ``layout`` against one process (a pipeline's gradients joined over its ranks)."""
    ref = _reference("moe" in layout)
    joined = {}
    for rank, result in enumerate(results):
        assert "error" not in result[layout], (layout, rank, result[layout])
        joined.update(result[layout]["grads"])  # pipeline stages: each rank holds some gradients
    for rank, result in enumerate(results):
        got = {**result[layout], "grads": {n: joined[n] for n in ref["grads"]}}
        assert_parity(got, ref, **FLOAT64_TOL, label=f"{layout} rank {rank}")


_REFERENCES: dict = {}


def _reference(moe: bool) -> dict:
    if moe not in _REFERENCES:
        _REFERENCES[moe] = train(None, moe=moe)
    return _REFERENCES[moe]


def test_one_process_packed_rows_equal_each_document_alone():
    """The sanity anchor: a packed row's logits are each document's own, run alone from position 0."""
    model = build_model(None, dtype="float64")
    batch = packed_batch(0)
    with torch.no_grad():
        packed = model(batch["tokens"], batch["positions"], document_ids=batch["document_ids"])
        for row, lengths in enumerate(DOCUMENTS):
            start = 0
            for n in lengths:
                alone = model(batch["tokens"][row : row + 1, start : start + n])
                assert (packed[row, start : start + n] - alone[0]).abs().max() < 1e-12, (row, start)
                start += n
        plain = model(batch["tokens"], batch["positions"])
    assert (plain - packed).abs().max() > 1e-3, "the documents must matter: otherwise parity proves nothing"


def test_bad_document_ids_are_refused_in_one_line():
    model = build_model(None, dtype="float64")
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"document_ids must be integers shaped like the tokens \[2, 8\]"):
        model(tokens, document_ids=torch.zeros(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="got torch.float32"):
        model(tokens, document_ids=torch.zeros(2, 8))
    from ndparallel.parallel.masks import hf_document_mask

    with pytest.raises(ConfigError, match="arbitrary attention mask"):
        hf_document_mask(2, 8, attention_mask=torch.ones(2, 8, 8))
