"""examples/nd_parallel.py (Accelerate's ND-parallel example, ported) on 4 CPU ranks equals one process, and
a Hugging Face model's ``outputs.loss`` under tp/cp equals the one-process loss exactly (float64).

One spawned group of 4 gloo ranks runs the example's ``train()`` on dp_shard 2 x tp 2 and dp_shard 2 x cp 2
(3 SGD steps, fp32: logged losses and the weights written by ``model.save_pretrained`` within 1e-5 of a
plain transformers loop), then the float64 loss checks: ``labels`` (sharded or whole, with ignored positions
spread unevenly over the cp ranks), ``shift_labels`` and ``num_items_in_batch`` on tp 2 x cp 2 and
dp_shard 2 x cp 2 (losses and every gradient within 1e-10 of plain ``F.cross_entropy``).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip(
    "transformers", reason="the example needs the hf extra: pip install 'ndparallel[hf]' (make test does)"
)

from ndparallel.testing import run_distributed  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "nd_parallel.py"
STEPS, SEQ, LR, DP = 3, 16, 0.5, 2
ARGS = ["--num-steps", str(STEPS), "--sequence-length", str(SEQ), "--mixed-precision", "no"]
ARGS += ["--learning-rate", str(LR), "--checkpoint-frequency", "2"]
SHAPES = {"dp2_tp2": {"dp_shard_size": 2, "tp_size": 2}, "dp2_cp2": {"dp_shard_size": 2, "cp_size": 2}}
FP32_TOL = 1e-5  # measured: losses <= 4.8e-7, saved weights <= 2.9e-7 (2 cores, torch 2.13)
FP64_TOL = 1e-10  # measured: losses <= 9e-16, gradients <= 1e-16


def load_example():
    spec = importlib.util.spec_from_file_location("nd_parallel_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fresh_group(tag: str) -> None:
    """``end_training()`` destroyed the process group: start another one over a new file store."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo",
            init_method=f"file://{os.environ['NDP_STORE_PATH']}-{tag}",
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )


def shape_argv(sizes: dict) -> list[str]:
    return [f"--{k.replace('_size', '').replace('_', '-')}-size={v}" for k, v in sizes.items()]


def run_group(out_root: str) -> dict:
    """On every rank: the example on each shape (recording warnings), then the float64 loss checks."""
    import warnings

    example = load_example()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, sizes in SHAPES.items():
            _fresh_group(name)
            example.set_seed(42)
            example.train(example.parse_args([*ARGS, *shape_argv(sizes), "--save-dir", f"{out_root}/{name}"]))
    _fresh_group("loss")
    return {**loss_checks(), "warnings": [str(w.message) for w in caught]}


# ------------------------------------------------------------------------------ the example vs one process


def reference_training(example) -> dict:
    """Plain transformers + SGD in one process: each step's global batch is the dp ranks' samples."""
    torch.manual_seed(42)
    model = transformers.AutoModelForCausalLM.from_config(example.tiny_llama_config())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    dataset = example.synthetic_dataset(STEPS * DP, SEQ, 256)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = []
    for step in range(STEPS):
        batch = example.collate(dataset[step * DP : (step + 1) * DP])
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"], shift_labels=batch["shift_labels"]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "initial": initial, "final": {n: p.detach() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def reference():
    return reference_training(load_example())


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    root = tmp_path_factory.mktemp("nd_parallel")
    results = run_distributed(run_group, 4, str(root), timeout=600)
    return {"root": root, "ranks": results}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_example_matches_one_process(group, reference, shape):
    ref = reference
    out = group["root"] / shape
    lines = (out / "nd_parallel_training" / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(line)["loss"] for line in lines]
    assert len(logged) == STEPS
    assert max(abs(a - b) for a, b in zip(logged, ref["losses"], strict=True)) <= FP32_TOL, (logged, ref["losses"])
    saved = transformers.AutoModelForCausalLM.from_pretrained(out / "tiny-random-llama")
    moved = max((ref["final"][n] - ref["initial"][n]).abs().max().item() for n in ref["final"])
    assert moved > 1e-2, "the reference barely trains: the weight check could not fail"
    for name, param in saved.named_parameters():
        diff = (param.detach() - ref["final"][name]).abs().max().item()
        assert diff <= FP32_TOL, f"{shape}: saved {name} differs from the one-process weights by {diff}"
    checkpoint = out / "checkpoint-2"
    assert (checkpoint / "ndparallel_meta.json").is_file() and len(list(checkpoint.glob("*.distcp"))) == 4


