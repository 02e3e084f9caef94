"""The generic Hugging Face family on many decoders: TP, FSDP, CP and PP 2 equal one process in float64, or refuse.

Each architecture is built tiny and random by :func:`ndparallel.hf.tiny_config` and trained 3 AdamW steps in
float64 with the plan translated from its own ``base_model_tp_plan``: per-head q/k norms (Qwen3, Gemma 3),
gathered projections with full-width q/k norms (OLMo 2), fused qkv / gate_up projections (Phi-3), embedding
scaling and sandwich norms (Gemma 2/3), final-logit soft-capping (Gemma 2), attention / MLP biases and
LayerNorm with bias (StarCoder 2), parallel residual blocks (Cohere), custom attention scaling (Granite).
Losses, grad norms, step-1 gradients and the parameters after the last step are compared per architecture.
One spawned group of 2 gloo ranks runs every architecture on tp 2 and, 2 steps each, on dp_shard 2, cp 2 (ring)
and pp 2 (untied, sliding windows shorter than the sequence: ``PP_OVERRIDES``): exact, or the one-line
ConfigError ``REFUSED`` pins. That group and FSDP 2 x TP 2 (4 ranks) are marked slow (make test, not
make test-fast); the sweep of the rest of the translated catalogue is marked zoo (make zoo).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="Hugging Face tests need the hf extra: pip install 'ndparallel[hf]' (make test does)"
)

from ndparallel.testing import run_distributed  # noqa: E402
from tests.models.test_hf import hf_loss  # noqa: E402
from tests.parity import (  # noqa: E402
    NO_CLIP,
    adamw,
    assert_parity,
    full_grads,
    full_params,
    make_batches,
    record_and_step,
)

STEPS, BATCH, SEQ, LR = 3, 4, 16, 1e-2
# model_type -> tiny-config overrides (the rest comes from tiny_config)
ARCHS = {
    "llama": {},
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {},  # per-head q_norm / k_norm: replicated_with_grad_allreduce
    "gemma3_text": {"query_pre_attn_scalar": 16},  # per-head norms, scaled embedding, sandwich norms
    "gemma2": {"final_logit_softcapping": 3.0, "attn_logit_softcapping": 1.0, "query_pre_attn_scalar": 16},
    "phi3": {},  # fused qkv_proj / gate_up_proj: colwise_gather_output + rowwise_split_input
    "olmo2": {},  # full-width q_norm / k_norm after gathered q/k/v projections
    "smollm3": {},
    "granite": {"attention_multiplier": 0.5, "embedding_multiplier": 2.0, "logits_scaling": 2.0},
    "starcoder2": {},  # biases, LayerNorm with bias
    "cohere": {},  # parallel residual, LayerNorm
    "mistral": {},
}
# pp2 only, and its reference: sliding windows shorter than SEQ, so each layer's mask kind matters (Gemma 3:
# local and global rope; SmolLM3: a no-rope layer); tied embeddings as each config ties them (the last stage's
# lm_head copy is checked against the one-process weight: _tied_copies_match)
WINDOW = {"sliding_window": 6}
LOCAL_GLOBAL = {**WINDOW, "layer_types": ["sliding_attention", "full_attention"]}
PP_OVERRIDES = {
    "gemma3_text": {**LOCAL_GLOBAL},
    "gemma2": {**WINDOW},
    "smollm3": {"use_sliding_window": True, "no_rope_layers": [1, 0], **LOCAL_GLOBAL},
    "starcoder2": {**WINDOW},
    "cohere": {},
    "mistral": WINDOW,
    "cohere2": {**WINDOW},
    "ernie4_5": {},
    "gemma": {},
    "vaultgemma": {**WINDOW},
}
EAGER = ("gemma2",)  # no SDPA path in transformers (others found by build)
# The rest of the catalogue's translated plans (tests/models/test_hf_catalogue.py), default tiny configs, in
# a slow 2-rank sweep: tp 2, 2 steps, losses, grad norms and step-1 gradients.
SWEEP = (
    "arcee", "cohere2", "cwm", "ernie4_5", "exaone", "exaone4", "gemma", "glm", "glm4", "gpt_neox", "helium",
    "hyperclovax", "internlm3", "iquestcoder", "jais2", "ministral3", "nanochat", "olmo", "olmo3", "phi",
    "seed_oss", "vaultgemma",
)  # fmt: skip
# by world size; the 2-rank group runs every architecture on each (dp2, cp2, pp2: EXTRA_STEPS steps)
LAYOUTS = {
    2: {"tp2": {"tp_size": 2}, "dp2": {"dp_shard_size": 2}, "cp2": {"cp_size": 2}, "pp2": {"pp_size": 2}},
    4: {"dp2_tp2": {"dp_shard_size": 2, "tp_size": 2}},
}
EXTRA_STEPS = 2  # dp2, cp2, pp2: fewer steps keep the group short (tp2 keeps STEPS)
# (model_type, layout) -> (words the one-line ConfigError must contain, why): refused, not exact. A new refusal
# or a raw crash of any other pair fails the test.
REFUSED = {
    # the zoo sweep's, not in PIPELINE_MODEL_TYPES: their parts are not model.embed_tokens / layers / norm (a stage
    # cannot find them), or the stage measured another loss (nanochat: 4.6e-2 off)
    ("nanochat", "pp2"): ("is not supported for model_type='nanochat'", "a stage measured a different loss"),
}
# FSDP 2 x TP 2 of Llama, Qwen2, Mistral and Qwen3 runs in tests/models/test_hf.py; the others here, slow
FSDP_TP = tuple(a for a in ARCHS if a not in ("llama", "qwen2", "mistral", "qwen3"))
# Gemma's and Cohere's norms (and Gemma 2's eager softmax) compute in float32 inside a float64 model: its own
# floor (the same batch as two accumulated halves against one batch, measured by tolerance()) bounds what any
# layout can reach; others are held to 1e-10.
FP32_INSIDE = ("gemma2", "gemma3_text", "cohere", "cohere2", "gemma", "vaultgemma", "helium")


def _config(model_type: str, pp: bool = False):
    from ndparallel.hf import tiny_config

    return tiny_config(model_type, **ARCHS.get(model_type, {}), **(PP_OVERRIDES.get(model_type, {}) if pp else {}))


@functools.cache
def attention_of(model_type: str) -> str:
    """``sdpa``, or ``eager`` for a model with no SDPA path in transformers (Gemma 2 by name, VaultGemma found)."""
    if model_type in EAGER:
        return "eager"
    try:
        with torch.device("meta"):
            transformers.AutoModelForCausalLM.from_config(_config(model_type), attn_implementation="sdpa")
    except ValueError:
        return "eager"
    return "sdpa"


def build(model_type: str, seed: int = 0, pp: bool = False):
    """The tiny model (``pp``: with its ``PP_OVERRIDES``)."""
    config = _config(model_type, pp)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attention_of(model_type), dtype=torch.float64
    )


def _eager_float64_softmax(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **_):
    """transformers' eager attention (Gemma 2's: soft-capping; full causal, as a registered function gets no
    mask) with its softmax in the model's dtype instead of float32: what measures the float32 cast."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * (module.head_dim**-0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    assert attention_mask is None and (_.get("sliding_window") or query.shape[2]) >= query.shape[2], "causal only"
    causal = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool).triu(1)  # a registered name gets no mask
    scores = scores.masked_fill(causal, float("-inf"))
    return torch.matmul(scores.softmax(-1), value).transpose(1, 2).contiguous(), None


