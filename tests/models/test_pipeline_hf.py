"""Hugging Face models under pipeline parallelism, built on the meta device, against one plain PyTorch process.

* config only: every stage of every split initialises to what :func:`ndparallel.models.hf.init.seeded_init` gives
  the whole model (HF's rule, RNG seeded per module name), bit for bit (no ranks needed);
* from a checkpoint: ``load_pretrained_pipeline`` reads only the tensors of the rank's stages (counted at
  the safetensors reader) and gives the weights of a full load; pp2 and pp2 x cp2 (ring attention) then
  train like one process on the full model in float64 (the pieces of tests/parallel/pipeline/test_parity.py).
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

pytest.importorskip("transformers")

from ndparallel.config.pipeline import torch_compiles_pipeline_stages, torch_supports_v_schedules  # noqa: E402
from ndparallel.errors import ConfigError  # noqa: E402
from ndparallel.parallel.pipeline.tied import copy_names, one_process_parameters  # noqa: E402
from ndparallel.testing import run_distributed  # noqa: E402
from tests.parallel.pipeline.test_parity import (  # noqa: E402
    MAX_NORM,
    TOL,
    _error,
    _mesh,
    _plain_training,
    _tiny_llama,
    _tiny_llama_config,
    _train_pipeline,
)
from tests.parity import adamw  # noqa: E402

V_OR_LOOPED = "zbv" if torch_supports_v_schedules() else "interleaved_1f1b"


def _meta_llama(dtype: torch.dtype = torch.float64):
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(_tiny_llama_config()).to(dtype)


def _splits(n_blocks: int, n_stages: int):
    """Every way to cut ``n_blocks`` into ``n_stages`` non-empty contiguous ranges."""
    if n_stages == 1:
        yield [range(0, n_blocks)]
        return
    for first in range(1, n_blocks - n_stages + 2):
        for rest in _splits(n_blocks - first, n_stages - 1):
            yield [range(0, first), *(range(r.start + first, r.stop + first) for r in rest)]


def _qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip


def _qwen2_tied_config():
    config = _qwen2_config()
    config.tie_word_embeddings = True
    return config


@pytest.mark.parametrize(
    "make_config", [_tiny_llama_config, _qwen2_config, _qwen2_tied_config], ids=["llama", "qwen2-biases", "qwen2-tied"]
)
def test_config_only_stages_initialise_like_the_whole_model_on_every_split(make_config):
    from transformers import AutoModelForCausalLM

    from ndparallel.models.hf.init import seeded_init
    from ndparallel.parallel.family import family_for

    whole = AutoModelForCausalLM.from_config(make_config()).double()
    seeded_init(whole, seed=7)
    expected = {n: p.detach().clone() for n, p in whole.named_parameters()}
    inv_freq = whole.model.rotary_emb.inv_freq.clone()
    assert not torch.equal(expected["model.layers.0.mlp.up_proj.weight"], expected["model.layers.1.mlp.up_proj.weight"])
    biases = [n for n in expected if n.endswith("bias")]
    assert all(not expected[n].any() for n in biases) and (biases or make_config is _tiny_llama_config)
    for n_stages in (1, 2, 3, 4):
        for ranges in _splits(4, n_stages):
            with torch.device("meta"):
                meta = AutoModelForCausalLM.from_config(make_config()).double()
            family = family_for(meta)
            held = []
            for sid, blocks in enumerate(ranges):
                stage = family.pipeline_stage(meta, blocks, sid == 0, sid == n_stages - 1)
                stage.to_empty(device="cpu")
                stage.init_weights(7)
                for name, param in one_process_parameters(stage):  # a tied copy: the one weight's values
                    assert torch.equal(param, expected[name]), (ranges, name)
                    held.append(name)
                assert torch.equal(stage.model.rotary_emb.inv_freq, inv_freq)
            assert sorted(set(held)) == sorted(expected), ranges
    # the rule is the seed's: another seed, other values; the caller's RNG stream is left where it was
    state = torch.get_rng_state()
    seeded_init(whole, seed=8)
    assert torch.equal(torch.get_rng_state(), state)
    assert not torch.equal(whole.model.embed_tokens.weight, expected["model.embed_tokens.weight"])


class _CountingFile:
    """A ``safe_open`` handle that records which tensors were read and how many bytes came back."""

    def __init__(self, real, log: dict):
        self._real, self._log = real, log

    def __enter__(self):
        self._real.__enter__()
        return self

    def __exit__(self, *exc):
        return self._real.__exit__(*exc)

    def keys(self):
        return self._real.keys()

    def get_slice(self, name: str):
        stored, log = self._real.get_slice(name), self._log

        class _Slice:
            def get_shape(self):
                return stored.get_shape()

            def get_dtype(self):
                return stored.get_dtype()

            def __getitem__(self, region):
                tensor = stored[region]
                log["keys"].append(name)
                log["bytes"] += tensor.numel() * tensor.element_size()
                return tensor

        return _Slice()


@contextlib.contextmanager
def _counting_reads(log: dict):
    """Count what the safetensors reader returns while inside (the loader imports ``safe_open`` per call)."""
    import safetensors

    real = safetensors.safe_open
    safetensors.safe_open = lambda *a, **k: _CountingFile(real(*a, **k), log)
    try:
        yield log
    finally:
        safetensors.safe_open = real


def _param_bytes(params) -> int:
    """Bytes this rank holds of the materialised (not meta) ``params`` (a DTensor: its local shard)."""
    from torch.distributed.tensor import DTensor

    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    return sum(p.numel() * p.element_size() for p in local if not p.is_meta)


def _load_and_train(path: str, parallel: dict, ref: dict, full: dict) -> dict:
    """Load ``path`` as this rank's stages (counting the reads), check the weights, train; what was measured."""
    import torch.distributed as dist

    from ndparallel.config.parallelism import ParallelismConfig
    from ndparallel.hf import load_pretrained_pipeline

    cfg = ParallelismConfig(**parallel)
    mesh = _mesh(cfg)
    with _counting_reads({"keys": [], "bytes": 0}) as log:
        pipe = load_pretrained_pipeline(path, cfg, mesh, microbatches=4, dtype=torch.float64)
    stage_bytes = _param_bytes(p for s in pipe.stages for p in s.parameters())
    names = sorted(n for s in pipe.stages for n, _ in one_process_parameters(s))  # a tied copy reads the weight
    loaded = max(_error(p, full[n]) for s in pipe.stages for n, p in one_process_parameters(s))
    whole = pipe.stages[0]._init_module.__self__  # the (meta) model the stages were cut from
    # only the stages' parameters were materialised (a tied head's copy is the stage's own, outside ``whole``)
    held = _param_bytes(
        {id(p): p for p in [*whole.parameters(), *(p for s in pipe.stages for p in s.parameters())]}.values()
    )
    err = _train_pipeline(pipe, ref, 64)
    dist.barrier()
    shards = mesh.size("dp_shard") * mesh.size("cp") * mesh.size("tp")  # ways the stage is cut (FSDP, TP)
    out = {"err": err, "names": names, "read": log, "stage_bytes": stage_bytes, "loaded": loaded, "held": held}
    return {**out, "shards": shards}