def test_example_runs_without_fsdp_view_warnings(group):
    # FSDP2 (torch 2.13+) warns when a unit returns a view (TP's to_local() on the embedding and final norm);
    # parallelize hands it non-view aliases, so a TP x FSDP run of a Hugging Face model stays quiet.
    for rank, result in enumerate(group["ranks"]):
        assert not [w for w in result["warnings"] if "returned a view tensor" in w], (rank, result["warnings"])


# --------------------------------------------------------------------------- HF loss under tp/cp (float64)

LOSS_CASES = {
    # name: (mesh sizes, what the model gets)
    "tp2_cp2_labels": ({"tp_size": 2, "cp_size": 2}, "labels"),
    "tp2_cp2_whole_labels": ({"tp_size": 2, "cp_size": 2}, "whole_labels"),
    "tp2_cp2_shift_labels": ({"tp_size": 2, "cp_size": 2}, "shift_labels"),
    "tp2_cp2_num_items": ({"tp_size": 2, "cp_size": 2}, "num_items"),
    "dp2_cp2_labels": ({"dp_shard_size": 2, "cp_size": 2}, "labels"),
}
LOSS_BATCH, LOSS_SEQ, NUM_ITEMS = 2, 16, 40


def tiny_llama64():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double()


def loss_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels; the last 5 labels of each row are ignored (-100), so the cp ranks get unequal numbers
    of valid targets (the dp ranks equal ones: their losses are means over their own rows)."""
    tokens = torch.randint(0, 64, (LOSS_BATCH, LOSS_SEQ), generator=torch.Generator().manual_seed(1))
    labels = tokens.clone()
    labels[:, -5:] = -100
    return tokens, labels


def reference_loss(kind: str) -> dict:
    """Plain transformers model, plain float64 F.cross_entropy on the next tokens."""
    model = tiny_llama64()
    tokens, labels = loss_tokens()
    logits = model(input_ids=tokens).logits[:, :-1].flatten(0, 1)
    targets = labels[:, 1:].flatten()
    if kind == "num_items":
        loss = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum") / NUM_ITEMS
    else:
        loss = F.cross_entropy(logits, targets, ignore_index=-100)
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad.numpy().copy() for n, p in model.named_parameters()}}


def parallel_loss(sizes: dict, kind: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import ndparallel as ndp

    mesh = ndp.init_distributed(ndp.ParallelismConfig(**sizes))
    model = ndp.parallelize(tiny_llama64(), mesh.config, mesh)
    tokens, labels = loss_tokens()
    per_rank, dp_rank = LOSS_BATCH // mesh.size("dp"), mesh.local_rank("dp")
    tokens, labels = (t[dp_rank * per_rank : (dp_rank + 1) * per_rank].clone() for t in (tokens, labels))
    shift = F.pad(labels[:, 1:], (0, 1), value=-100)
    buffers = [tokens] if kind == "whole_labels" else [tokens, labels, shift]
    with ndp.context_parallel(mesh, buffers, [1] * len(buffers), no_restore=buffers):
        kwargs = {"labels": labels}
        if kind == "shift_labels":
            kwargs["shift_labels"] = shift
        if kind == "num_items":
            kwargs["num_items_in_batch"] = NUM_ITEMS
        loss = model(input_ids=tokens, **kwargs).loss
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh["dp_cp"].get_group())  # float64: average_over would round to fp32
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        grads[name] = grad.numpy().copy()
    return {"loss": total.item() / mesh.size("dp_cp"), "grads": grads}


def loss_checks() -> dict:
    return {name: parallel_loss(sizes, kind) for name, (sizes, kind) in LOSS_CASES.items()}


@pytest.mark.parametrize("case", sorted(LOSS_CASES))
def test_hf_loss_under_tp_and_cp_is_exact_in_float64(group, case):
    ref = reference_loss(LOSS_CASES[case][1])
    for rank, result in enumerate(group["ranks"]):
        got = result[case]
        assert abs(got["loss"] - ref["loss"]) <= FP64_TOL, (rank, got["loss"], ref["loss"])
        for name, grad in ref["grads"].items():
            assert np.abs(got["grads"][name] - grad).max() <= FP64_TOL, (rank, case, name)