def train(
    model_type: str,
    parallel: dict | None,
    halves: bool = False,
    steps: int = STEPS,
    pp: bool = False,
    float64_softmax: bool = False,
) -> dict:
    """``STEPS`` AdamW steps; ``parallel=None``: one process, plain HF model (``halves``: each batch as two
    accumulated halves, the model's own round-off floor; ``pp``: the pp2 configs, ``PP_OVERRIDES``;
    ``float64_softmax``: an eager model's attention softmax in float64, the floor of its float32 cast)."""
    import ndparallel as ndp
    from ndparallel.distributed.reduce import average_over

    if parallel is not None and parallel.get("pp_size", 1) > 1:
        return _train_pipeline(build(model_type, pp=True), parallel, steps)
    model, mesh, dp, dp_rank = build(model_type, pp=pp), None, 1, 0
    if float64_softmax:
        transformers.AttentionInterface.register("zoo_eager_float64_softmax", _eager_float64_softmax)
        model.set_attn_implementation("zoo_eager_float64_softmax")
    if parallel is not None:
        mesh = _mesh(parallel)
        model = ndp.parallelize(model, mesh.config, mesh)
        dp, dp_rank = mesh.size("dp"), mesh.local_rank("dp")
    optimizer = adamw(model.parameters(), lr=LR, weight_decay=0.1)
    per_rank = BATCH // dp
    result = {"losses": [], "grad_norms": [], "dtype": "float64"}
    for step, (tokens, labels) in enumerate(make_batches(steps, BATCH, SEQ, model.config.vocab_size)):
        rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        parts = [slice(0, 2), slice(2, 4)] if halves else [rows]
        loss_sum = 0.0
        for part in parts:
            loss = hf_loss(model, tokens[part], labels[part], mesh) / len(parts)
            loss.backward()
            loss_sum += loss.item() if mesh is None else average_over(mesh["dp_cp"], loss)
        result["losses"].append(loss_sum)
        record_and_step(model, optimizer, result, step)
    result["params"] = full_params(model.named_parameters())
    return result


