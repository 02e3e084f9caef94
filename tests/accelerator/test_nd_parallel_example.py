"""Accelerate's own ND-parallel example with the imports changed (tests/accelerator/accelerate_nd_parallel.py),
examples/nd_parallel.py (ndparallel's port) and a Hugging Face model's ``outputs.loss`` under tp/cp, on 4 CPU
ranks against one process.

One spawned group of 4 gloo ranks runs: Accelerate's example on dp_shard 4, dp_shard 2 x tp 2, HSDP,
dp_shard 2 x cp 2 and tp 2 x cp 2 in float64 (3 SGD steps: logged losses and the weights ``save_pretrained``
wrote within 1e-10 of plain transformers), then twice with its bf16 defaults on dp_shard 4 (12 steps at lr
1e-5: fp32 master weights under mixed_precision bf16 change almost every weight, bf16 ones almost none); the
port on dp_shard 2 x tp 2 (fp32, within 1e-5); then the float64 loss checks: ``labels`` (sharded or whole,
with ignored positions spread unevenly over the cp ranks), ``shift_labels`` and ``num_items_in_batch`` on
tp 2 x cp 2 and dp_shard 2 x cp 2 (losses and every gradient within 1e-10 of plain ``F.cross_entropy``).
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

pytestmark = pytest.mark.slow  # one group, 8 trainings and 5 loss checks: ~2-4 min on 2 loaded cores

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "nd_parallel.py"
STEPS, SEQ, LR, DP = 3, 16, 0.5, 2
ARGS = ["--num-steps", str(STEPS), "--sequence-length", str(SEQ), "--mixed-precision", "no"]
ARGS += ["--learning-rate", str(LR), "--checkpoint-frequency", "2"]
SHAPES = {"dp2_tp2": {"dp_shard_size": 2, "tp_size": 2}}
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


def run_group(out_root: str, model_dir: str) -> dict:
    """On every rank: Accelerate's example on its five shapes (float64) and twice in bf16 (master weights), the
    ported example on dp_shard 2 x tp 2, then the float64 loss checks; warnings recorded."""
    import warnings

    example = load_example()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerate_runs = run_accelerate_example(out_root, model_dir)
        _fresh_group("port")
        example.set_seed(42)
        sizes = SHAPES["dp2_tp2"]
        example.train(example.parse_args([*ARGS, *shape_argv(sizes), "--save-dir", f"{out_root}/dp2_tp2"]))
    _fresh_group("loss")
    return {**loss_checks(), **accelerate_runs, "warnings": [str(w.message) for w in caught]}


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
    model_dir = root / "tiny-llama"
    tiny_llama_folder(model_dir)
    results = run_distributed(run_group, 4, str(root), str(model_dir), timeout=900)
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


# --------------------------------------------------- Accelerate's own example, imports changed (float64)

ACCELERATE_SHAPES = {
    "acc_dp4": {"dp_shard_size": 4},
    "acc_dp2_tp2": {"dp_shard_size": 2, "tp_size": 2},
    "acc_hsdp": {"dp_replicate_size": 2, "dp_shard_size": 2},
    "acc_dp2_cp2": {"dp_shard_size": 2, "cp_size": 2},
    "acc_tp2_cp2": {"tp_size": 2, "cp_size": 2},
}
ACC_STEPS, ACC_SEQ, ACC_LR = 3, 16, 0.5
MASTER_STEPS, MASTER_SEQ = 12, 32  # the example's dp_shard 4, SGD lr 1e-5, 12 steps, bf16 weights
ACC_FP64_TOL = 1e-10  # measured: losses <= 1.8e-15 under tp/cp, weights <= 2.2e-16 on every shape
# Without tp/cp the loss is transformers' own, which casts the logits to fp32: each rank's loss and the one-process
# loss are fp32 means of different token sets. Measured 4.77e-7 (one fp32 ulp at a loss of ~6); weights 2.2e-16.
ACC_OWN_LOSS_TOL = 1e-6


def tiny_llama_folder(path: Path) -> None:
    """A tiny random Llama written by ``save_pretrained`` (fp32): what ``--model-name`` points at."""
    torch.manual_seed(42)
    config = load_example().tiny_llama_config()
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)


def _accelerate_example():
    from tests.accelerator import accelerate_nd_parallel, nd_parallel_utils

    return accelerate_nd_parallel, nd_parallel_utils


def _run_accelerate(example, tag: str, argv: list[str]) -> list[float]:
    """``set_seed(42); train(parse_args())`` as the example's ``__main__`` runs it; returns the logged losses."""
    import sys

    logged: list[float] = []

    class LoggingAccelerator(example.Accelerator):  # log_with=["wandb"] is skipped: record what it would log
        def log(self, values, step=None, log_kwargs=None):
            logged.append(values["loss"])
            super().log(values, step, log_kwargs)

    _fresh_group(tag)
    real, example.Accelerator = example.Accelerator, LoggingAccelerator
    saved_argv, sys.argv = sys.argv, ["nd_parallel.py", *argv]
    try:
        example.set_seed(42)
        example.train(example.parse_args())
    finally:
        example.Accelerator, sys.argv = real, saved_argv
    return logged


