"""Every causal-LM architecture of the installed transformers that has a ``base_model_tp_plan``: its plan is
translated, or refused with a ConfigError naming the model type, the module and the way out; never a raw
exception. Tiny configs (:func:`ndparallel.hf.tiny_config`) built on the meta device; no processes.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="Hugging Face tests need the hf extra: pip install 'ndparallel[hf]' (make test does)"
)

from ndparallel.errors import ConfigError  # noqa: E402
from tests.models.test_hf_zoo import ARCHS, SWEEP  # noqa: E402

# model types whose tiny config transformers 5.25 (the Makefile's pin) will not build (its own validators, or
# per-layer configs the generic shrinking does not write): not judged here, and the list must stay exactly this
UNBUILT = {
    "bamba", "cohere_compass_text", "dots1", "dots3_note_text", "gemma3n_text", "gemma4_text",
    "gemma4_unified_text", "granitemoehybrid", "hunyuan_v1_dense", "hunyuan_v1_moe", "lfm2_moe", "ministral",
    "nemotron",
    # NVFP4 rounding of keys and values wants head_dim % 16 == 0; the tiny head_dim is 8
    "kolibri1_1",
    # its default layer_types name indexed_attention layers but its indexer_* sizes default to None: the kept
    # layer of each kind (tiny.py) builds one and the indexer divides None by None
    "qwen4_exp_text",
}  # fmt: skip
# trained on tp 2 against one process in tests/models/test_hf_zoo.py: the translation must accept them
EXACT, SWEPT = set(ARCHS), set(SWEEP)


@functools.cache
def tp_architectures() -> tuple[str, ...]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config = transformers.AutoConfig.for_model(model_type)
        except Exception:  # noqa: BLE001 - a config class that cannot build its own defaults has no plan to judge
            continue
        if getattr(config, "base_model_tp_plan", None):
            names.append(model_type)
    return tuple(names)


@functools.cache
def outcomes() -> dict[str, str]:
    """model_type -> "translated", "unbuilt", or the ConfigError message (a raw exception fails the test)."""
    from ndparallel.hf import hf_tp_plan, tiny_config

    transformers.logging.set_verbosity_error()
    out = {}
    for model_type in tp_architectures():
        try:
            config = tiny_config(model_type)
            with torch.device("meta"):
                model = transformers.AutoModelForCausalLM.from_config(config)
        except Exception:  # noqa: BLE001 - recorded, and compared with UNBUILT below
            out[model_type] = "unbuilt"
            continue
        try:
            hf_tp_plan(model)
            out[model_type] = "translated"
        except ConfigError as err:
            out[model_type] = str(err)
    return out


def test_every_plan_is_translated_or_refused_by_name():
    results = outcomes()
    assert len(results) >= 100, f"only {len(results)} architectures with a base_model_tp_plan found"
    assert {m for m, r in results.items() if r == "unbuilt"} == UNBUILT
    for model_type, result in results.items():
        if result in ("translated", "unbuilt"):
            continue
        assert "\n" not in result, f"{model_type}: the refusal is not one line: {result}"
        assert re.search(r"model_type='[\w]+'", result), f"{model_type}: no model_type in {result}"
        assert re.search(r"cannot place '[\w.*]+'|no base_model_tp_plan", result), f"{model_type}: {result}"
        assert "tp_plan={fqn_pattern: ParallelStyle}" in result and "tp_size=1" in result, (model_type, result)
    translated = {m for m, r in results.items() if r == "translated"}
    assert translated >= EXACT | SWEPT, f"not translated: {sorted((EXACT | SWEPT) - translated)}"


def test_every_style_of_the_catalogue_is_translated_or_refused():
    from ndparallel.hf import REFUSED, STYLES

    used = set()
    for model_type in tp_architectures():
        used |= set(transformers.AutoConfig.for_model(model_type).base_model_tp_plan.values())
    assert not STYLES.keys() & REFUSED.keys()
    unknown = used - STYLES.keys() - REFUSED.keys()
    assert not unknown, f"styles with no entry in STYLES or REFUSED: {sorted(unknown)}"


def test_refusals_name_the_style_and_its_reason():
    results = outcomes()
    mixtral, mla, doge = results["mixtral"], results["minicpm3"], results["doge"]
    # transformers 5.25 plans no experts: the fused 3-D expert weight is named, not the router before it
    assert "'model.layers.0.mlp.experts' (MixtralExperts)" in mixtral and "expert parallel" in mixtral
    assert "kv_a_proj_with_mqa" in mla and "'mla_kv_a_proj'" in mla  # dense MLA (DeepSeek's is MoE first)
    assert "second rowwise projection" in doge and "dt_proj" in doge
    assert "'model.layers.0.mlp.experts' (GptOssExperts)" in results["gpt_oss"]  # before its attention sinks
    assert "'model.layers.*.self_attn.sinks'" in results["granite_swa"] and "bare parameter" in results["granite_swa"]
    assert "(Conv1d)" in results["lfm3"] and "MoE" not in results["lfm3"]  # a 3-D conv weight is no expert


def markdown_table() -> str:
    """The catalogue as docs/models.md prints it: one row per architecture, its TP outcome."""
    from ndparallel.models.hf.stage import PIPELINE_MODEL_TYPES

    rows = ["| model_type | TP plan |", "|---|---|"]
    for model_type, result in outcomes().items():
        if result == "translated":
            cell = "exact: tp 2 and dp 2 x tp 2" if model_type in EXACT else "translated, not trained"
            if model_type in SWEPT:
                cell = "exact: tp 2, dp_shard 2, cp 2" + (
                    ", pp 2 (zoo sweep)" if model_type in PIPELINE_MODEL_TYPES else " (zoo sweep); pp 2 refused by name"
                )
        elif result == "unbuilt":
            cell = "not judged: the generic tiny config does not build"
        else:
            reason = result.split("; pass tp_plan=")[0].replace(f"model_type={model_type!r}: ", "")
            reason = re.sub(r", so parameters \[.*?\]( \.\.\.)? would stay unsharded \(.*?\)", "", reason)
            cell = "refused: " + reason.replace("the Hugging Face plan cannot place ", "").replace("|", "/")
        rows.append(f"| `{model_type}` | {cell} |")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m tests.models.test_hf_catalogue > table (docs/models.md)
    print(markdown_table())


def tiny_llama(plan: dict):
    from ndparallel.hf import tiny_config

    config = tiny_config("llama")
    config.base_model_tp_plan = plan
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def test_unknown_and_misplaced_styles_are_refused_by_name():
    from ndparallel.hf import hf_tp_plan

    base = dict(tiny_llama({}).config.__class__().base_model_tp_plan)
    cases = {
        "colwise_foo": ("model.layers.*.mlp.up_proj", "unknown to ndparallel"),
        "all_reduce": ("model.layers.*.mlp.up_proj", "conflicts with ndparallel's reduce-scatter"),
        "replicated_with_grad_allreduce": ("model.layers.*.self_attn.q_proj", "not a norm"),
        "packed_colwise": ("model.layers.*.mlp.up_proj", "colwise_gather_output translation"),
    }
    for style, (fqn, reason) in cases.items():
        target = fqn.removeprefix("model.")
        with pytest.raises(ConfigError) as err:
            hf_tp_plan(tiny_llama({**base, target: style}))
        message = str(err.value)
        assert f"'{fqn}'" in message and reason in message and "tp_size=1" in message, (style, message)
    with pytest.raises(ConfigError, match=r"'model.layers.\*.mlp.down_proj' \(Linear\): a second rowwise projection"):
        hf_tp_plan(tiny_llama({**base, "layers.*.mlp.gate_proj": "rowwise"}))
    with pytest.raises(ConfigError, match=r"outside a decoder layer's sublayer"):
        hf_tp_plan(tiny_llama({**base, "rotary_emb": "colwise"}))


def test_experts_the_plan_lists_are_refused_with_the_plan_s_style():
    """transformers 5.24 listed every MoE's experts (``moe_tp_experts``); 5.25 mostly does not: either way the
    experts are named first, with the plan's own style when it has one."""
    from ndparallel.hf import hf_tp_plan, tiny_config

    config = tiny_config("mixtral")
    config.base_model_tp_plan = {**config.base_model_tp_plan, "layers.*.mlp.experts": "moe_tp_experts"}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ConfigError) as listed:
        hf_tp_plan(model)
    assert "'model.layers.0.mlp.experts' (MixtralExperts): its base_model_tp_plan style 'moe_tp_experts'" in str(
        listed.value
    )
    assert "expert parallel" in str(listed.value)