_MESHES: dict = {}


def _mesh(parallel: dict):
    """One mesh per layout in the spawned group (building one creates process groups: seconds when loaded)."""
    import ndparallel as ndp

    key = tuple(sorted(parallel.items()))
    if key not in _MESHES:
        _MESHES[key] = ndp.init_distributed(ndp.ParallelismConfig(**parallel))
    return _MESHES[key]


def _train_pipeline(model, parallel: dict, steps: int) -> dict:
    """``train`` on this rank's pipeline stages (2 micro-batches): its stages' step-1 gradients and final
    parameters under the unsplit names (``check`` joins the ranks'); loss and norm are global on every rank."""
    from ndparallel.parallel.pipeline import build_pipeline

    mesh = _mesh(parallel)
    pipe = build_pipeline(model, mesh.config, mesh, microbatches=2)
    params = [p for stage in pipe.stages for p in stage.parameters()]
    optimizer = adamw(params, lr=LR, weight_decay=0.1)
    result = {"losses": [], "grad_norms": [], "dtype": "float64", "grads": {}}
    for step, (tokens, labels) in enumerate(make_batches(steps, BATCH, SEQ, model.config.vocab_size)):
        result["losses"].append(pipe.step(tokens, labels).item())
        if step == 0:
            result["grads"] = {n: g for stage in pipe.stages for n, g in full_grads(stage).items()}
        result["grad_norms"].append(pipe.clip_grad_norm_(NO_CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
    result["params"] = full_params((n, p) for stage in pipe.stages for n, p in stage.named_parameters())
    return result


def run_group(layouts: dict, archs: tuple = tuple(ARCHS), steps: int = STEPS) -> dict:
    """Every architecture on every layout of this world size, in one spawned group (``steps`` for tp,
    ``EXTRA_STEPS`` for the others)."""
    out = {}
    for model_type in archs:
        for name, layout in layouts.items():
            n = steps if "tp" in name else EXTRA_STEPS
            try:
                out[(model_type, name)] = train(model_type, layout, steps=n)
            except Exception as err:  # reported per architecture by the test, not a crash of the group
                out[(model_type, name)] = {"error": f"{type(err).__name__}: {err}"}
    return out


@functools.cache
def reference(
    model_type: str, halves: bool = False, steps: int = STEPS, pp: bool = False, float64_softmax: bool = False
) -> dict:
    return train(model_type, None, halves=halves, steps=steps, pp=pp, float64_softmax=float64_softmax)


def _difference(a: dict, b: dict) -> float:
    """The largest difference of two runs: losses, relative grad norms, step-1 gradients, final parameters."""
    worst = max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True))
    worst = max(worst, *(abs(x - y) / y for x, y in zip(a["grad_norms"], b["grad_norms"], strict=True)))
    worst = max(worst, *(float(np.abs(a["grads"][n] - b["grads"][n]).max()) for n in b["grads"]))
    return max(worst, max_param_diff(a, b))


