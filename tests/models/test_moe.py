"""The reference mixture of experts in one process: routing against a per-token loop, the losses, init, the rules."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.config.preflight import JobShape, job_problems
from ndparallel.errors import ConfigError
from ndparallel.models import Transformer, TransformerConfig
from ndparallel.models.transformer.moe import MoE, update_router_biases
from ndparallel.parallel.loss import auxiliary_loss


def _cfg(**fields) -> TransformerConfig:
    return TransformerConfig.from_preset("tiny-moe", dtype="float64", **fields)


def _naive(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: its top-k experts' outputs weighted by the router, plus the shared experts."""
    flat = x.reshape(-1, x.shape[-1])
    probs, indices, weights = moe.router(moe.router.gate(flat))
    e = moe.experts
    rows = []
    for t in range(flat.shape[0]):
        out = moe.shared_experts(flat[t]) if moe.shared_experts is not None else torch.zeros_like(flat[t])
        for j in range(moe.top_k):
            k = int(indices[t, j])
            out = out + weights[t, j] * (F.silu(e.w1[k] @ flat[t]) * (e.w3[k] @ flat[t])) @ e.w2[k].T
        rows.append(out)
    return torch.stack(rows).view_as(x)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_moe_equals_a_per_token_loop(router):
    model = Transformer(_cfg(router=router))
    moe = model.layers[0].feed_forward
    x = torch.randn(2, 8, model.config.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(moe(x), _naive(moe, x), rtol=0, atol=1e-14)


def test_aux_loss_values_and_collection():
    cfg = _cfg(aux_loss_coef=1.0, z_loss_coef=0.0)
    model = Transformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    model(tokens)
    moe = model.layers[1].feed_forward
    assert moe.aux_loss.item() >= 1.0 - 1e-12  # n_experts * sum f P is 1 when balanced, more otherwise
    total = auxiliary_loss(model)
    assert total is not None and moe.aux_loss is None  # taken once
    assert auxiliary_loss(model) is None
    assert auxiliary_loss(Transformer(TransformerConfig.from_preset("tiny"))) is None


def test_z_loss_is_the_mean_squared_logsumexp():
    model = Transformer(_cfg(aux_loss_coef=0.0, z_loss_coef=1.0))
    moe = model.layers[0].feed_forward
    x = torch.randn(1, 4, model.config.dim, dtype=torch.float64)
    moe(x)
    logits = moe.router.gate(x.reshape(-1, x.shape[-1]))
    torch.testing.assert_close(moe.aux_loss, torch.logsumexp(logits, -1).square().mean())


def test_seeded_init_and_every_expert_gets_a_gradient():
    a, b = Transformer(_cfg()), Transformer(_cfg())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert a.layers[0].feed_forward.experts.w1.shape == (4, 32, 64)
    tokens = torch.randint(0, 256, (1, 4))
    (a(tokens).sum() + auxiliary_loss(a)).backward()
    assert all(p.grad is not None for p in a.parameters())
    assert a.config.num_params() == sum(p.numel() for p in a.parameters())


def test_sigmoid_bias_moves_towards_underloaded_experts():
    model = Transformer(_cfg(router="sigmoid"))
    model(torch.randint(0, 256, (2, 8)))
    router = model.layers[0].feed_forward.router
    load = router.tokens_per_expert.clone()
    update_router_biases(model, 0.1)
    torch.testing.assert_close(router.expert_bias, 0.1 * torch.sign(load.mean() - load))
    assert router.tokens_per_expert.sum() == 0


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"top_k": 5}, "model.top_k=5 must be between 1 and model.n_experts=4"),
        ({"top_k": 0}, "model.top_k=0 must be between 1"),
        ({"router": "relu"}, "model.router='relu' is not one of"),
        ({"aux_loss_coef": -1}, "model.aux_loss_coef=-1 must be a finite number >= 0"),
    ],
)
def test_bad_moe_shapes(fields, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(**fields)


def test_preflight_ep_rules():
    job = JobShape(global_batch=8, seq_len=16)
    p = ParallelismConfig(dp_shard_size=4, ep_size=4).resolve(4)
    assert job_problems(p, job, _cfg().preflight_shape()) == []
    dense = TransformerConfig.from_preset("tiny").preflight_shape()
    assert "ep_size=4 but the model is dense" in job_problems(p, job, dense)[0]
    six = _cfg(n_experts=6).preflight_shape()
    assert "ep_size=4 does not divide model.n_experts=6" in job_problems(p, job, six)[0]
    assert dataclasses.replace(p, ep_size=2).describe() == "dp_shard=4 (ep=2)"
    compiled = dataclasses.replace(p, ep_size=1, compile="blocks")
    assert "compile='blocks' on a mixture-of-experts model" in job_problems(compiled, job, _cfg().preflight_shape())[0]
    assert job_problems(compiled, job, dense) == []


def test_grouped_mm_experts_equal_the_loop_in_fp32():
    """``experts_impl="grouped_mm"`` (torch's grouped GEMM, CPU fp32 kernel here; CUDA bf16 not measured: no GPU)
    computes what the loop does, an expert with no rows included; float64 has no grouped kernel: refused."""
    from ndparallel.models.transformer.moe import GroupedExperts

    experts = GroupedExperts(16, 8, 4, torch.float32, impl="grouped_mm")
    for param in experts.parameters():
        torch.nn.init.normal_(param, generator=torch.Generator().manual_seed(1))
    rows = torch.randn(12, 16, generator=torch.Generator().manual_seed(2))
    counts = [5, 0, 4, 3]  # expert 1 gets no row
    grouped = experts.compute(rows, counts, experts.w1, experts.w3, experts.w2)
    experts.impl = "loop"
    assert torch.allclose(grouped, experts.compute(rows, counts, experts.w1, experts.w3, experts.w2), atol=1e-6)

    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(3))
    results = []
    for impl in ("loop", "grouped_mm"):
        model = Transformer(TransformerConfig.from_preset("tiny-moe", experts_impl=impl, dtype="float32"))
        (F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()) + auxiliary_loss(model)).backward()
        results.append({name: p.grad for name, p in model.named_parameters()})
    assert max(float((results[0][n] - results[1][n]).abs().max()) for n in results[0]) <= 1e-6
    with pytest.raises(ConfigError, match="grouped GEMM has no float64 kernel"):
        TransformerConfig.from_preset("tiny-moe", experts_impl="grouped_mm", dtype="float64")
    with pytest.raises(ConfigError, match="model.experts_impl='gmm' must be one of"):
        TransformerConfig.from_preset("tiny-moe", experts_impl="gmm")