def _full_path_bytes(parallel: dict) -> int:
    """Parameter bytes a rank holds when the HF model is built with its weights before build_pipeline."""
    from ndparallel.config.parallelism import ParallelismConfig
    from ndparallel.parallel.pipeline import build_pipeline

    cfg = ParallelismConfig(**parallel)
    model = _tiny_llama()
    build_pipeline(model, cfg, _mesh(cfg), microbatches=4)
    return _param_bytes(model.parameters())


def _config_only(parallel: dict, expected: dict) -> tuple[list[str], float]:
    """build_pipeline on a meta model from a config: this rank's stages against seeded_init of the whole model."""
    from ndparallel.config.parallelism import ParallelismConfig
    from ndparallel.parallel.pipeline import build_pipeline

    cfg = ParallelismConfig(**parallel)
    pipe = build_pipeline(_meta_llama(), cfg, _mesh(cfg), microbatches=4, seed=7)
    params = [(n, p) for s in pipe.stages for n, p in s.named_parameters()]
    return sorted(n for n, _ in params), max(_error(p, expected[n]) for n, p in params)


def _refusals(path: str, settings: list[dict]) -> list[str]:
    """load_pretrained under pp; load_pretrained_pipeline with each of ``settings`` (untested under pp); a
    load that fails on rank 1 only, with an error that is not a ConfigError (every rank must raise, no hang)."""
    import torch.distributed as dist

    import ndparallel.models.hf.pretrained as pretrained
    from ndparallel.config.parallelism import ParallelismConfig
    from ndparallel.hf import load_pretrained, load_pretrained_pipeline

    base = {"pp_size": 2, "cp_size": dist.get_world_size() // 2}
    cfg = ParallelismConfig(**base)
    errors = []
    try:
        load_pretrained(path, cfg, _mesh(cfg))
    except ConfigError as err:
        errors.append(str(err))
    for setting in settings:
        try:
            cfg = ParallelismConfig(**base, **setting)
            load_pretrained_pipeline(path, cfg, _mesh(cfg), microbatches=4)
        except ConfigError as err:
            errors.append(str(err))
    real = pretrained._fill_from_files

    def fail_on_rank_1(stage, files):
        if dist.get_rank() == 1:
            raise KeyError("a tensor rank 1 could not find")
        real(stage, files)

    pretrained._fill_from_files = fail_on_rank_1
    try:
        cfg = ParallelismConfig(**base)
        load_pretrained_pipeline(path, cfg, _mesh(cfg), microbatches=4)
    except ConfigError as err:
        errors.append(f"{err} | cause: {type(err.__cause__).__name__}")
    finally:
        pretrained._fill_from_files = real
    dist.barrier()
    return errors


def _group(path: str, cases: list[dict], ref: dict, full: dict, tied: tuple | None = None) -> list:
    """Each case, in one spawned group; a case with ``"tied"`` loads and trains the ``tied`` checkpoint."""
    out = []
    for case in cases:
        if case.get("tied"):
            out.append(_load_and_train(tied[0], case["parallel"], tied[1], tied[2]))
        elif "bytes" in case:
            out.append(_full_path_bytes(case["bytes"]))
        elif "config_only" in case:
            out.append(_config_only(case["config_only"], case["expected"]))
        elif "refusals" in case:
            out.append(_refusals(path, case["refusals"]))
        else:
            out.append(_load_and_train(path, case["parallel"], ref, full))
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[str, dict, dict]:
    """A tiny float64 Llama written with transformers' own save_pretrained; the one-process reference on it."""
    path = tmp_path_factory.mktemp("tiny-llama")
    model = _tiny_llama()
    model.save_pretrained(str(path))
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = _plain_training(model, lambda m, x: m(input_ids=x).logits)
    assert min(ref["norms"]) > MAX_NORM  # clipping is active on every step
    return str(path), ref, full


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory) -> tuple[str, dict, dict]:
    """``checkpoint`` with tied word embeddings: transformers stores the weight once, as the embedding."""
    from transformers import LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama-tied")
    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_llama_config(tie_word_embeddings=True)).double()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(str(path))
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert "lm_head.weight" not in full
    ref = _plain_training(model, lambda m, x: m(input_ids=x).logits)
    assert min(ref["norms"]) > MAX_NORM
    return str(path), ref, full