def tolerance(
    model_type: str, steps: int = STEPS, pp: bool = False, layout: str = "", float64_softmax: bool = False
) -> float:
    """1e-10, or for a model computing in fp32 inside 10x its own floor: the largest difference between one
    batch and the same batch as two accumulated halves. Under cp an eager model's floor also holds its
    attention's float32 softmax, which the ring computes in float64: the reference against the same run with
    a float64 softmax (the halves cannot show it: both cast the same rows alike). ``float64_softmax``: the
    floor of that run itself."""
    if model_type not in FP32_INSIDE:
        return 1e-10
    ref = reference(model_type, steps=steps, pp=pp, float64_softmax=float64_softmax)
    floor = _difference(reference(model_type, halves=True, steps=steps, pp=pp, float64_softmax=float64_softmax), ref)
    if layout == "cp2" and attention_of(model_type) == "eager":
        floor = max(floor, _difference(reference(model_type, steps=steps, float64_softmax=True), ref))
    return max(10 * floor, 1e-10)


@pytest.fixture(scope="module")
def group():
    return run_distributed(run_group, 2, LAYOUTS[2], timeout=900)


def max_param_diff(got: dict, ref: dict) -> float:
    return max(float(np.abs(got["params"][n] - ref["params"][n]).max()) for n in ref["params"])


def _embedding(named: dict) -> str:
    """The name of the input embedding's weight (the one-process name of a tied lm_head)."""
    return next(n for n in named if n.endswith(("embed_tokens.weight", "embed_in.weight")))


def _tied_copies_match(joined: dict, ref: dict, label: str, tol: float) -> list[str]:
    """A pipeline's own copy of a tied weight (the last stage's ``lm_head.weight``), taken out of ``joined``:
    its step-1 gradient and final values must be the one-process weight's."""
    failures = []
    for key in ("grads", "params"):
        copy = joined[key].pop("lm_head.weight", None) if "lm_head.weight" not in ref[key] else None
        if copy is None:
            continue
        diff = float(np.abs(copy - ref[key][_embedding(ref[key])]).max())
        if diff > tol:
            failures.append(f"{label}: the last stage's tied lm_head.weight {key} differ by {diff:.3g} (tol {tol:.3g})")
    return failures


def check(model_type: str, results: list, layout: str, steps: int = STEPS) -> list[str]:
    """The failures of one architecture on one layout, every rank (messages naming the architecture): exact,
    or the refusal ``REFUSED`` pins. Pipeline ranks hold different stages: their gradients and parameters
    are joined (every name must be on some rank)."""
    failures, refused = [], REFUSED.get((model_type, layout))
    errors = [(rank, r[(model_type, layout)].get("error")) for rank, r in enumerate(results)]
    if refused is not None:
        for rank, error in errors:
            ok = error and error.startswith("ConfigError: ") and refused[0] in error and "\n" not in error
            if not ok:
                failures.append(
                    f"{model_type} {layout} rank {rank}: expected a ConfigError naming {refused[0]!r}"
                    f" ({refused[1]}), got {error or 'a run'}"
                )
        return failures
    pp = layout == "pp2"
    refs = [(reference(model_type, steps=steps, pp=pp), tolerance(model_type, steps=steps, pp=pp, layout=layout))]
    if layout == "cp2" and attention_of(model_type) == "eager":  # and the ring's arithmetic, to the halves' floor
        refs.append(
            (
                reference(model_type, steps=steps, float64_softmax=True),
                tolerance(model_type, steps, float64_softmax=True),
            )
        )
    joined = {"grads": {}, "params": {}}
    for result in results:
        for key in joined:
            joined[key].update(result[(model_type, layout)].get(key, {}))
    failures += _tied_copies_match(joined, refs[0][0], f"{model_type} {layout}", refs[0][1])
    for rank, result in enumerate(results):
        got, label = result[(model_type, layout)], f"{model_type} {layout} rank {rank}"
        if "error" in got:
            failures.append(f"{label}: {got['error']}")
            continue
        got = {**got, **joined}
        for ref, tol in refs:
            try:
                assert_parity(got, ref, loss_tol=tol, norm_rtol=tol, grad_tol=tol, label=label)
            except AssertionError as err:
                failures.append(str(err))
            diff = max_param_diff(got, ref)
            if diff > tol:
                failures.append(f"{label}: parameters after {steps} steps differ by {diff:.3g} (tol {tol:.3g})")
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(ARCHS))
def test_tp_equals_one_process(group, model_type):
    ref = reference(model_type)
    assert max(ref["losses"]) - min(ref["losses"]) > 1e-3, f"{model_type}: the reference does not train"
    failures = check(model_type, group, "tp2")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(ARCHS))
