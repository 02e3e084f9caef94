"""Hugging Face decoders (Llama, Qwen2 with tied embeddings, Mistral) under ndparallel vs the plain HF model.

Spawned groups of 4 gloo ranks train every family on dp_shard 2 x tp 2, dp_shard 2 x cp 2 and tp 2 x cp 2
with activation checkpointing (3 AdamW steps in float64: losses, grad norms and step-1 gradients within 1e-10),
and a Qwen3 (per-head q_norm/k_norm) with the plan translated from its base_model_tp_plan; the fast tier's group
runs every mesh on Llama and one on each other family. That group also loads a save_pretrained folder straight
into a sharded model (fp32 and bf16) and writes it back, and checks the ConfigErrors that need a mesh, including
refusals that must be raised on every rank alike and a wrapped lm_head.
fp32 smoke runs live in tests/parallel/test_fp32_smoke.py.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="Hugging Face tests need the hf extra: pip install 'ndparallel[hf]' (make test does)"
)
pytest.importorskip("safetensors", reason="Hugging Face tests need safetensors: pip install 'ndparallel[hf]'")

from ndparallel.errors import ConfigError  # noqa: E402
from ndparallel.testing import run_distributed  # noqa: E402
from tests.parity import NO_CLIP, adamw, assert_parity, full_grads, make_batches  # noqa: E402

FAMILIES = ("llama", "qwen2", "mistral")
STEPS, GLOBAL_BATCH, SEQ, LR = 3, 4, 16, 1e-2
TORCH_DTYPES = {"float64": torch.float64, "float32": torch.float32}
MESHES = {
    "dp2_tp2": {"dp_shard_size": 2, "tp_size": 2},
    "dp2_cp2": {"dp_shard_size": 2, "cp_size": 2},
    "tp2_cp2_ac": {"tp_size": 2, "cp_size": 2, "activation_checkpointing": "full"},  # FSDP over cp, TP, ring, AC
}


def tiny_config(family: str, **overrides):
    """A tiny random config per family: GQA (8 heads, 4 kv heads); Qwen2 ties its word embeddings."""
    common = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=128,
        initializer_range=0.1,
    )
    common.update(overrides)
    if family == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=False)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=64, tie_word_embeddings=False)
    if family == "qwen3":  # per-head q_norm / k_norm: replicated_with_grad_allreduce
        return transformers.Qwen3Config(**common, head_dim=8, tie_word_embeddings=False)
    raise ValueError(family)


def build(family: str, seed: int = 0, dtype: str = "float32", **overrides):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation="sdpa")
    return model.to(TORCH_DTYPES[dtype])


def hf_loss(model, tokens, labels, mesh, explicit_positions: bool = False) -> torch.Tensor:
    """Forward + ndparallel's loss; under cp the tokens/labels (and positions, if given) are sequence-sharded."""
    from ndparallel.parallel.context_parallel import context_parallel
    from ndparallel.parallel.loss import cross_entropy_loss

    if mesh is None or mesh.size("cp") == 1:
        return cross_entropy_loss(model(input_ids=tokens).logits, labels)
    buffers = [tokens.clone(), labels.clone()]
    if explicit_positions:
        buffers.append(torch.arange(tokens.shape[1])[None])
    with context_parallel(mesh, buffers, seq_dims=[1] * len(buffers), no_restore=buffers):
        positions = buffers[2] if explicit_positions else None
        return cross_entropy_loss(model(input_ids=buffers[0], position_ids=positions).logits, buffers[1])


