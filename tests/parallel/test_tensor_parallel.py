"""Tensor/sequence parallel plans: divisibility errors, DTensor parameters and gradients, the vocab-parallel loss,
and a user's own model with its own plan (the worked example of docs/parallelize.md), in float64 at 1e-10."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ndparallel.errors import ConfigError
from ndparallel.models.transformer.family import FAMILY, transformer_tp_plan
from ndparallel.parallel.loss import cross_entropy_loss
from ndparallel.parallel.tensor_parallel import check_tp_divisibility
from ndparallel.testing import run_distributed
from tests.parity import adamw, build_model


@pytest.mark.parametrize(
    ("model", "tp", "message"),
    [
        ({}, 3, "tp_size=3 does not divide n_heads=8"),
        ({}, 8, "tp_size=8 does not divide n_kv_heads=4"),
        ({"n_kv_heads": 8, "ffn_dim": 190}, 4, "tp_size=4 does not divide ffn_dim=190"),
        ({"vocab_size": 255}, 2, "tp_size=2 does not divide vocab_size=255"),
    ],
)
def test_tp_size_must_divide_the_model(model, tp, message):
    with pytest.raises(ConfigError, match=message):
        check_tp_divisibility(build_model(model), tp, transformer_tp_plan(), fields=FAMILY.split_fields)


def test_plan_checks_user_layers_without_a_config():
    from torch.distributed.tensor.parallel import ColwiseParallel

    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 7))
    with pytest.raises(ConfigError, match=r"tp_size=2 does not divide 1.out_features=7"):
        check_tp_divisibility(model, 2, {"1": ColwiseParallel()})
    check_tp_divisibility(model, 2, {"0": ColwiseParallel()})  # 6 splits in two: fine


def test_cross_entropy_loss_plain_tensor_is_torch_cross_entropy():
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, 0] = -100
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert torch.allclose(cross_entropy_loss(logits, labels), expected)


# ------------------------------------------------------------------------------- a user's own model
class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyMLPModel(nn.Module):
    """Not our Transformer: blocks in an nn.Sequential named ``trunk``, LayerNorm with bias, biased Linears."""

    def __init__(self, vocab: int = 64, dim: int = 32, hidden: int = 64, n_blocks: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.trunk = nn.Sequential(*(MLPBlock(dim, hidden) for _ in range(n_blocks)))
        self.final_norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.final_norm(self.trunk(self.embed(tokens))))


def user_plan() -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "trunk.*.norm": SequenceParallel(),
        "trunk.*.up": ColwiseParallel(input_layouts=Shard(1)),
        "trunk.*.down": RowwiseParallel(output_layouts=Shard(1)),
        "final_norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }


def _train_user_model(parallel: dict | None, steps: int = 3) -> dict:
    import ndparallel as ndp
    from ndparallel.distributed.reduce import average_over
    from ndparallel.parallel.clip import clip_grad_norm_
    from ndparallel.parallel.parallelize import parallelize
    from tests.parity import full_grads

    model = TinyMLPModel().double()
    mesh = None
    if parallel is not None:
        mesh = ndp.init_distributed(ndp.ParallelismConfig(**parallel))
        parallelize(
            model,
            mesh=mesh,
            tp_plan=user_plan(),
            blocks=lambda name, module: isinstance(module, MLPBlock),
            fsdp_groups=[["embed"], ["final_norm", "head"]],
        )
    optimizer = adamw(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(3)
    dp, rank = (mesh.size("dp"), mesh.local_rank("dp")) if mesh else (1, 0)
    losses, norms = [], []
    grads = None
    for step in range(steps):
        data = torch.randint(0, 64, (4, 17), generator=generator)
        part = data[rank * 4 // dp : (rank + 1) * 4 // dp]
        loss = cross_entropy_loss(model(part[:, :-1]), part[:, 1:])
        loss.backward()
        losses.append(average_over(mesh["dp_cp"] if mesh else None, loss))
        if step == 0:
            grads = full_grads(model)
        norms.append(clip_grad_norm_(model.parameters(), 1e9).item())
        optimizer.step()
        optimizer.zero_grad()
    kinds = {type(p).__name__ for p in model.parameters()}
    return {"losses": losses, "grad_norms": norms, "grads": grads, "param_kinds": sorted(kinds)}


# ------------------------------------------------------------------------------------ 4 ranks, packed
def _tp_checks() -> dict:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel

    import ndparallel as ndp
    from ndparallel.parallel.tensor_parallel import apply_tensor_parallel

    out = {}
    mesh = ndp.init_distributed(ndp.ParallelismConfig(dp_shard_size=2, tp_size=2))
    tp_mesh = mesh["tp"]

    # Reference Transformer under TP: every parameter (norms and embedding too) and gradient is a DTensor,
    # and after backward each gradient has its parameter's placements (sharded memory).
    model = apply_tensor_parallel(build_model(), tp_mesh, transformer_tp_plan())
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    cross_entropy_loss(model(tokens), tokens).backward()
    out["param_kinds"] = sorted({type(p).__name__ for p in model.parameters()})
    out["grad_layout_mismatch"] = [
        n for n, p in model.named_parameters() if not isinstance(p.grad, DTensor) or p.grad.placements != p.placements
    ]

    # Unknown plan entries are an error, not a silent no-op.
    try:
        apply_tensor_parallel(build_model(), tp_mesh, {"layers.*.attn.q_proj": ColwiseParallel()})
        out["unmatched"] = None
    except ConfigError as err:
        out["unmatched"] = str(err)

    # Vocab-parallel loss == full cross entropy, value and gradient; uneven vocab (255 over 2) and ignore_index.
    generator = torch.Generator().manual_seed(1)
    full = torch.randn(2, 6, 255, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 255, (2, 6), generator=generator)
    labels[1, 2] = -100
    labels[0, 0] = 254  # a label in the last, shorter shard
    ref_logits = full.clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten())
    ref.backward()
    sharded = distribute_tensor(full.clone(), tp_mesh, [Shard(-1)]).requires_grad_(True)
    loss = cross_entropy_loss(sharded, labels)
    loss.backward()
    out["loss_diff"] = abs(loss.item() - ref.item())
    out["loss_plain"] = type(loss) is torch.Tensor
    out["logit_grad_diff"] = (sharded.grad.full_tensor() - ref_logits.grad).abs().max().item()

    # A user's own model, own plan, own block predicate and FSDP groups, on dp_shard 2 x tp 2.
    out["user"] = _train_user_model({"dp_shard_size": 2, "tp_size": 2})
    return out


def test_tensor_parallel_4_ranks():
    outs = run_distributed(_tp_checks, 4)
    ref_user = _train_user_model(None)
    for rank, out in enumerate(outs):
        assert out["param_kinds"] == ["DTensor"], rank
        assert out["grad_layout_mismatch"] == [], rank
        assert "match no module of Transformer" in out["unmatched"]
        assert out["loss_diff"] < 1e-12 and out["loss_plain"]  # float64 logits: the loss stays float64
        assert out["logit_grad_diff"] < 1e-12
        user = out["user"]
        assert user["param_kinds"] == ["DTensor"]
        assert max(abs(a - b) for a, b in zip(user["losses"], ref_user["losses"], strict=True)) <= 1e-10, (
            user,
            ref_user,
        )
        for a, b in zip(user["grad_norms"], ref_user["grad_norms"], strict=True):
            assert abs(a - b) <= 1e-10 * b
        for name, grad in ref_user["grads"].items():
            assert grad.dtype == np.float64 and abs(user["grads"][name] - grad).max() <= 1e-10, name
