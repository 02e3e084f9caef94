"""``load_pretrained`` of every core zoo architecture equals ``from_pretrained`` of the same folder, in float64.

The loader builds the model on the meta device and ``to_empty``\\ s it: every tensor the checkpoint does not hold
(the non-persistent buffers: rotary ``inv_freq``, Gemma's ``embed_scale``) is uninitialised memory unless it is
recomputed (:func:`ndparallel.models.hf.init.init_buffers`). Each architecture of ``tests/models/test_hf_zoo.py``
is saved tiny and random in float64 (in the parent), then one spawned group of 2 gloo ranks loads every folder on
tp 2 and on dp_shard 2 and runs one forward/backward on a fixed batch: loss, logits and gradients against
``AutoModelForCausalLM.from_pretrained(folder)`` in one process, within 1e-10 (10x the model's own floor for the
models that compute in float32 inside, ``test_hf_zoo.tolerance``).
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

from ndparallel.testing import run_distributed  # noqa: E402
from tests.models.test_hf_zoo import ARCHS, SWEEP, build, tolerance  # noqa: E402
from tests.parity import full_grads, make_batches  # noqa: E402

BATCH, SEQ = 4, 16
LAYOUTS = {"tp2": {"tp_size": 2}, "dp2": {"dp_shard_size": 2}}


def forward_backward(model, mesh=None) -> dict:
    """One forward/backward on the fixed batch (under dp, this rank's rows): loss, logits, full gradients."""
    from ndparallel.distributed.reduce import average_over
    from ndparallel.parallel.loss import cross_entropy_loss

    tokens, labels = make_batches(1, BATCH, SEQ, model.config.vocab_size)[0]
    dp, dp_rank = (1, 0) if mesh is None else (mesh.size("dp"), mesh.local_rank("dp"))
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    logits = model(input_ids=tokens[rows]).logits
    loss = cross_entropy_loss(logits, labels[rows])
    loss.backward()
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return {
        "loss": loss.item() if mesh is None else average_over(mesh["dp_cp"], loss),
        "logits": logits.detach().numpy().copy(),
        "rows": (rows.start, rows.stop),
        "grads": full_grads(model),
    }


def load_group(folders: dict[str, str]) -> dict:
    """On every rank: each folder loaded by ``load_pretrained`` on each layout, one forward/backward."""
    import ndparallel as ndp
    from ndparallel.hf import load_pretrained

    out = {}
    for name, layout in LAYOUTS.items():
        mesh = ndp.init_distributed(ndp.ParallelismConfig(**layout))
        for model_type, folder in folders.items():
            try:
                model = load_pretrained(folder, mesh.config, mesh, dtype=torch.float64)
                out[(model_type, name)] = forward_backward(model, mesh)
            except Exception as err:  # reported per architecture by the test
                out[(model_type, name)] = {"error": f"{type(err).__name__}: {err}"}
    return out


@functools.cache
def reference(folder: str) -> dict:
    return forward_backward(transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64))


def save_tiny(root, model_types) -> dict[str, str]:
    """Each architecture tiny and random in float64, ``save_pretrained`` to ``root/<model_type>``."""
    folders = {}
    for model_type in model_types:
        folders[model_type] = str(root / model_type)
        build(model_type, seed=3).save_pretrained(folders[model_type])
    return folders


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("zoo"), ARCHS)


@pytest.fixture(scope="module")
def group(saved):
    return run_distributed(load_group, 2, saved, timeout=600)


def worst(got: dict, ref: dict) -> dict[str, float]:
    """Loss, logits and gradient differences of one rank's run against the one-process run."""
    rows = slice(*got["rows"])
    if set(ref["grads"]) - set(got["grads"]):
        return {"missing grads": float(len(set(ref["grads"]) - set(got["grads"])))}
    return {
        "loss": abs(got["loss"] - ref["loss"]),
        "logits": float(np.abs(got["logits"] - ref["logits"][rows]).max()),
        "grads": max(float(np.abs(got["grads"][n] - ref["grads"][n]).max()) for n in ref["grads"]),
    }


def failures_of(group: list, folders: dict[str, str], model_type: str) -> list[str]:
    """Every rank and layout of one architecture against ``from_pretrained`` of its folder."""
    ref, tol, failures = reference(folders[model_type]), tolerance(model_type), []
    for layout in LAYOUTS:
        for rank, results in enumerate(group):
            got, label = results[(model_type, layout)], f"{model_type} {layout} rank {rank}"
            if "error" in got:
                failures.append(f"{label}: {got['error']}")
                continue
            failures += [
                f"{label}: {k} differs by {v:.3g} (tol {tol:.3g})" for k, v in worst(got, ref).items() if v > tol
            ]
    return failures


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_load_pretrained_equals_from_pretrained(group, saved, model_type):
    failures = failures_of(group, saved, model_type)
    assert not failures, "\n".join(failures)