def _check_load(results: list[dict], full: dict) -> None:
    every = {n: p.numel() * p.element_size() for n, p in full.items()}
    for r in results:
        print({k: f"{v:.1e}" for k, v in r["err"].items()}, "read", r["read"]["bytes"], "of", sum(every.values()))
        assert max(r["err"].values()) < TOL, r["err"]
        assert r["loaded"] == 0.0  # the stage's weights are the checkpoint's, exactly
        # the rank read its stages' tensors, only the shard it holds (FSDP over dp_cp under cp, TP), nothing else
        assert sorted(r["read"]["keys"]) == r["names"]
        assert r["read"]["bytes"] == r["stage_bytes"] == r["held"] < sum(every.values())
        whole_stage = sum(every[n] for n in r["names"])  # sharded: less (TP replicates the norms: not 1/shards)
        assert r["stage_bytes"] == whole_stage if r["shards"] == 1 else r["stage_bytes"] < whole_stage
    assert {n for r in results for n in r["names"]} == set(full)


def _check_refusals(per_rank: list[list[str]], untested: list[dict]) -> None:
    """Every rank refused the same things, by name; rank 1's failure reached every rank, as a ConfigError."""
    for errors in per_rank:
        assert len(errors) == 2 + len(untested), errors
        assert "use ndparallel.hf.load_pretrained_pipeline" in errors[0]
        for setting, error in zip(untested, errors[1:-1], strict=True):
            ((field, value),) = setting.items()
            expected = f"{field}={value!r} is untested for pp_size > 1 with a Hugging Face model"
            assert error.startswith(expected) and "or use pp_size=1" in error, error
        assert "load_pretrained_pipeline: rank 1 of" in errors[-1] and "rank 1 could not find" in errors[-1]
    assert per_rank[0][-1].endswith("cause: NoneType") and per_rank[1][-1].endswith("cause: KeyError")


