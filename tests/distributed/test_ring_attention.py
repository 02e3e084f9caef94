"""Ring attention op vs full attention in one process: outputs and dQ/dK/dV, every rotate method,
with and without load balancing, causal and not, grouped-query heads; float64 gradcheck on 2 ranks."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ndparallel.config.sequence import check_sequence_length
from ndparallel.distributed.ring import attention_kernel, ring_attention, visible_blocks
from ndparallel.errors import ConfigError
from ndparallel.parallel.context_parallel import sequence_indices, shard_sequence
from ndparallel.testing import run_distributed
from tests.sequence_functions import GatherRows, ShardRows

# (rotate, load_balanced, causal, kv_heads) with 4 query heads.
CASES = list(itertools.product(("ring", "allgather"), (True, False), (True, False), (4, 2)))


def full_attention(q, k, v, causal: bool):
    """The reference: CoreAttention's math on the whole sequence (``[batch, seq, heads, dim]``)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    repeats = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)


def capped_attention(q, k, v, causal: bool, softcap: float):
    """The reference with logit soft-capping (Gemma 2's eager attention): scores ``tanh(s / cap) * cap``."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    repeats = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    scores = torch.tanh(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 / softcap) * softcap
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def _inputs(seq: int, kv_heads: int, dtype: torch.dtype, seed: int = 0, batch: int = 2, heads: int = 4, dim: int = 8):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, dim, generator=gen, dtype=dtype)
    k = torch.randn(batch, seq, kv_heads, dim, generator=gen, dtype=dtype)
    v = torch.randn(batch, seq, kv_heads, dim, generator=gen, dtype=dtype)
    dout = torch.randn(batch, seq, heads, dim, generator=gen, dtype=dtype)
    return q, k, v, dout


def _max_errors(group, rotate, balanced, causal, kv_heads, dtype, seq, kernel=None, softcap=None) -> float:
    """Max abs difference of this rank's out, dq, dk, dv from the full-attention reference."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, dout = _inputs(seq, kv_heads, dtype)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = full_attention(*full, causal) if softcap is None else capped_attention(*full, causal, softcap)
    ref_out.backward(dout)
    expected = [ref_out.detach(), *(t.grad for t in full)]

    def shard(t):
        return shard_sequence(t, 1, cp, rank, balanced)

    local = [shard(t).requires_grad_() for t in (q, k, v)]
    out = ring_attention(
        *local, group, causal=causal, rotate=rotate, load_balanced=balanced, kernel=kernel, softcap=softcap
    )
    out.backward(shard(dout))
    got = [out.detach(), *(t.grad for t in local)]
    return max((g - shard(e)).abs().max().item() for g, e in zip(got, expected, strict=True))


def op_parity(seq: int) -> dict[str, float]:
    """Every case on the world group (fp32 with the CPU flash kernel, float64 with the math kernel),
    plus, on 4 ranks, the cp groups of a dp_shard 2 x cp 2 mesh (P2P inside sub-groups)."""
    import ndparallel as ndp

    errors = {}
    for rotate, balanced, causal, kv_heads in CASES:
        name = f"{rotate}-lb{int(balanced)}-causal{int(causal)}-kv{kv_heads}"
        errors[f"fp32-{name}"] = _max_errors(None, rotate, balanced, causal, kv_heads, torch.float32, seq)
        errors[f"fp64-{name}"] = _max_errors(None, rotate, balanced, causal, kv_heads, torch.float64, seq)
    errors["fp32-math-kernel"] = _max_errors(None, "ring", True, True, 2, torch.float32, seq, kernel="math")
    for rotate, balanced in itertools.product(("ring", "allgather"), (True, False)):  # Gemma 2's logit cap
        errors[f"fp64-softcap-{rotate}-lb{int(balanced)}"] = _max_errors(
            None, rotate, balanced, True, 2, torch.float64, seq, softcap=0.5
        )
    if dist.get_world_size() == 4:
        mesh = ndp.init_distributed(ndp.ParallelismConfig(dp_shard_size=2, cp_size=2))
        group = mesh["cp"].get_group()
        for rotate in ("ring", "allgather"):
            errors[f"subgroup-{rotate}"] = _max_errors(group, rotate, True, True, 2, torch.float32, seq)
    return errors


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_full_attention(cp):
    results = run_distributed(op_parity, cp, 8 * cp)
    for rank, errors in enumerate(results):
        for name, err in errors.items():
            tol = 1e-10 if name.startswith("fp64") else 1e-5
            assert err <= tol, f"cp={cp} rank {rank} {name}: max error {err:.3g} > {tol}"
    assert len(results[0]) == 2 * len(CASES) + 1 + 4 + (2 if cp == 4 else 0)