def run_accelerate_example(out_root: str, model_dir: str) -> dict:
    example, utils = _accelerate_example()
    utils.NUM_SAMPLES = MASTER_STEPS * 4
    results = {}
    example.DTYPE, example.MIXED_PRECISION, example.LEARNING_RATE = torch.float64, "no", ACC_LR
    base = ["--model-name", model_dir, "--num-steps", str(ACC_STEPS), "--sequence-length", str(ACC_SEQ)]
    for name, sizes in ACCELERATE_SHAPES.items():
        argv = [*base, *shape_argv(sizes), "--checkpoint-frequency", "2", "--save-dir", f"{out_root}/{name}"]
        results[name] = _run_accelerate(example, name, argv)
    example.DTYPE, example.LEARNING_RATE = torch.bfloat16, 1e-5
    base = ["--model-name", model_dir, "--num-steps", str(MASTER_STEPS), "--sequence-length", str(MASTER_SEQ)]
    for precision in ("bf16", "no"):
        example.MIXED_PRECISION = precision
        argv = [*base, "--dp-shard-size=4", "--save-dir", f"{out_root}/master_{precision}"]
        results[f"master_{precision}"] = _run_accelerate(example, f"master_{precision}", argv)
    return results


def accelerate_reference(model_dir: Path, dp: int, own_loss: bool) -> dict:
    """One process, plain transformers, float64: each step's batch is the dp ranks' samples. The loss is what
    ndparallel computes on that mesh: transformers' own ``outputs.loss`` (it casts the logits to fp32) where
    no tp/cp is used (``own_loss``), else ndparallel's tp/cp loss, a float64 cross entropy for float64 logits."""
    _, utils = _accelerate_example()
    utils.NUM_SAMPLES = MASTER_STEPS * 4
    windows = utils.packed_windows(ACC_SEQ)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float64, use_cache=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=ACC_LR)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = []
    for step in range(ACC_STEPS):
        rows = windows[step * dp : (step + 1) * dp]
        inputs, targets = rows[:, :-1], rows[:, 1:].contiguous()
        if own_loss:
            loss = model(input_ids=inputs, labels=targets, shift_labels=targets).loss
        else:
            loss = F.cross_entropy(model(input_ids=inputs).logits.flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "initial": initial, "final": {n: p.detach() for n, p in model.named_parameters()}}


def _dp(sizes: dict) -> int:
    return sizes.get("dp_replicate_size", 1) * sizes.get("dp_shard_size", 1)


def _saved(root: Path, name: str, model_dir: Path):
    """The folder ``model.save_pretrained(save_dir + "/" + model_name)`` wrote (model_name is an absolute path)."""
    return transformers.AutoModelForCausalLM.from_pretrained(f"{root}/{name}/{model_dir}", torch_dtype=torch.float64)


@pytest.mark.parametrize("shape", sorted(ACCELERATE_SHAPES))
def test_accelerates_example_with_imports_changed_equals_one_process(group, shape):
    root, model_dir = group["root"], group["root"] / "tiny-llama"
    sizes = ACCELERATE_SHAPES[shape]
    own_loss = "tp_size" not in sizes and "cp_size" not in sizes
    ref = accelerate_reference(model_dir, _dp(sizes), own_loss)
    loss_tol = ACC_OWN_LOSS_TOL if own_loss else ACC_FP64_TOL
    errors = []
    for result in group["ranks"]:
        logged = result[shape]
        assert len(logged) == ACC_STEPS
        errors.append(max(abs(a - b) for a, b in zip(logged, ref["losses"], strict=True)))
    moved = max((ref["final"][n] - ref["initial"][n]).abs().max().item() for n in ref["final"])
    assert moved > 1e-2, "the reference barely trains: the weight check could not fail"
    saved = _saved(root, shape, model_dir).named_parameters()
    weight_error = max((p.detach() - ref["final"][n]).abs().max().item() for n, p in saved)
    print(f"{shape}: loss error {max(errors):.2e}, weight error {weight_error:.2e}")
    assert max(errors) <= loss_tol and weight_error <= ACC_FP64_TOL, (shape, errors, weight_error)
    checkpoint = root / shape / "checkpoint-2"
    assert checkpoint.is_dir() == ("dp_shard_size" in ACCELERATE_SHAPES[shape])


def test_accelerates_example_skips_wandb_with_a_warning(group):
    for rank, result in enumerate(group["ranks"]):
        skipped = [w for w in result["warnings"] if "log_with='wandb'" in w and "skipped" in w]
        assert skipped, (rank, result["warnings"])


def _changed_weights(root: Path, name: str, model_dir: Path) -> tuple[int, int]:
    """How many weights the bf16 run changed: the saved weights against the bf16 ones it loaded."""
    start = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16)
    initial = {n: p.detach().double() for n, p in start.named_parameters()}
    changed = total = 0
    for n, p in _saved(root, name, model_dir).named_parameters():
        changed += int((p.detach() != initial[n]).sum())
        total += p.numel()
    return changed, total


def test_bf16_weights_get_fp32_master_weights_under_mixed_precision(group):
    # Accelerate's rule: mixed_precision bf16 with FSDP upcasts trainable bf16 parameters to fp32 master weights.
    # Without them (mixed_precision "no": the bf16 tensors train as stored) SGD at lr 1e-5 rounds most updates away.
    root, model_dir = group["root"], group["root"] / "tiny-llama"
    with_master, total = _changed_weights(root, "master_bf16", model_dir)
    without, _ = _changed_weights(root, "master_no", model_dir)
    print(f"weights changed of {total}: {with_master} with fp32 master weights, {without} without")
    assert with_master > 0.9 * total and without < 0.01 * total, (with_master, without, total)
    for rank, result in enumerate(group["ranks"]):
        lost = [w for w in result["warnings"] if "without fp32 master weights" in w]
        assert len(lost) >= 1, (rank, result["warnings"])  # the bf16 run without mixed precision warns
        assert len(result["master_bf16"]) == len(result["master_no"]) == MASTER_STEPS