def test_pp2_loads_only_its_stages_and_trains_like_one_process(checkpoint, tied_checkpoint):
    path, ref, full = checkpoint
    from ndparallel.hf import seeded_init

    whole = _tiny_llama()
    seeded_init(whole, seed=7)
    expected = {n: p.detach() for n, p in whole.named_parameters()}
    untested = [{"activation_checkpointing": "full"}]
    if torch_compiles_pipeline_stages():  # torch 2.11 refuses compile under pp before the HF rule, on its version
        untested.append({"compile": "blocks"})
    cases = [{"parallel": {"pp_size": 2}}, {"bytes": {"pp_size": 2}}, {"refusals": untested}]
    cases.append({"config_only": {"pp_size": 2}, "expected": expected})
    # two stages per rank; V placement puts the first and the last stage on rank 0
    cases.append({"parallel": {"pp_size": 2, "pp_schedule": V_OR_LOOPED, "pp_stages_per_rank": 2}})
    # tied word embeddings: the copies on two ranks (loop placement), and on one (V placement: rank 0)
    cases.append({"parallel": {"pp_size": 2}, "tied": True})
    cases.append({"parallel": {"pp_size": 2, "pp_schedule": V_OR_LOOPED, "pp_stages_per_rank": 2}, "tied": True})
    results = run_distributed(_group, 2, path, cases, ref, full, tied_checkpoint, timeout=600)
    _check_load([r[0] for r in results], full)
    _check_load([r[4] for r in results], full)
    _check_load([r[5] for r in results], tied_checkpoint[2])
    _check_load([r[6] for r in results], tied_checkpoint[2])
    full_bytes = results[0][1]
    meta_bytes = [r[0]["held"] for r in results]
    print("parameter bytes per rank: meta path", meta_bytes, "full path", full_bytes)
    assert full_bytes == sum(p.numel() * p.element_size() for p in full.values()) > max(meta_bytes)
    _check_refusals([r[2] for r in results], untested)
    # config only, through build_pipeline: each rank's stage is bit-identical to seeded_init of the whole model
    assert [r[3][1] for r in results] == [0.0, 0.0]
    assert sorted(n for r in results for n in r[3][0]) == sorted(expected)


