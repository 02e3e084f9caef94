"""Attention features a Hugging Face model hands the attention seam, under context parallel: exact or refused.

transformers passes each attention call its model's features as keywords (``scaling``, ``s_aux`` sinks,
``softcap``, ``dropout``) and encodes packed sequences in ``position_ids`` (those, padding and sliding windows:
tests/models/test_hf_masks.py). Under cp 2 each
feature either matches one process in float64 (loss, grad norms and step-1 gradients within 1e-10, for
cp_rotate_method ring, allgather and alltoall) or is refused by name before any step. Every refused feature
is shown to change the one-process output (so its refusal is not vacuous), every implemented one likewise.
DeepSeek-V3 (fp32 router beside a float64 model, MLA with v_head_dim != qk head dim) checks FSDP units
split by parameter dtype and the head-dim padding of the seam. One spawned group of 2 gloo ranks.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="Hugging Face tests need the hf extra: pip install 'ndparallel[hf]' (make test does)"
)

from ndparallel.errors import ConfigError  # noqa: E402
from ndparallel.testing import run_distributed  # noqa: E402
from tests.models.test_hf import hf_loss, raised  # noqa: E402
from tests.parity import NO_CLIP, adamw, assert_parity, full_grads, make_batches  # noqa: E402

STEPS, BATCH, SEQ, LR = 2, 2, 16, 1e-2
ROTATES = ("ring", "allgather", "alltoall")
COMMON = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    vocab_size=64,
    max_position_embeddings=64,
    initializer_range=0.2,
    attention_dropout=0.0,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
# Each model's tiny config. Windows are >= SEQ (exact as full causal) unless a case shortens them.
MODELS = {
    # custom scaling: attention_multiplier=0.5 is the scaling, not head_dim**-0.5 = 8**-0.5 (Gemma's
    # query_pre_attn_scalar is the same keyword, but Gemma's norms run in fp32: no float64 parity there)
    "granite": dict(attention_multiplier=0.5),
    # attention sinks (s_aux), sliding layers beside full ones
    "gpt_oss": dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=SEQ),
    # attention logit soft-capping
    "gemma2": dict(head_dim=8, query_pre_attn_scalar=8, sliding_window=SEQ, attn_logit_softcapping=1.0),
    "mistral": dict(sliding_window=SEQ),
    # MLA (q/k head dim 16, v head dim 8; head_dim = qk_rope_head_dim), fp32 router beside a float64 model
    "deepseek_v3": dict(
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        head_dim=8,
        moe_intermediate_size=16,
        first_k_dense_replace=1,
    ),
}
EAGER_ONLY = ("gemma2", "gpt_oss")  # no SDPA path in transformers: the one-process reference runs eager


def build(model_type: str, seed: int = 0, **overrides):
    """The tiny float64 model (DeepSeek-V3 keeps its router in fp32, as ``from_config`` builds it)."""
    config = transformers.AutoConfig.for_model(model_type, **{**COMMON, **MODELS[model_type], **overrides})
    config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    attn = "eager" if model_type in EAGER_ONLY else "sdpa"
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float64)


def train(model_type: str, parallel: dict | None, **overrides) -> dict:
    """``STEPS`` AdamW steps; ``parallel=None``: one process, the plain HF model."""
    import ndparallel as ndp
    from ndparallel.distributed.reduce import average_over
    from ndparallel.parallel.clip import clip_grad_norm_

    model, mesh = build(model_type, **overrides), None
    if parallel is not None:
        mesh = ndp.init_distributed(ndp.ParallelismConfig(**parallel))
        model = ndp.parallelize(model, mesh.config, mesh)
    optimizer = adamw(model.parameters(), lr=LR)
    result = {"losses": [], "grad_norms": [], "dtype": "float64"}
    for step, (tokens, labels) in enumerate(make_batches(STEPS, BATCH, SEQ, model.config.vocab_size)):
        loss = hf_loss(model, tokens, labels, mesh)
        loss.backward()
        result["losses"].append(average_over(mesh["dp_cp"] if mesh else None, loss))
        if step == 0:
            result["grads"] = full_grads(model)
        result["grad_norms"].append(clip_grad_norm_(model.parameters(), NO_CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
    return result


@functools.cache
def reference(model_type: str) -> dict:
    return train(model_type, None)


def one_process_logits(model_type: str, position_ids: torch.Tensor | None = None, **overrides) -> torch.Tensor:
    """Logits of the plain model on fixed tokens (the demonstrations that a feature changes the output)."""
    model = build(model_type, **overrides)
    tokens = make_batches(1, BATCH, SEQ, model.config.vocab_size)[0][0]
    with torch.no_grad():
        return model(input_ids=tokens, position_ids=position_ids, use_cache=False).logits  # as in training


# ---------------------------------------------------------------------------------------------- ranks

PARITY = [("granite", rotate) for rotate in ROTATES] + [("gpt_oss", rotate) for rotate in ROTATES]
PARITY += [("deepseek_v3", "ring"), ("deepseek_v3", "alltoall")]
CP2 = {"cp_size": 2}
PACKED = torch.arange(SEQ).remainder(SEQ // 2)[None].expand(BATCH, -1)  # two documents of SEQ / 2 tokens per row


def refusals() -> dict[str, str]:
    """The ConfigError of each refused feature under cp 2 (or tp 2), and whether the model was left untouched."""
    import ndparallel as ndp

    mesh = ndp.init_distributed(ndp.ParallelismConfig(**CP2))
    out = {}
    ulysses = ndp.init_distributed(ndp.ParallelismConfig(**CP2, cp_rotate_method="alltoall"))
    gemma2 = build("gemma2")  # soft-capping: exact on ring and allgather (tests/models/test_hf_zoo.py), not Ulysses
    out["softcap"] = raised(lambda: ndp.parallelize(gemma2, ulysses.config, ulysses))
    out["softcap_untouched"] = type(gemma2.lm_head.weight).__name__
    mesh = ndp.init_distributed(ndp.ParallelismConfig(**CP2))
    dropout = build("mistral", attention_dropout=0.1)
    out["dropout"] = raised(lambda: ndp.parallelize(dropout, mesh.config, mesh))
    tokens = make_batches(1, BATCH, SEQ, 64)[0][0]
    mistral = ndp.parallelize(build("mistral"), mesh.config, mesh)
    out["unknown_kwarg"] = raised(lambda: cp_forward(mistral, mesh, tokens, block_size=torch.tensor([0, 8])))
    out["cu_without_positions"] = raised(lambda: cp_forward(mistral, mesh, tokens, cu_seq_lens_q=torch.tensor([0, 8])))
    tp = ndp.init_distributed(ndp.ParallelismConfig(tp_size=2))
    from ndparallel.models.hf.attention import check_attention

    out["sinks_tp"] = raised(lambda: check_attention(build("gpt_oss"), tp.config, tp))
    return out


def cp_forward(model, mesh, tokens, position_ids=None, **kwargs) -> torch.Tensor:
    """A forward inside ``context_parallel``, ``position_ids`` sharded with the tokens; extra model keywords
    reach the attention call."""
    from ndparallel.parallel.context_parallel import context_parallel

    buffers = [tokens.clone()] + ([] if position_ids is None else [position_ids.clone()])
    with context_parallel(mesh, buffers, seq_dims=[1] * len(buffers), no_restore=buffers):
        positions = buffers[1] if position_ids is not None else None
        return model(input_ids=buffers[0], position_ids=positions, **kwargs).logits


def sink_kernels() -> dict[tuple[str, str], float]:
    """Sinks on every CPU ring kernel (float64 math, fp32 cpu_flash) and Ulysses, against one-process attention
    on the whole sequence: max |difference| of the output and of the q, k, v and sinks gradients."""
    import torch.distributed as dist

    from ndparallel.distributed.ring import ring_attention
    from ndparallel.distributed.ulysses import local_attention
    from ndparallel.parallel.context_parallel import gather_sequence, shard_sequence

    rank, diffs = dist.get_rank(), {}
    for kernel, rotate, dtype in (("math", "ring", torch.float64), ("cpu_flash", "ring", torch.float32)) + (
        (None, "alltoall", torch.float64),
    ):
        generator = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, SEQ, h, 8, generator=generator, dtype=dtype) for h in (4, 2, 2))
        sinks = torch.randn(4, generator=generator, dtype=dtype)
        weight = torch.randn(2, SEQ, 4, 8, generator=generator, dtype=dtype)
        full = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        ref = local_attention(*(t.transpose(1, 2) for t in full[:3]), True, 0.3, full[3]).transpose(1, 2)
        (ref * weight).sum().backward()
        local = [shard_sequence(t, 1, 2, rank, True).requires_grad_() for t in (q, k, v)]
        mine = sinks.clone().requires_grad_()
        out = ring_attention(*local, None, True, rotate, True, 0.3, kernel, sinks=mine)
        (out * shard_sequence(weight, 1, 2, rank, True)).sum().backward()
        dist.all_reduce(mine.grad)  # each rank's sink gradient covers its own query rows
        got = [gather_sequence(t, 1, None, True) for t in (out.detach(), *(x.grad for x in local))]
        want = [ref.detach(), *(x.grad for x in full[:3])]
        diffs[(str(kernel), rotate)] = max(
            [float((a - b).abs().max()) for a, b in zip(got, want, strict=True)]
            + [float((mine.grad - full[3].grad).abs().max())]
        )
    return diffs


def run_group() -> dict:
    runs = {(m, r): train(m, {**CP2, "cp_rotate_method": r}) for m, r in PARITY}
    return {"runs": runs, "refusals": refusals(), "sink_kernels": sink_kernels()}


@pytest.fixture(scope="module")
def group():
    return run_distributed(run_group, 2, timeout=600)


# ---------------------------------------------------------------------------------------------- tests


# DeepSeek-V3's router weight is an fp32 parameter: its gradient is summed over tokens in fp32, in another
# order under cp (per rank, then FSDP's reduction). Measured 4.7e-9 (about one fp32 ulp of its 0.04 entries).
FP32_PARAM_TOL = 1e-7
# ... so after one AdamW step the router differs by about that much, and step 2's float64 loss and grad norm
# with it: measured 7.0e-9 and 1.1e-9 relative on an AVX-512 Xeon (0 on CI's machine). Step 1 stays at 1e-10.
FP32_ROUTER_TOL = {"loss_tol": 1e-7, "norm_rtol": 1e-8}


def split_fp32_grads(result: dict) -> tuple[dict, dict]:
    """(the run without its fp32 gradients, the fp32 gradients)."""
    fp32 = {name: g for name, g in result["grads"].items() if g.dtype == np.float32}
    rest = {name: g for name, g in result["grads"].items() if name not in fp32}
    return {**result, "grads": rest}, fp32


@pytest.mark.parametrize(("model_type", "rotate"), PARITY)
def test_implemented_features_match_one_process(group, model_type, rotate):
    ref, ref_fp32 = split_fp32_grads(reference(model_type))
    assert bool(ref_fp32) == (model_type == "deepseek_v3"), sorted(ref_fp32)
    for rank, result in enumerate(group):
        label = f"{model_type} {rotate} rank {rank}"
        got, got_fp32 = split_fp32_grads(result["runs"][(model_type, rotate)])
        if ref_fp32:
            assert abs(got["losses"][0] - ref["losses"][0]) <= 1e-10, (label, got["losses"], ref["losses"])
            assert got["grad_norms"][0] == pytest.approx(ref["grad_norms"][0], rel=1e-10), label
        assert_parity(got, ref, **(FP32_ROUTER_TOL if ref_fp32 else {}), label=label)
        assert got_fp32.keys() == ref_fp32.keys(), label
        for name, grad in ref_fp32.items():
            assert np.abs(got_fp32[name] - grad).max() <= FP32_PARAM_TOL, (label, name)


SINK_TOL = {"math": 1e-12, "None": 1e-12, "cpu_flash": 1e-5}  # float64; fp32 round-off (measured 6.6e-7)


def test_sinks_are_exact_on_every_cpu_kernel(group):
    for rank, result in enumerate(group):
        for (kernel, rotate), diff in result["sink_kernels"].items():
            assert diff <= SINK_TOL[kernel], (rank, kernel, rotate, diff)


def test_implemented_features_change_the_output():
    """Scaling and sinks matter here: a seam that ignored them could not pass the parity test above."""
    scaled = one_process_logits("granite")
    assert (scaled - one_process_logits("granite", attention_multiplier=8**-0.5)).abs().max() > 1e-3
    model = build("gpt_oss")
    tokens = make_batches(1, BATCH, SEQ, 64)[0][0]
    with torch.no_grad():
        with_sinks = model(input_ids=tokens).logits
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-torch.inf)  # exp(-inf) = 0: no sink
        without = model(input_ids=tokens).logits
    assert (with_sinks - without).abs().max() > 1e-3
    mla = build("deepseek_v3")
    assert {p.dtype for p in mla.parameters()} == {torch.float64, torch.float32}, "the router must stay fp32"


def test_masks_and_refused_features_change_the_output():
    """Soft-capping, a window shorter than the sequence, dropout and packed position_ids each change the
    one-process output: refusing them is not vacuous, nor is their parity (tests/models/test_hf_masks.py)."""
    assert (one_process_logits("gemma2") - one_process_logits("gemma2", attn_logit_softcapping=None)).abs().max() > 1e-3
    window = one_process_logits("mistral", sliding_window=4) - one_process_logits("mistral")
    assert window.abs().max() > 1e-3
    second = one_process_logits("mistral", position_ids=PACKED)[:, SEQ // 2 :]
    model = build("mistral")
    tokens = make_batches(1, BATCH, SEQ, 64)[0][0]
    with torch.no_grad():
        alone = model(input_ids=tokens[:, SEQ // 2 :]).logits
    assert (second - alone).abs().max() < 1e-12, "transformers masks packed documents apart (without a KV cache)"
    assert (second - one_process_logits("mistral")[:, SEQ // 2 :]).abs().max() > 1e-3  # full causal differs
    model = build("mistral", attention_dropout=0.5).train()
    with torch.no_grad():
        torch.manual_seed(0)
        dropped = model(input_ids=tokens).logits
        assert (dropped - model.eval()(input_ids=tokens).logits).abs().max() > 1e-3


def test_refusals_name_the_feature_and_the_way_out(group):
    for rank, result in enumerate(group):
        errors = result["refusals"]
        assert "model_type='gemma2'" in errors["softcap"] and "attn_logit_softcapping=1.0" in errors["softcap"]
        assert "'alltoall'" in errors["softcap"] and "'ring'" in errors["softcap"], (rank, errors)
        assert errors["softcap_untouched"] == "Parameter", "the refusal must come before the model is sharded"
        assert "attention_dropout=0.1" in errors["dropout"] and "model_type='mistral'" in errors["dropout"]
        assert "block_size=<tensor (2,)>" in errors["unknown_kwarg"], (rank, errors)
        assert "does not know it" in errors["unknown_kwarg"], (rank, errors)
        cu = errors["cu_without_positions"]
        assert "cu_seq_lens_q without position_ids" in cu and "input refused" in cu, (rank, errors)
        assert "sinks" in errors["sinks_tp"] and "tp_size=1" in errors["sinks_tp"], (rank, errors)


def test_fsdp_units_by_dtype_take_whole_modules_or_refuse_by_name():
    from ndparallel.parallel.fully_shard import dtype_units

    mla = build("deepseek_v3")
    assert [u for layer in mla.model.layers for u in dtype_units(layer)] == [mla.model.layers[1].mlp.gate]
    assert dtype_units(mla.model.layers[0]) == [] and dtype_units(mla, list(mla.model.layers)) == []
    mixed = torch.nn.Sequential(torch.nn.Linear(2, 2).double(), torch.nn.Linear(2, 3).double())
    mixed[0].bias.data = mixed[0].bias.data.float()  # an fp32 bias beside its float64 weight
    with pytest.raises(ConfigError, match=r"'0.bias' \(Linear\) is torch.float32 beside torch.float64"):
        dtype_units(mixed)