@pytest.mark.zoo  # breadth: the zoo sweep's architectures (make zoo)
def test_load_pretrained_of_the_zoo_sweep_equals_from_pretrained(tmp_path):
    """Every sweep architecture, EXAONE and GPT-NeoX included: transformers renames their checkpoint keys
    (``transformer.h``, ``embed_out``) on load, and so does load_pretrained (its own renaming rule)."""
    folders = save_tiny(tmp_path, SWEEP)
    group = run_distributed(load_group, 2, folders, timeout=900)
    failures = [f for model_type in SWEEP for f in failures_of(group, folders, model_type)]
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_checkpoint_names_follow_transformers_renaming_and_conversions_are_refused(tmp_path):
    """GPT-NeoX stores ``embed_out`` and EXAONE ``transformer.h.*``, which transformers renames on load: the
    loader maps them to the model's names. Mixtral's per-expert tensors are fused by transformers on load (a
    conversion, not a rename): refused by name, pointing at from_pretrained."""
    from ndparallel.errors import ConfigError
    from ndparallel.models.hf.pretrained import _weight_files

    for model_type, stored, model_name in (
        ("gpt_neox", "embed_out.weight", "lm_head.weight"),
        ("exaone", "transformer.h.0.attn.attention.out_proj.weight", "model.layers.0.self_attn.o_proj.weight"),
    ):
        folder = tmp_path / model_type
        build(model_type).save_pretrained(folder)
        meta = _meta_tiny(model_type)
        files = _weight_files(folder, meta)
        assert files[model_name][1] == stored and stored not in files, model_type
        assert {n for n, _ in meta.named_parameters()} <= set(files), model_type
    folder = tmp_path / "mixtral"
    build("mixtral").save_pretrained(folder)
    with pytest.raises(ConfigError, match=r"transformers converts the stored tensors .*experts.*from_pretrained"):
        _weight_files(folder, _meta_tiny("mixtral"))


def _print_table() -> None:
    """``python -m tests.models.test_hf_load_zoo``: docs/huggingface.md's table, per architecture and layout
    the worst of loss, logits and gradient differences against from_pretrained."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        folders = save_tiny(Path(root), ARCHS)
        results = run_distributed(load_group, 2, folders, timeout=600)
        for model_type, folder in folders.items():
            ref, cells = reference(folder), []
            for layout in LAYOUTS:
                got = results[0][(model_type, layout)]
                cells.append(
                    f"{layout} {got['error'][:80]}"
                    if "error" in got
                    else f"{layout} {max(worst(got, ref).values()):.1e}"
                )
            print(f"{model_type:12s} tol {tolerance(model_type):.1e}", *cells)


if __name__ == "__main__":
    _print_table()


def _tiny(model_type: str):
    from ndparallel.hf import tiny_config

    return transformers.AutoModelForCausalLM.from_config(tiny_config(model_type, **ARCHS.get(model_type, {})))


def _meta_tiny(model_type: str):
    with torch.device("meta"):
        return _tiny(model_type)


def test_init_buffers_recomputes_non_persistent_buffers_and_keeps_parameters():
    """Gemma 3's embed_scale (beside a parameter) and the rotary tables equal a CPU build's after to_empty;
    the parameters keep their memory (the checkpoint fills them, the init must not redraw them)."""
    from ndparallel.models.hf.init import init_buffers

    model = _meta_tiny("gemma3_text")
    model.to_empty(device="cpu")
    for param in model.parameters():
        param.detach().fill_(7.0)
    init_buffers(model)
    cpu = dict(_tiny("gemma3_text").named_buffers())
    assert {n: b.tolist() for n, b in model.named_buffers()} == {n: b.tolist() for n, b in cpu.items()}
    assert all(bool((p == 7.0).all()) for p in model.parameters())


def test_a_buffer_the_init_cannot_recompute_is_refused_by_name(tmp_path):
    """A non-persistent buffer ``_init_weights`` does not set, and a persistent one the checkpoint lacks: one-line
    ConfigErrors naming the buffer, not uninitialised memory."""
    from ndparallel.errors import ConfigError
    from ndparallel.models.hf.init import init_buffers
    from ndparallel.models.hf.pretrained import _fill_from_files, _weight_files

    model = _meta_tiny("llama")
    model.model.norm.register_buffer("odd", torch.ones(3), persistent=False)
    model.to_empty(device="cpu")
    with pytest.raises(ConfigError, match=r"non-persistent buffers \['model.norm.odd'\]"):
        init_buffers(model)
    build("llama").save_pretrained(tmp_path)
    model = _meta_tiny("llama")
    model.model.norm.register_buffer("kept", torch.ones(3))
    model.to_empty(device="cpu")
    with pytest.raises(ConfigError, match=r"checkpoint lacks tensors \['model.norm.kept'\]"):
        _fill_from_files(model, _weight_files(tmp_path, model))