@pytest.mark.slow  # 4 ranks, pp composed with cp, tp and FSDP; the fast tier keeps pp 2 alone (the test above)
def test_pp2_cp2_ring_attention_and_pp2_tp2_match_one_process(checkpoint, tied_checkpoint):
    path, ref, full = checkpoint
    untested = [{"cp_rotate_method": "alltoall"}, {"cp_rotate_method": "allgather"}]
    cases = [{"parallel": {"pp_size": 2, "cp_size": 2}}, {"parallel": {"pp_size": 2, "tp_size": 2}}]
    tied = [
        {"parallel": {"pp_size": 2, "tp_size": 2}, "tied": True},
        {"parallel": {"pp_size": 2, "dp_shard_size": 2}, "tied": True},
    ]
    every = [*cases, {"refusals": untested}, *tied]
    results = run_distributed(_group, 4, path, every, ref, full, tied_checkpoint, timeout=600)
    for index in range(len(cases)):
        _check_load([r[index] for r in results], full)
    # Ulysses and all-gather cp are untested for HF stages: refused by name (ring is the one proved above)
    _check_refusals([r[2] for r in results], untested)
    # tied word embeddings: the head's copy split on the vocabulary by tp, or by FSDP, like the embedding's
    for index in range(len(cases) + 1, len(every)):
        _check_load([r[index] for r in results], tied_checkpoint[2])


def test_stage_of_a_materialised_model_keeps_only_its_own_blocks():
    """A stage built from a model with its weights must not keep the model (and so the other stages' weights)
    alive: once the model is dropped, the blocks outside the stage are freed."""
    import gc
    import weakref

    from ndparallel.parallel.family import family_for

    model = _tiny_llama()
    stage = family_for(model).pipeline_stage(model, [0], True, False)
    outside = [weakref.ref(m) for m in (model, model.model.layers[1], model.lm_head)]
    inside = weakref.ref(model.model.layers[0])
    del model
    gc.collect()
    assert [ref() for ref in outside] == [None, None, None]
    assert inside() is stage.model.layers["0"]
    with pytest.raises(ConfigError, match="init_weights needs the model built on the meta device"):
        stage.init_weights(7)


def _meta_tiny(model_type: str, **overrides):
    from transformers import AutoModelForCausalLM

    from ndparallel.hf import tiny_config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))


def test_gemma_embed_scale_is_recomputed_on_both_stage_init_paths():
    """Gemma's sqrt(hidden_size) embedding scale is a non-persistent buffer beside the embedding weight: the
    checkpoint path (rotary tables only before) must recompute it too, or the first stage scales by garbage."""
    from ndparallel.models.hf.stage import LOAD_MARKER
    from ndparallel.parallel.family import family_for

    for from_checkpoint in (False, True):
        model = _meta_tiny("gemma3_text", tie_word_embeddings=False)
        if from_checkpoint:
            setattr(model, LOAD_MARKER, True)
        stage = family_for(model).pipeline_stage(model, [0], True, False)
        stage.to_empty(device="cpu")
        stage.model.embed_tokens.embed_scale.fill_(float("nan"))
        stage.init_weights(7)
        assert stage.model.embed_tokens.embed_scale.item() == torch.tensor(model.config.hidden_size**0.5).item(), (
            from_checkpoint
        )


def test_what_a_stage_does_not_reproduce_is_refused_by_name():
    """Outside PIPELINE_MODEL_TYPES, bidirectional masks and unknown layer types: one-line ConfigErrors."""
    from ndparallel.parallel.family import family_for

    cases = [
        (_meta_tiny("nanochat"), "pp_size > 1 is not supported for model_type='nanochat'"),
        (_meta_tiny("gemma3_text", tie_word_embeddings=False, use_bidirectional_attention=True), "bidirectional"),
    ]
    odd = _meta_tiny("qwen3")
    odd.config.layer_types = ["full_attention", "chunked_attention"]
    cases.append((odd, "cannot build the 'chunked_attention' mask of layer 1"))
    for model, words in cases:
        with pytest.raises(ConfigError, match=re.escape(words)):
            family_for(model).pipeline_stage(model, [1], False, True)