def train(family: str, parallel: dict | None, steps: int = STEPS, dtype: str = "float64") -> dict:
    """``steps`` AdamW steps on the family's tiny model; ``parallel=None``: one process, plain HF model."""
    import ndparallel as ndp
    from ndparallel.distributed.reduce import average_over
    from ndparallel.parallel.clip import clip_grad_norm_

    model, mesh, dp, dp_rank = build(family, dtype=dtype), None, 1, 0
    if parallel is not None:
        mesh = ndp.init_distributed(ndp.ParallelismConfig.from_dict(parallel))
        model = ndp.parallelize(model, mesh.config, mesh)
        dp, dp_rank = mesh.size("dp"), mesh.local_rank("dp")
    optimizer = adamw(model.parameters(), lr=LR, weight_decay=0.1)
    per_rank = GLOBAL_BATCH // dp
    result = {"losses": [], "grad_norms": [], "dtype": dtype}
    for step, (tokens, labels) in enumerate(make_batches(steps, GLOBAL_BATCH, SEQ, model.config.vocab_size)):
        rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        loss = hf_loss(model, tokens[rows], labels[rows], mesh, explicit_positions=family == "mistral")
        loss.backward()
        result["losses"].append(average_over(mesh["dp_cp"] if mesh else None, loss))
        if step == 0:
            result["grads"] = full_grads(model)
        result["grad_norms"].append(clip_grad_norm_(model.parameters(), NO_CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
    return result


@functools.cache
def reference(family: str, dtype: str = "float64") -> dict:
    return train(family, None, dtype=dtype)


# -------------------------------------------------------------------------------- load / save


def write_checkpoints(root: Path) -> dict[str, str]:
    """``save_pretrained`` folders of tiny random models (the sources that ranks load)."""
    paths = {}
    for family in ("llama", "qwen2"):
        paths[family] = str(root / family)
        build(family, seed=3).save_pretrained(paths[family])
    return paths


def source_tensors(path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(Path(path) / "model.safetensors"))


def load_and_save(paths: dict[str, str], out_root: str) -> dict:
    """On every rank: load each folder into dp_shard 2 x tp 2, compare every full parameter with the file,
    take one forward loss, check the rank's shards are smaller than the tensors, and save back."""
    import ndparallel as ndp
    from ndparallel.hf import load_pretrained, save_pretrained

    mesh = ndp.init_distributed(ndp.ParallelismConfig(dp_shard_size=2, tp_size=2))
    report = {}
    for family, path in paths.items():
        model = load_pretrained(path, mesh.config, mesh)
        stored = source_tensors(path)
        diffs, sharded = {}, 0
        for name, param in model.named_parameters():
            full = param.full_tensor().detach().numpy()
            diffs[name] = float(np.abs(full - stored[name]).max())
            sharded += param.to_local().numel() < param.numel()
        tokens, labels = make_batches(1, GLOBAL_BATCH, SEQ, model.config.vocab_size)[0]
        rows = slice(mesh.local_rank("dp") * 2, mesh.local_rank("dp") * 2 + 2)
        with torch.no_grad():
            loss = hf_loss(model, tokens[rows], labels[rows], mesh)
        report[family] = {
            "diffs": diffs,
            "sharded": sharded,
            "n_params": len(diffs),
            "loss": ndp.average_over(mesh["dp_cp"], loss),
            "saved": save_pretrained(model, f"{out_root}/{family}"),
        }
    report["unwritable"] = raised(lambda: save_pretrained(model, f"{out_root}/llama/config.json/sub"))
    fsdp = ndp.init_distributed(ndp.ParallelismConfig(dp_shard_size=4))  # no TP: HF's own bf16 arithmetic
    bf16 = load_pretrained(paths["llama"], fsdp.config, fsdp, dtype=torch.bfloat16)
    with torch.no_grad():
        logits = bf16(input_ids=BF16_TOKENS).logits
    report["bf16"] = {
        "param_dtypes": sorted({str(p.dtype) for p in bf16.parameters()}),
        "inv_freq": bf16.model.rotary_emb.inv_freq.clone(),
        "logits": logits.float(),
    }
    return report


BF16_TOKENS = torch.arange(SEQ)[None] * 7 % 256


def raised(call) -> str:
    """The ConfigError message of ``call()``, or "no error"."""
    try:
        call()
    except ConfigError as err:
        return str(err)
    return "no error"


def mesh_errors(path: str) -> dict[str, str]:
    """ConfigErrors raised by a parallelised HF model's forward (tp 2 x cp 2)."""
    import ndparallel as ndp

    mesh = ndp.init_distributed(ndp.ParallelismConfig(tp_size=2, cp_size=2))
    model = ndp.parallelize(build("llama"), mesh.config, mesh)
    tokens = torch.randint(0, 256, (1, 8))
    errors = {}
    calls = {
        "arbitrary": lambda: model(input_ids=tokens, attention_mask=torch.ones(1, 1, 8, 8)),  # a 4-D mask
        "use_cache": lambda: model(input_ids=tokens, use_cache=True),
        "embeds": lambda: model(inputs_embeds=torch.zeros(1, 8, 64)),
        "labels": lambda: model(input_ids=tokens, labels=tokens[:, :3]),  # neither this rank's shard nor whole
    }
    for key, call in calls.items():
        try:
            call()
            errors[key] = "no error"
        except ConfigError as err:
            errors[key] = str(err)
    from ndparallel.hf import load_pretrained

    try:
        load_pretrained(path, ndp.ParallelismConfig(dp_replicate_size=2, tp_size=2))
        errors["replicate"] = "no error"
    except ConfigError as err:
        errors["replicate"] = str(err)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64))
    try:
        ndp.parallelize(gpt2, mesh.config, mesh)
        errors["gpt2"] = "no error"
    except ConfigError as err:
        errors["gpt2"] = str(err)
    errors["gpt2_untouched"] = str(type(gpt2.lm_head.weight).__name__)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)  # ends at 7 of the row's 16 tokens (8 per cp rank)
    positions = torch.arange(8)[None]
    errors["cu_seq_lens"] = raised(lambda: model(input_ids=tokens, position_ids=positions, cu_seq_lens_q=cu))
    errors["odd_seq"] = raised(lambda: model(input_ids=tokens[:, :5]))  # 5 tokens per cp rank, tp=2
    errors["positions"] = raised(lambda: model(input_ids=tokens, position_ids=torch.arange(16)[None]))
    for rope in ({"rope_type": "dynamic", "factor": 2.0}, LONGROPE):
        scaled = build("llama", rope_scaling=rope)
        errors[rope["rope_type"]] = raised(lambda m=scaled: ndp.parallelize(m, mesh.config, mesh))
    return errors


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [4.0] * 4, "factor": 8.0}