# ----------------------------------------------------------------------- float64 gradcheck (2 ranks)


def distributed_gradcheck() -> list[str]:
    """gradcheck of q, k, v -> gather(ring_attention(shard(q), shard(k), shard(v))) with every rank
    perturbing the same input element in lockstep, so numerical and analytical Jacobians are the
    distributed op's own."""
    checked = []
    for rotate, balanced, causal in [("ring", True, True), ("allgather", True, True), ("ring", False, True),
                                     ("allgather", False, False)]:  # fmt: skip
        q, k, v, _ = _inputs(seq=8, kv_heads=1, dtype=torch.float64, batch=1, heads=2, dim=4)

        def fn(q, k, v, rotate=rotate, balanced=balanced, causal=causal):
            local = [ShardRows.apply(t, balanced) for t in (q, k, v)]
            out = ring_attention(*local, None, causal=causal, rotate=rotate, load_balanced=balanced)
            return GatherRows.apply(out, balanced)

        inputs = tuple(t.requires_grad_() for t in (q, k, v))
        assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)
        checked.append(f"{rotate}-lb{int(balanced)}-causal{int(causal)}")
    return checked


@pytest.mark.slow  # the fast tier's parity above already holds the float64 gradients to 1e-10 of full attention
def test_ring_attention_gradcheck_float64():
    results = run_distributed(distributed_gradcheck, 2)
    assert results[0] == results[1] and len(results[0]) == 4


# ------------------------------------------------------------------------------- single process


def test_math_kernel_matches_cpu_flash_kernel():
    q, k, v, dout = (t.transpose(1, 2) for t in _inputs(16, 4, torch.float32))
    flash = attention_kernel(q.device, q.dtype, q.shape[-1])
    math = attention_kernel(q.device, q.dtype, q.shape[-1], name="math")
    assert flash.name == "cpu_flash" and attention_kernel(q.device, torch.float64, 8).name == "math"
    for causal in (True, False):
        out_f, lse_f, _ = flash.forward(q, k, v, causal, 0.3)
        out_m, lse_m, _ = math.forward(q, k, v, causal, 0.3)
        assert torch.allclose(out_f, out_m, atol=1e-5) and torch.allclose(lse_f, lse_m, atol=1e-5)
        grads_f = flash.backward(dout, q, k, v, out_f, lse_f, causal, 0.3, None)
        grads_m = math.backward(dout, q, k, v, out_m, lse_m, causal, 0.3, None)
        for a, b in zip(grads_f, grads_m, strict=True):
            assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_load_balanced_layout_is_a_permutation_with_equal_causal_work(cp):
    seq = 2 * cp * 3
    shards = [sequence_indices(seq, cp, r, load_balance=True) for r in range(cp)]
    assert sorted(torch.cat(shards).tolist()) == list(range(seq))
    work = [int((s + 1).sum()) for s in shards]  # query at position p attends to p + 1 keys
    assert len(set(work)) == 1, work
    plain = [sequence_indices(seq, cp, r, load_balance=False) for r in range(cp)]
    assert torch.cat(plain).tolist() == list(range(seq))


def test_visible_blocks_cover_exactly_the_causal_pairs():
    cp, local = 3, 4
    for balanced in (True, False):
        positions = [sequence_indices(cp * local, cp, r, balanced) for r in range(cp)]
        for rank, src in itertools.product(range(cp), repeat=2):
            visible = torch.zeros(local, local, dtype=torch.bool)
            for rows, cols, causal in visible_blocks(rank, src, True, balanced, local):
                block = torch.ones(rows.stop - rows.start, cols.stop - cols.start, dtype=torch.bool)
                visible[rows, cols] = block.tril() if causal else block
            expected = positions[rank][:, None] >= positions[src][None, :]
            assert torch.equal(visible, expected), (balanced, rank, src)


