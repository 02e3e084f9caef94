"""``compile: blocks`` end to end: per-block graphs plus the compiled loss head (projection + cross entropy in one
graph, inside the output projection's forward where FSDP has gathered its weight), through the training step.

Float64 on dp_shard 2 (FSDP) against one plain eager process, same seed and global batch: losses, grad norms and
step-1 gradients within 1e-10. Marked ``slow``: inductor builds the graphs (about 20 s on 2 cores).
"""

from __future__ import annotations

import contextlib

import pytest

from ndparallel.testing import run_distributed
from tests.parity import assert_parity, build_model, full_grads, make_batches, reference

STEPS, GLOBAL_BATCH, SEQ, LR = 2, 8, 32, 1e-3


def _compiled_blocks_run() -> dict:
    import torch

    import ndparallel as ndp
    from ndparallel.distributed.reduce import average_over
    from ndparallel.train.step import TrainStep

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cfg = ndp.ParallelismConfig(dp_shard_size=2, compile="blocks")
    mesh = ndp.init_distributed(cfg)
    torch.manual_seed(0)
    model = ndp.parallelize(build_model(seed=0, dtype="float64"), cfg, mesh)
    heads = []  # what each micro-batch's head call returned: a scalar loss, not logits
    model.output.register_forward_hook(lambda module, args, out: heads.append(tuple(out.shape)))
    grads: list[dict] = []

    @contextlib.contextmanager
    def around():  # entered around each micro-batch, then around clipping + optimizer: grads exist there
        yield
        if not grads and any(p.grad is not None for p in model.parameters()):
            grads.append(full_grads(model))

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    step = TrainStep(model, optimizer, mesh, max_grad_norm=0.0, around=around)
    per_rank, rank = GLOBAL_BATCH // mesh.size("dp"), mesh.local_rank("dp")
    losses, norms = [], []
    for index, (tokens, labels) in enumerate(make_batches(STEPS, GLOBAL_BATCH, SEQ, model.config.vocab_size)):
        part = slice(rank * per_rank, (rank + 1) * per_rank)
        result = step(tokens[part], labels[part], accumulation=1, step=index + 1)
        losses.append(average_over(mesh["dp_cp"], result.loss))
        norms.append(result.grad_norm)
    return {
        "losses": losses,
        "grad_norms": norms,
        "grads": grads[0],
        "dtype": "float64",
        "loss_in_forward": model.loss_in_forward,
        "head_outputs": heads,
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
    }


@pytest.mark.slow
def test_compile_blocks_with_the_loss_head_matches_one_process_on_fsdp():
    ranks = run_distributed(_compiled_blocks_run, 2, timeout=600)
    ref = reference(steps=STEPS, max_norm=None, dtype="float64", lr=LR, global_batch=GLOBAL_BATCH, seq_len=SEQ)
    for rank, got in enumerate(ranks):
        assert got["loss_in_forward"], rank
        assert got["head_outputs"] == [()] * STEPS, got["head_outputs"]  # the loss came out of the head
        assert got["graphs"] >= 2, got["graphs"]  # the blocks' graph and the head's
        assert_parity(got, ref, label=f"compile blocks + loss head, rank {rank}")