def dp_errors() -> dict[str, str]:
    """dp_shard 2 x tp 2: data-dependent refusals seen by one dp rank only must raise on every rank."""
    import ndparallel as ndp

    mesh = ndp.init_distributed(ndp.ParallelismConfig(dp_shard_size=2, tp_size=2))
    model = ndp.parallelize(build("llama"), mesh.config, mesh)
    tokens, mask = torch.randint(0, 256, (1, 16)), torch.ones(1, 16, dtype=torch.long)
    if mesh.local_rank("dp") == 1:
        mask[0, -2:] = 2  # document ids in the mask, on this dp rank's rows only
    errors = {"mask_one_rank": raised(lambda: model(input_ids=tokens, attention_mask=mask))}
    errors["odd_seq"] = raised(lambda: model(input_ids=tokens[:, :15]))
    with torch.no_grad():
        errors["after"] = raised(lambda: model(input_ids=tokens))  # still usable after the refusals
    return errors


class LmHeadWrapper(torch.nn.Module):
    """A module holding the output Linear (as accelerate's fsdp2_tp_preparation test wraps lm_head)."""

    def __init__(self, lm_head: torch.nn.Linear):
        super().__init__()
        self.lm_head = lm_head

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)


def wrapped_llama():
    model = build("llama", dtype="float64")
    model.lm_head = LmHeadWrapper(model.lm_head)
    return model