def _load_head_stored_twice(stale: str, equal: str) -> list[str]:
    """load_pretrained (pp 1) and load_pretrained_pipeline (pp 2) of a tied checkpoint whose stored head
    differs (refused), then the pipeline of one whose stored head equals the embedding (loads, still tied)."""
    from ndparallel.config.parallelism import ParallelismConfig
    from ndparallel.hf import load_pretrained, load_pretrained_pipeline

    errors = []
    for parallel, load in (({"dp_shard_size": 2}, load_pretrained), ({"pp_size": 2}, load_pretrained_pipeline)):
        cfg = ParallelismConfig(**parallel)
        with pytest.raises(ConfigError, match="transformers would untie them on load") as refused:
            load(path=stale, cfg=cfg, mesh=_mesh(cfg))
        errors.append(str(refused.value))
    cfg = ParallelismConfig(pp_size=2)
    pipe = load_pretrained_pipeline(equal, cfg, _mesh(cfg))
    assert pipe.tied.names == ["model.embed_tokens.weight"]
    return errors


def test_a_tied_weight_stored_twice_loads_only_if_both_are_equal(tied_checkpoint, tmp_path):
    """transformers unties a tied weight stored twice with other values (one process then trains two
    tensors): both loaders refuse that on every rank; stored twice with one value, it loads tied."""
    import shutil

    from safetensors.torch import load_file, save_file

    folders = {}
    for kind in ("stale", "equal"):
        folders[kind] = tmp_path / kind
        shutil.copytree(tied_checkpoint[0], folders[kind])
        stored = load_file(f"{folders[kind]}/model.safetensors")
        embedding = stored["model.embed_tokens.weight"]
        stored["lm_head.weight"] = torch.zeros_like(embedding) if kind == "stale" else embedding.clone()
        save_file(stored, f"{folders[kind]}/model.safetensors", metadata={"format": "pt"})
    for errors in run_distributed(_load_head_stored_twice, 2, str(folders["stale"]), str(folders["equal"])):
        assert all("'model.embed_tokens.weight' also as ['lm_head.weight']" in e for e in errors), errors


# ------------------------------------------------------- tied word embeddings: checkpoints across pp sizes