def test_fsdp_cp_pp_equal_one_process_or_refuse(group, model_type):
    """dp_shard 2, cp 2 (ring attention) and pp 2 (2 micro-batches), EXTRA_STEPS steps, in the same group."""
    failures = [f for layout in ("dp2", "cp2", "pp2") for f in check(model_type, group, layout, EXTRA_STEPS)]
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_fsdp_tp_equals_one_process():
    """FSDP 2 x TP 2 (4 ranks) of the architectures test_hf.py does not run there."""
    results = run_distributed(run_group, 4, LAYOUTS[4], FSDP_TP, timeout=1500)
    failures = [f for model_type in FSDP_TP for f in check(model_type, results, "dp2_tp2")]
    assert not failures, "\n".join(failures)


@pytest.mark.zoo  # breadth, not a new code path: make zoo (docs/models.md has its last result)
def test_sweep_of_the_translated_catalogue():
    """Every other translated plan of the catalogue on tp 2, dp_shard 2, cp 2 and pp 2 (2 steps each): exact, or
    the refusal ``REFUSED`` pins; a failure names the model and the layout."""
    results = run_distributed(run_group, 2, LAYOUTS[2], SWEEP, 2, timeout=1500)
    failures = [f for model_type in SWEEP for layout in LAYOUTS[2] for f in check(model_type, results, layout, 2)]
    assert not failures, "\n".join(failures)


def _print_pp2_table() -> None:
    """``python -m tests.models.test_hf_zoo``: the pp 2 row of docs/models.md, per architecture the worst
    of loss, relative grad norm, step-1 gradient and final-parameter differences against one process (and,
    tied, the last stage's lm_head copy against the one weight)."""
    results = run_distributed(run_group, 2, {"pp2": LAYOUTS[2]["pp2"]}, tuple(ARCHS), timeout=900)
    for model_type in ARCHS:
        got = results[0][(model_type, "pp2")]
        if "error" in got:
            print(f"{model_type:12s} refused: {got['error'][:100]}")
            continue
        ref, tol = reference(model_type, steps=EXTRA_STEPS, pp=True), tolerance(model_type, EXTRA_STEPS, pp=True)
        joined = {"grads": {}, "params": {}}
        for result in results:
            for key in joined:
                joined[key].update(result[(model_type, "pp2")][key])
        diffs = {
            "loss": max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True)),
            "norm": max(abs(a - b) / b for a, b in zip(got["grad_norms"], ref["grad_norms"], strict=True)),
            "grads": max(float(np.abs(joined["grads"][n] - ref["grads"][n]).max()) for n in ref["grads"]),
            "params": max_param_diff(joined, ref),
        }
        if "lm_head.weight" in joined["params"] and "lm_head.weight" not in ref["params"]:  # tied: the copy
            diffs["tied head"] = float(
                np.abs(joined["params"]["lm_head.weight"] - ref["params"][_embedding(ref["params"])]).max()
            )
        print(
            f"{model_type:12s} worst {max(diffs.values()):.1e} (tol {tol:.1e})",
            *(f"{k} {v:.1e}" for k, v in diffs.items()),
        )


if __name__ == "__main__":
    _print_pp2_table()