def wrapped_plan(model) -> dict:
    """docs/huggingface.md's way out for a wrapped lm_head: shard the Linear inside it instead."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    from ndparallel.hf import hf_tp_plan

    head = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    return hf_tp_plan(model, overrides={"lm_head": None, "lm_head.lm_head": head})


def wrapped_lm_head() -> dict:
    """tp 2 x cp 2: the built-in plan refuses a wrapped lm_head by name, before touching the model; the
    documented plan then gives the one-process loss (float64)."""
    import ndparallel as ndp

    mesh = ndp.init_distributed(ndp.ParallelismConfig(tp_size=2, cp_size=2))
    model = wrapped_llama()
    out = {"error": raised(lambda: ndp.parallelize(model, mesh.config, mesh))}
    out["untouched"] = type(model.lm_head.lm_head.weight).__name__
    ndp.parallelize(model, mesh.config, mesh, tp_plan=wrapped_plan(model))
    tokens, labels = make_batches(1, GLOBAL_BATCH, SEQ, model.config.vocab_size)[0]
    with torch.no_grad():
        out["loss"] = ndp.average_over(mesh["dp_cp"], hf_loss(model, tokens, labels, mesh))
    return out


QWEN3_MESH = "tp2_cp2_ac"  # TP (the per-head norms), CP, FSDP over cp and activation checkpointing at once
PARITY_RUNS = [(f, m) for f in FAMILIES for m in sorted(MESHES)] + [("qwen3", QWEN3_MESH)]
# The fast tier's runs: every mesh on Llama, and each other family where its feature meets a dimension (Qwen2's
# tied embeddings under tp, Mistral's explicit positions under cp, Qwen3's per-head norms); the rest are `slow`,
# in a group of their own.
FAST_RUNS = {("llama", m) for m in MESHES} | {("qwen2", "dp2_tp2"), ("mistral", "dp2_cp2"), ("qwen3", QWEN3_MESH)}


def train_runs(runs: list[tuple[str, str]]) -> dict:
    return {(family, name): train(family, MESHES[name]) for family, name in runs}


def run_group(paths: dict[str, str], out_root: str) -> dict:
    """Everything of the fast tier that needs 4 ranks, in one spawned group."""
    return {
        "runs": train_runs([run for run in PARITY_RUNS if run in FAST_RUNS]),
        "load_save": load_and_save(paths, out_root),
        "errors": mesh_errors(paths["llama"]),
        "dp_errors": dp_errors(),
        "wrapped": wrapped_lm_head(),
    }


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    paths = write_checkpoints(root / "src")
    results = run_distributed(run_group, 4, paths, str(root / "out"), timeout=600)
    return {"paths": paths, "out": root / "out", "ranks": results}


@pytest.fixture(scope="module")
def slow_group():
    """The `slow` parity runs, in a 4-rank group of their own."""
    runs = run_distributed(train_runs, 4, [run for run in PARITY_RUNS if run not in FAST_RUNS], timeout=600)
    return {"ranks": [{"runs": per_rank} for per_rank in runs]}


@pytest.mark.parametrize(
    ("family", "mesh_name"),
    [run if run in FAST_RUNS else pytest.param(*run, marks=pytest.mark.slow) for run in PARITY_RUNS],
)
def test_parity_with_unparallelised_model(request, family, mesh_name):
    ref = reference(family)
    assert max(ref["losses"]) - min(ref["losses"]) > 1e-3, "the reference does not train: the test could not fail"
    group = request.getfixturevalue("group" if (family, mesh_name) in FAST_RUNS else "slow_group")
    for rank, result in enumerate(group["ranks"]):
        got = result["runs"][(family, mesh_name)]
        assert got["dtype"] == ref["dtype"] == "float64"
        assert_parity(got, ref, label=f"{family} {mesh_name} rank {rank}")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_load_pretrained_reads_shards_and_save_round_trips(group, family):
    path = group["paths"][family]
    original = transformers.AutoModelForCausalLM.from_pretrained(path).float()
    tokens, labels = make_batches(1, GLOBAL_BATCH, SEQ, original.config.vocab_size)[0]
    with torch.no_grad():
        ref_loss = torch.nn.functional.cross_entropy(original(input_ids=tokens).logits.flatten(0, 1), labels.flatten())
    for rank, result in enumerate(group["ranks"]):
        report = result["load_save"][family]
        assert max(report["diffs"].values()) == 0.0, f"rank {rank}: loaded weights differ: {report['diffs']}"
        assert report["sharded"] == report["n_params"], f"rank {rank}: some parameter is held whole on a rank"
        assert abs(report["loss"] - ref_loss.item()) <= 1e-5, f"rank {rank}: {report['loss']} vs {ref_loss.item()}"
        assert (report["saved"] is not None) == (rank == 0)
    saved = transformers.AutoModelForCausalLM.from_pretrained(group["out"] / family).float()
    assert saved.config.tie_word_embeddings == original.config.tie_word_embeddings
    assert "ndparallel" not in (group["out"] / family / "config.json").read_text()  # no attention override saved
    original_state, saved_state = original.state_dict(), saved.state_dict()
    assert original_state.keys() == saved_state.keys()
    for name, tensor in original_state.items():
        assert torch.equal(tensor, saved_state[name]), f"{name} changed in the save round trip"


def test_load_pretrained_bf16_keeps_fp32_rotary_table(group):
    hf = transformers.AutoModelForCausalLM.from_pretrained(group["paths"]["llama"], dtype=torch.bfloat16)
    with torch.no_grad():
        ref_logits = hf(input_ids=BF16_TOKENS).logits.float()
    ref_inv_freq = hf.model.rotary_emb.inv_freq
    for rank, result in enumerate(group["ranks"]):
        report = result["load_save"]["bf16"]
        assert report["param_dtypes"] == ["torch.bfloat16"], f"rank {rank}: {report['param_dtypes']}"
        assert report["inv_freq"].dtype == ref_inv_freq.dtype == torch.float32, f"rank {rank}"
        assert torch.equal(report["inv_freq"], ref_inv_freq), f"rank {rank}: inv_freq differs from from_pretrained"
        # FSDP alone runs HF's own bf16 arithmetic; a bf16 rotary table moved such logits by ~4e-2
        diff = (report["logits"] - ref_logits).abs().max().item()
        assert diff <= BF16_LOGITS_TOL, f"rank {rank}: bf16 logits differ from from_pretrained by {diff}"


BF16_LOGITS_TOL = 4e-3  # measured: 0.0 (FSDP on gloo); a bf16 inv_freq gave 3.9e-2


def test_save_pretrained_failure_raises_on_every_rank(group):
    for rank, result in enumerate(group["ranks"]):
        message = result["load_save"]["unwritable"]
        assert "could not write" in message and "config.json/sub" in message, f"rank {rank}: {message}"


def test_refusals_are_collective_and_name_the_fix(group):
    for rank, result in enumerate(group["ranks"]):
        errors, dp = result["errors"], result["dp_errors"]
        mask = dp["mask_one_rank"]
        assert "values other than 0 and 1" in mask and "input refused: rank 2 of 4" in mask, (rank, dp)
        assert "tp_size=2" in dp["odd_seq"] and "sequence length 15" in dp["odd_seq"], (rank, dp)
        assert dp["after"] == "no error", (rank, dp)
        assert "sequence length 10" in errors["odd_seq"] and "cp_size=2" in errors["odd_seq"], (rank, errors)
        assert "2 x cp_size = 4" in errors["odd_seq"], (rank, errors)
        assert "position_ids" in errors["positions"] and "context_parallel" in errors["positions"], (rank, errors)
        for kind in ("dynamic", "longrope"):
            assert f"rope_type={kind!r}" in errors[kind] and "cp_size=1" in errors[kind], (rank, errors)


def test_wrapped_lm_head_is_refused_by_name_and_the_documented_plan_is_exact(group):
    model = wrapped_llama()
    tokens, labels = make_batches(1, GLOBAL_BATCH, SEQ, model.config.vocab_size)[0]
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(model(input_ids=tokens).logits.flatten(0, 1), labels.flatten())
    for rank, result in enumerate(group["ranks"]):
        out = result["wrapped"]
        message = out["error"]
        for part in (
            "'lm_head' (LmHeadWrapper)",
            "not an nn.Linear",
            "'lm_head.lm_head'",
            "tp_plan=",
            "blocks=",
            "fsdp_groups=",
        ):
            assert part in message, (rank, part, message)
        assert out["untouched"] == "Parameter", "the refusal must come before the model is sharded"
        assert abs(out["loss"] - ref.item()) <= 1e-12, (rank, out["loss"], ref.item())


def test_forward_errors_under_tp_and_cp(group):
    errors = group["ranks"][0]["errors"]
    assert "attention_mask of shape [1, 1, 8, 8]" in errors["arbitrary"], errors
    assert "arbitrary attention mask" in errors["arbitrary"], errors
    assert "use_cache" in errors["use_cache"], errors
    assert "input_ids" in errors["embeds"], errors
    assert "labels has 3 positions" in errors["labels"] and "context_parallel" in errors["labels"], errors
    assert "cu_seq_lens_q ends at 7" in errors["cu_seq_lens"] and "16 tokens" in errors["cu_seq_lens"], errors
    assert "dp_replicate_size=2 without FSDP" in errors["replicate"], errors
    assert "model_type='gpt2'" in errors["gpt2"] and "tp_plan=" in errors["gpt2"], errors
    assert errors["gpt2_untouched"] == "Parameter", "the refusal must come before the model is sharded"


# ------------------------------------------------------------------------------ single process


def test_plan_names_and_fsdp_units():
    from ndparallel.hf import GatherSequence, TiedColwiseParallel, hf_fsdp_groups, hf_tp_plan

    plan = hf_tp_plan(build("llama"))
    assert isinstance(plan["model.layers.*.self_attn"], GatherSequence)
    assert {"model.embed_tokens", "model.norm", "lm_head", "model.layers.*.mlp.down_proj"} <= plan.keys()
    assert "model.layers.*.input_layernorm" in plan and "model.layers.*.post_attention_layernorm" in plan
    assert hf_fsdp_groups(build("llama")) == [["model.embed_tokens"], ["model.norm", "lm_head"]]
    qwen = build("qwen2")
    assert isinstance(hf_tp_plan(qwen)["lm_head"], TiedColwiseParallel)
    assert hf_fsdp_groups(qwen) == []  # tied: embedding, norm and lm_head stay in the root unit


def test_unsupported_architecture_is_a_config_error():
    from ndparallel.hf import hf_tp_plan

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64))
    with pytest.raises(ConfigError, match=r"model_type='gpt2'.*tp_plan=\{fqn_pattern: ParallelStyle\}"):
        hf_tp_plan(gpt2)
    with pytest.raises(ConfigError, match="unsharded"):  # a partial plan of your own must still cover everything
        hf_tp_plan(gpt2, overrides={"transformer.h.*.mlp.c_fc": None})
    with pytest.raises(ConfigError, match="not a Hugging Face"):
        hf_tp_plan(torch.nn.Linear(2, 2))


def test_plans_come_from_base_model_tp_plan_and_refusals_name_the_module():
    from ndparallel.hf import PerShardNorm, hf_fsdp_groups, hf_tp_plan

    plan = hf_tp_plan(build("qwen3"))  # trained on tp 2 x cp 2 in the group above
    assert isinstance(plan["model.layers.*.self_attn.q_norm"], PerShardNorm)
    with pytest.raises(ConfigError, match=r"cannot place 'lm_head' \(LmHeadWrapper\).*'lm_head.lm_head'"):
        hf_tp_plan(wrapped_llama())
    assert "lm_head" not in wrapped_plan(wrapped_llama()) and "lm_head.lm_head" in wrapped_plan(wrapped_llama())
    # FSDP alone needs no placement inside lm_head: the wrapper is one unit with the final norm.
    assert hf_fsdp_groups(wrapped_llama()) == [["model.embed_tokens"], ["model.norm", "lm_head"]]


def test_load_pretrained_needs_a_local_folder(tmp_path):
    from ndparallel.hf import load_pretrained

    with pytest.raises(ConfigError, match="config.json"):
        load_pretrained(tmp_path)


def test_save_pretrained_in_one_process_round_trips(tmp_path):
    from ndparallel.hf import save_pretrained

    model = build("qwen2", seed=5)
    assert save_pretrained(model, tmp_path / "out") == str(tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # still tied
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


# -------------------------------------------------------------------------------- 8 ranks
COMPOSED = {"dp_shard_size": 2, "tp_size": 2, "cp_size": 2}  # FSDP over dp x cp, TP + SP, ring attention at once


def _composed_run() -> dict:
    return train("qwen2", COMPOSED)  # tied embeddings: the vocab-parallel head shares the embedding's shards


@pytest.mark.slow
def test_eight_rank_composed_shape_matches_one_process():
    """The one 8-rank Hugging Face shape: dp_shard 2 x tp 2 x cp 2 of Qwen2, float64, against one process."""
    ref = reference("qwen2")
    for rank, got in enumerate(run_distributed(_composed_run, 8, timeout=600)):
        assert_parity(got, ref, label=f"qwen2 dp2 x tp2 x cp2 rank {rank}")