def test_sequence_length_validation_names_the_fix():
    with pytest.raises(ConfigError, match=r"not divisible by 2 x cp_size = 8.*cp_load_balance=false"):
        check_sequence_length(20, 4, 1, load_balance=True)
    with pytest.raises(ConfigError, match="not divisible by cp_size=3"):
        check_sequence_length(10, 3, 1, load_balance=False)
    check_sequence_length(24, 4, 1, load_balance=True)
    check_sequence_length(12, 4, 1, load_balance=False)


def bad_inputs() -> list[str]:
    messages = []
    q, k, v, _ = _inputs(seq=6, kv_heads=3, dtype=torch.float32)
    for kwargs in ({"rotate": "ulysses"}, {}):
        with pytest.raises(ConfigError) as err:
            ring_attention(q, k, v, None, **kwargs)  # 4 query heads, 3 kv heads
        messages.append(str(err.value))
    q, k, v, _ = _inputs(seq=3, kv_heads=2, dtype=torch.float32)
    with pytest.raises(ConfigError) as err:
        ring_attention(q, k, v, None, load_balanced=True)
    messages.append(str(err.value))
    q, k, v, _ = _inputs(seq=8, kv_heads=2, dtype=torch.float32)
    for kwargs in ({"rotate": "alltoall"}, {"sinks": torch.zeros(4)}, {"kernel": "cpu_flash"}):
        with pytest.raises(ConfigError) as err:  # soft-capping runs the ring's math kernel only
            ring_attention(q, k, v, None, softcap=1.0, **kwargs)
        messages.append(str(err.value))
    return messages


def test_bad_inputs_raise_config_error():
    messages = run_distributed(bad_inputs, 2)[0]
    assert "cp_rotate_method='ulysses'" in messages[0]
    assert "kv heads=3 must divide query heads=4" in messages[1]
    assert "local sequence length 3 on cp_size=2" in messages[2] and "2 x cp_size = 4" in messages[2]
    assert "soft-capping with cp_rotate_method='alltoall'" in messages[3]
    assert "soft-capping with sinks" in messages[4] and "soft-capping with cpu_flash" in messages[5]


# ------------------------------------------------------------------- CUDA kernels (GPU machines only)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA SDPA kernels need a GPU")
@pytest.mark.parametrize(("name", "dtype", "tol"), [("cuda_efficient", torch.float32, 1e-4),
                                                    ("cuda_flash", torch.bfloat16, 3e-2)])  # fmt: skip
def test_cuda_kernels_match_math(name, dtype, tol):
    """Each CUDA wrapper (forward with LSE, backward from a given out/LSE) against the math kernel, on the
    block shapes ring attention uses: square causal, and a half of the queries or keys, full (seq 40: LSE
    padding of the efficient kernel)."""
    kernel, math = (
        attention_kernel(torch.device("cuda"), dtype, 64, name=name),
        attention_kernel(None, dtype, 64, "math"),
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(2, 4, 40, 64, device="cuda", generator=gen).to(dtype) for _ in range(4))
    for rows, cols, causal in [(slice(0, 40), slice(0, 40), True), (slice(0, 40), slice(0, 20), False),
                               (slice(20, 40), slice(0, 40), False)]:  # fmt: skip
        args = (q[:, :, rows], k[:, :, cols], v[:, :, cols])
        out, lse, aux = kernel.forward(*args, causal, 0.125)
        ref_out, ref_lse, _ = math.forward(*args, causal, 0.125)
        assert (out.float() - ref_out.float()).abs().max() <= tol and (lse - ref_lse).abs().max() <= tol
        grads = kernel.backward(dout[:, :, rows], *args, ref_out, ref_lse, causal, 0.125, aux)
        ref_grads = math.backward(dout[:, :, rows], *args, ref_out, ref_lse, causal, 0.125, None)
        for got, ref in zip(grads, ref_grads, strict=True):
            assert (got.float() - ref.float()).abs().max() <= tol * max(1.0, ref.abs().max().item())