def _tied_llama(seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(_tiny_llama_config(tie_word_embeddings=True)).double()


def _tied_reference() -> list[dict]:
    """One process: the tied Llama's parameters after each of the ``STEPS`` steps (AdamW, clipping)."""
    from tests.parallel.pipeline.test_parity import OPTIM, _batches

    model = _tied_llama(0)
    optimizer = adamw(model.parameters(), foreach=False, **OPTIM)
    after = []
    for x, y in _batches(model.config.vocab_size):
        torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return after


class _TiedRun:
    """The tied Llama from ``seed`` on one layout: a pipeline (``pp_size > 1``) or parallelize; ``train(steps)``
    runs the reference recipe on this rank's share; ``error(expected)`` is the worst parameter difference."""

    def __init__(self, parallel: dict, seed: int, lr: float = 0.5):
        import ndparallel as ndp
        from ndparallel.config.parallelism import ParallelismConfig
        from ndparallel.parallel.pipeline import build_pipeline
        from tests.parallel.pipeline.test_parity import OPTIM

        cfg = ParallelismConfig(**parallel)
        self.mesh = _mesh(cfg)
        model = _tied_llama(seed)
        if cfg.pp_size > 1:
            self.pipe = build_pipeline(model, cfg, self.mesh, microbatches=4)
            self.modules = self.pipe.stages
        else:
            self.pipe, self.modules = None, [ndp.parallelize(model, cfg, self.mesh)]
        self.optimizers = [
            torch.optim.AdamW(m.parameters(), foreach=False, **{**OPTIM, "lr": lr}) for m in self.modules
        ]

    def train(self, steps: range) -> None:
        from ndparallel.parallel.clip import clip_grad_norm_
        from tests.parallel.pipeline.test_parity import BATCH, _batches

        dp, rank = self.mesh.size("dp"), self.mesh.local_rank("dp")
        per = BATCH // dp
        batches = _batches(64)
        for step in steps:
            x, y = (t[rank * per : (rank + 1) * per] for t in batches[step])
            if self.pipe is not None:
                self.pipe.step(x, y)
                self.pipe.clip_grad_norm_(MAX_NORM)
            else:
                logits = self.modules[0](input_ids=x).logits
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
                clip_grad_norm_(self.modules[0].parameters(), MAX_NORM)
            for optimizer in self.optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

    def error(self, expected: dict) -> float:
        return max(_error(p, expected[n]) for m in self.modules for n, p in one_process_parameters(m))


def _tied_checkpoints(root: str, after: list[dict]) -> dict:
    """Save the tied Llama after 2 steps on pp 2 and on pp 1 x dp_shard 2; load each on the other layouts
    (pp 2, V placement with both copies on rank 0, pp 1), train steps 3-5: worst difference from one process."""
    from ndparallel import checkpoint as ckpt
    from tests.parallel.pipeline.test_parity import OPTIM

    layouts = {
        "pp2": {"pp_size": 2},
        "pp2_v": {"pp_size": 2, "pp_schedule": V_OR_LOOPED, "pp_stages_per_rank": 2},
        "dp2": {"dp_shard_size": 2},
    }
    out = {}
    for saved in ("pp2", "dp2"):
        run = _TiedRun(layouts[saved], seed=0, lr=OPTIM["lr"])
        run.train(range(0, 2))
        ckpt.save(f"{root}/{saved}", run.modules, run.optimizers, step=2)
    for saved in ("pp2", "dp2"):
        for name, parallel in layouts.items():
            run = _TiedRun(parallel, seed=7)  # other weights, lr 0.5: the checkpoint's must come back
            ckpt.load(f"{root}/{saved}", run.modules, run.optimizers)
            assert all(g["lr"] == OPTIM["lr"] for o in run.optimizers for g in o.param_groups)
            run.train(range(2, 5))
            out[f"{saved}>{name}"] = run.error(after[-1])
    # the head's copy frozen by its own name only: one process has one flag, so every pp rank refuses the step
    frozen = []
    for name in ("pp2", "pp2_v"):
        run = _TiedRun(layouts[name], seed=0)
        for module in run.modules:
            for local in copy_names(module):
                module.get_parameter(local).requires_grad_(False)
        with pytest.raises(ConfigError, match=r"frozen on one copy only") as refused:
            run.train(range(0, 1))
        frozen.append(str(refused.value))
    return {"errors": out, "frozen": frozen}


def test_tied_embeddings_checkpoint_across_pp_sizes_and_resume_exactly(tmp_path):
    """A weight tied across stages is saved as one process saves it (its optimizer state once, under the
    embedding's name): a pp 2 checkpoint resumes on pp 1 and on V placement, a pp 1 one on pp 2."""
    after = _tied_reference()
    results = run_distributed(_tied_checkpoints, 2, str(tmp_path), after, timeout=600)
    for rank, result in enumerate(results):
        errors = result["errors"]
        print(rank, {k: f"{v:.1e}" for k, v in errors.items()})
        assert len(errors) == 6 and max(errors.values()) < TOL, errors
        assert len(result["frozen"]) == 2 and all("model.embed_tokens.weight" in m for m in result["frozen"])
