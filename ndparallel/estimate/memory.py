"""Per-rank memory of one training step: state (params, grads, AdamW), activations, peak transient.

Layout assumed (ndparallel's planners): tensor parallel with sequence parallel splits every block
matmul and the embedding / output over ``tp`` (norms are replicated over tp); FSDP2 then shards
every tensor over ``dp_shard x cp`` in units of one transformer block, the embedding, and
[final norm + output]. ``dp_replicate`` keeps full copies (HSDP when dp_shard x cp > 1, plain
replicate otherwise). Formulas: docs/planning.md.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import asdict, dataclass

from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.config.precision import forward_autocast_dtype
from ndparallel.distributed.ulysses import kv_heads_sent
from ndparallel.errors import ConfigError
from ndparallel.estimate.checkpointing import blocks_after_last_checkpointed, checkpointed_count, per_op
from ndparallel.estimate.experts import (
    expert_elements,
    gathered_expert_elements,
    gathered_router_elements,
    moe_block_params,
    moe_ffn_activation_bytes_per_token,
    stored_expert_elements,
    stored_router_elements,
)
from ndparallel.estimate.mesh import MeshShape
from ndparallel.estimate.model import ModelSpec
from ndparallel.estimate.pipeline import MEASURED_SCHEDULES, RankShare, in_flight, microbatches, rank_shares
from ndparallel.estimate.training import ACTIVATION_CHECKPOINTING, TrainingSpec

__all__ = [
    "MemoryEstimate",
    "activation_bytes",
    "activation_parts",
    "autocast_weight_bytes",
    "autocasts",
    "checkpointed_blocks",
    "estimate_memory",
    "fsdp_units",
    "dense_params",
    "gathered_params",
    "layer_activation_bytes_per_token",
    "params_per_rank",
    "pipeline_train",
    "precision_problem",
    "residual_bytes",
    "rotary_copy_bytes",
    "saved_activation_bytes",
]

DDP_BUCKET_BYTES = 25 * 10**6  # ndparallel's replicate default bucket (dp_bucket_mb=25)


def checkpointed_blocks(n_layers: int, mode: str, option: str = "2") -> int:
    """Blocks wrapped in a checkpoint: all (``full``, per-op ``selective``), every ``option``-th one starting
    with the first (per-layer ``selective``; ``"2"`` is ndparallel's parallel/activation_checkpoint.py), or none
    (estimate/checkpointing.py)."""
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"activation checkpointing mode {mode!r} not in {ACTIVATION_CHECKPOINTING}")
    return checkpointed_count(n_layers, mode, option)


def per_op_layer_bytes_per_token(model: ModelSpec, train: TrainingSpec, tp: int) -> float:
    """What a block saves per token under per-op selective checkpointing (estimate/checkpointing.py): its input
    (sequence-sharded), the outputs of wq, wv and w1, attention's output and fp32 log-sum-exp, w2's output (the
    full ``d`` partial sum under TP) and, under TP, the reduce-scatter outputs of wo and w2. Compiled, w2's output
    and its reduce-scatter are dropped (backward does not read them)."""
    e, t = train.bytes.compute, tp
    saved = e * model.dim / t + e * (2 * model.q_dim + model.kv_dim + model.ffn_dim) / t + 4 * model.n_heads / t
    if train.compile == "none":
        saved += e * model.dim + (e * model.dim / t if t > 1 else 0.0)
    return saved + (e * model.dim / t if t > 1 else 0.0)


def fsdp_units(model: ModelSpec, tp: int) -> dict[str, float]:
    """Parameters of each FSDP unit on one tensor-parallel rank (before FSDP sharding).

    Units: ``embedding``, one ``block`` (there are n_layers of them) and ``head`` (final norm + output).
    """
    block = model.layer_matmul_params / tp + model.layer_norm_params
    return {
        "embedding": model.embedding_params / tp,
        "block": block,
        "head": model.output_params / tp + model.dim,
    }


def largest_unit(model: ModelSpec, mesh: MeshShape) -> float:
    """The largest FSDP unit once gathered on one rank: :func:`fsdp_units`, an MoE block counted with its
    gathered experts (its own unit under ep, all-gathered at the same time)."""
    units = fsdp_units(model, mesh.tp)
    if not model.is_moe:
        return max(units.values())
    if model.n_moe_layers == model.n_layers:
        del units["block"]
    return max(*units.values(), moe_block_params(model, mesh.tp) + gathered_moe_elements(model, mesh))


def gathered_moe_elements(model: ModelSpec, mesh: MeshShape) -> float:
    """An MoE block's router and routed experts, all-gathered on one rank (padding included)."""
    return gathered_router_elements(model, mesh) + gathered_expert_elements(model, mesh)


def dense_params(model: ModelSpec, tp: int, share: RankShare | None = None) -> float:
    """Parameter elements of ``share`` (default: the whole model) on one tensor-parallel rank that FSDP shards
    evenly over dp_shard x cp: all but the MoE blocks' routers and routed experts (whose small dim 0 it pads)."""
    share = share or RankShare.whole(model)
    units = fsdp_units(model, tp)
    dense = share.blocks - share.moe_blocks
    local = units["embedding"] * share.embedding + dense * units["block"] + units["head"] * share.head
    return local + share.moe_blocks * moe_block_params(model, tp) if share.moe_blocks else local


def tp_local_params(model: ModelSpec, tp: int, share: RankShare | None = None) -> float:
    """Parameter elements of ``share`` (default: the whole model) on one tensor-parallel rank, before FSDP (all the
    routed experts included)."""
    share = share or RankShare.whole(model)
    if not share.moe_blocks:
        return dense_params(model, tp, share)
    moe = model.router_params + model.n_experts * expert_elements(model, tp)
    return dense_params(model, tp, share) + share.moe_blocks * moe


def params_per_rank(model: ModelSpec, mesh: MeshShape, share: RankShare | None = None) -> float:
    """Parameter elements held by one rank: its evenly sharded part (:func:`dense_params`) / (dp_shard x cp), and
    each MoE block's router and expert shards (:mod:`ndparallel.estimate.experts`, FSDP2's padding included)."""
    share = share or RankShare.whole(model)
    dense = dense_params(model, mesh.tp, share) / mesh.fsdp
    if not share.moe_blocks:
        return dense
    return dense + share.moe_blocks * (stored_router_elements(model, mesh) + stored_expert_elements(model, mesh))


def gathered_params(model: ModelSpec, mesh: MeshShape, share: RankShare | None = None) -> float:
    """Elements of ``share``'s FSDP units all-gathered on one rank: the tp-local share, each MoE block's experts
    its ``n_experts / ep`` (the all-gathers' outputs, the reduce-scatters' inputs; padding included)."""
    share = share or RankShare.whole(model)
    if not share.moe_blocks:
        return dense_params(model, mesh.tp, share)
    return dense_params(model, mesh.tp, share) + share.moe_blocks * gathered_moe_elements(model, mesh)


def norm_activation_bytes_per_token(model: ModelSpec, train: TrainingSpec, tp: int) -> float:
    """What one RMSNorm and the column-parallel linears after it save, per token.

    Fused kernel (CUDA): its input (sequence-sharded, ``d/t``) and an fp32 rstd. Composite (CPU, eager
    without a fused kernel): an fp32 copy of the input and the fp32 normalised input (``2 x 4 d/t``) and
    the rstd. Either way the all-gathered output, saved by wq/wk/wv or w1/w3, is ``d`` in the compute dtype.
    """
    e, d, t = train.bytes.compute, model.dim, tp
    internal = e * d / t if train.fused_norm or train.compile != "none" else 2 * 4 * d / t  # compiled: fused
    return internal + 4 / t + e * d


def layer_activation_bytes_per_token(
    model: ModelSpec, train: TrainingSpec, tp: int, cp: int = 1, moe: bool = False
) -> float:
    """Bytes one block saves for backward per token (of this rank's sequence shard), no checkpointing.

    Counted tensor by tensor for the reference block with SP (``d`` = dim, ``f`` = ffn_dim, ``t`` = tp),
    as autograd saves them (checked with saved-tensor hooks, tests/estimate/test_estimate.py): two RMSNorms
    (``norm_activation_bytes_per_token``); attention's q, k, v and output (``2 q_dim/t + 2 kv'/t``) with
    its fp32 log-sum-exp (``heads/t``), where ``kv' = q_dim`` when SDPA gets k/v repeated for grouped-query
    attention and ``kv_dim`` otherwise (and under context parallel: ring attention keeps the kv heads);
    SwiGLU's w1 out, silu out, w3 out and product (``4f/t``), in the compute dtype (compiled: w1 and w3 out only,
    ``2f/t``). All-to-all (Ulysses)
    context parallel keeps the kv heads it sent (``lcm(kv heads, cp)`` when cp does not divide them) and, besides
    the output the projection saves, SDPA's own head-sharded output (one more ``q_dim/t``). ``moe``: an MoE
    block, whose feed-forward saves :func:`ndparallel.estimate.experts.moe_ffn_activation_bytes_per_token`.
    """
    e, t = train.bytes.compute, tp
    repeated = model.n_kv_heads < model.n_heads and cp == 1  # CoreAttention's repeat_interleave for GQA
    kv_saved = model.q_dim if repeated else model.kv_dim
    ulysses_output = 0.0
    if cp > 1 and train.cp_rotate_method == "alltoall":
        kv_saved = kv_heads_sent(model.n_kv_heads // t, cp) * model.head_dim * t
        ulysses_output = e * model.q_dim / t
    attention = e * (2 * model.q_dim + 2 * kv_saved) / t + 4 * model.n_heads / t + ulysses_output
    # Compiled, the partitioner recomputes silu(w1 x) * w3 x in backward from the two matmul outputs it saves.
    mlp = e * (2 if train.compile != "none" else 4) * model.ffn_dim / t
    if moe:
        mlp = moe_ffn_activation_bytes_per_token(model, train, tp)
    return 2 * norm_activation_bytes_per_token(model, train, tp) + attention + mlp


def head_activation_bytes_per_token(model: ModelSpec, train: TrainingSpec, tp: int) -> float:
    """The final RMSNorm (as in a block), vocab-parallel logits in the compute dtype, the fp32 log-softmax the
    loss saves and its fp32 gradient at the start of backward (``V/t`` each); with ``compiled_loss`` the logits
    and their gradient in the compute dtype."""
    vocab = model.vocab_size / tp
    if train.compiled_loss:  # one graph: the compute-dtype logits and their gradient, no fp32 copies
        return norm_activation_bytes_per_token(model, train, tp) + vocab * 2 * train.bytes.compute
    return norm_activation_bytes_per_token(model, train, tp) + vocab * (train.bytes.compute + 4 + 4)


def rotary_copy_bytes(model: ModelSpec, train: TrainingSpec, mesh: MeshShape) -> float:
    """The rotary cos and sin each block saves for a micro-batch: FSDP2's mixed precision casts a unit's floating
    inputs, so every block saves its own compute-dtype copy (checkpointed: as its input; else in the rotation's
    products), ``[rows, seq / cp, head_dim / 2]`` each (rows: the micro-batch under pp, whose stages gather the
    tables by position, else 1), not split over tp. Uncast, the blocks share one table (not counted)."""
    if mesh.fsdp == 1 or train.bytes.compute == train.bytes.param:
        return 0.0
    rows = train.micro_batch if mesh.pp > 1 else 1
    return train.bytes.compute * model.head_dim * rows * train.seq_len / mesh.cp


def activation_bytes(
    model: ModelSpec,
    train: TrainingSpec,
    mesh: MeshShape,
    mode: str | None = None,
    blocks: int | None = None,
    head: bool = True,
    saved_only: bool = False,
    moe_blocks: int | None = None,
) -> float:
    """Peak activation bytes of one micro-batch on one rank for checkpointing ``mode`` (default: train's).

    ``none``: every block's saved tensors. ``full``: each block keeps only its (sequence-sharded) input,
    and one block's tensors exist again while it is recomputed. ``selective``: every other block is
    checkpointed (ndparallel's definition). The loss head is never checkpointed. ``blocks`` / ``head``: a
    pipeline stage's part (default the whole model), ``moe_blocks`` how many of them are MoE blocks (default: the
    model's, or none of a stage's). ``saved_only``: what autograd saves, without the head's logits and their
    fp32 gradient (live at the start of backward, not saved). The peak is the larger of two moments
    (:func:`activation_parts`): the start of backward, and the last checkpointed block's recomputation.
    """
    held, recomputing = activation_parts(model, train, mesh, mode, blocks, head, saved_only, moe_blocks)
    return held + recomputing


def activation_parts(
    model: ModelSpec,
    train: TrainingSpec,
    mesh: MeshShape,
    mode: str | None = None,
    blocks: int | None = None,
    head: bool = True,
    saved_only: bool = False,
    moe_blocks: int | None = None,
) -> tuple[float, float]:
    """(bytes a micro-batch holds at the start of its backward, bytes more while its backward recomputes a block)
    (arguments: :func:`activation_bytes`).

    At the start of backward: the blocks' saved tensors or inputs and the head's. The head's backward runs first
    and frees what the head saved (and the logits' gradient) before any block is recomputed, and the blocks after
    the last checkpointed one have run their backward too (:func:`ndparallel.estimate.checkpointing
    .blocks_after_last_checkpointed`); while that block is recomputed its saved tensors exist again, beside the
    logits the caller still holds (``out`` in train/step.py; none when the compiled loss never writes them)."""
    mode = mode or train.activation_checkpointing
    tokens = train.micro_batch * train.seq_len / mesh.cp
    n_layers = model.n_layers if blocks is None else blocks
    n_moe = (model.n_moe_layers if blocks is None else 0) if moe_blocks is None else moe_blocks
    rotary = rotary_copy_bytes(model, train, mesh)  # every block's own, checkpointed or not (saved once)
    layer, largest = _layer_bytes(model, train, mesh, n_layers, n_moe)
    layer, largest = layer * tokens + rotary, largest * tokens  # the recomputed block's tables: its input's
    block_input = train.bytes.compute * model.dim / mesh.tp * tokens + rotary
    option = train.selective_ac_option
    checkpointed = checkpointed_blocks(n_layers, mode, option)
    stored = (n_layers - checkpointed) * layer + checkpointed * block_input
    if per_op(mode, option):
        stored = n_layers * (per_op_layer_bytes_per_token(model, train, mesh.tp) * tokens + rotary)
    head_bytes = head_activation_bytes_per_token(model, train, mesh.tp) * tokens if head else 0.0
    if head and saved_only:
        transient = train.bytes.compute if train.compiled_loss else train.bytes.compute + 4
        head_bytes -= model.vocab_size / mesh.tp * transient * tokens
    if not checkpointed:
        return stored + head_bytes, 0.0
    freed = blocks_after_last_checkpointed(n_layers, mode, option) * layer
    logits = model.vocab_size / mesh.tp * train.bytes.compute * tokens
    live_logits = logits if head and not saved_only and not train.compiled_loss else 0.0
    return stored + head_bytes, max(0.0, largest + live_logits - freed - head_bytes)


def _layer_bytes(model: ModelSpec, train: TrainingSpec, mesh: MeshShape, blocks: int, moe: int) -> tuple[float, float]:
    """(mean, largest) bytes per token one of ``blocks`` blocks saves, ``moe`` of them MoE blocks."""
    dense = layer_activation_bytes_per_token(model, train, mesh.tp, mesh.cp)
    if not moe:
        return dense, dense
    sparse = layer_activation_bytes_per_token(model, train, mesh.tp, mesh.cp, moe=True)
    mean = ((blocks - moe) * dense + moe * sparse) / blocks
    return mean, max(sparse, dense) if moe < blocks else sparse


def autocasts(train: TrainingSpec, mesh: MeshShape) -> bool:
    """Whether the forward runs under ``torch.autocast`` (mixed precision without FSDP): the trainer's rule,
    :func:`ndparallel.config.precision.forward_autocast_dtype` (fp16 there is refused: see :func:`precision_problem`).
    Then the fp32 weights are cast per matmul and the residual stream stays in the parameter dtype."""
    return train.precision != "fp32" and mesh.fsdp == 1 and not precision_problem(train, mesh)


@functools.lru_cache(maxsize=64)
def _autocast_refusal(mixed: str, dp_shard: int, cp: int) -> str:
    try:
        forward_autocast_dtype(ParallelismConfig(dp_shard_size=dp_shard, cp_size=cp, mixed_precision=mixed))
    except ConfigError as err:
        return str(err)
    return ""


def precision_problem(train: TrainingSpec, mesh: MeshShape) -> str:
    """The trainer's refusal of ``train.precision`` on this mesh ("" if none): fp16 needs FSDP."""
    return _autocast_refusal(train.mixed_precision, mesh.dp_shard, mesh.cp)


def residual_bytes(train: TrainingSpec, mesh: MeshShape) -> int:
    """Bytes per element of the residual stream (what pp sends between stages): the compute dtype under FSDP's
    mixed-precision policy, which casts the weights; the parameter dtype under autocast (measured: fp32)."""
    return train.bytes.param if autocasts(train, mesh) else train.bytes.compute


def autocast_weight_bytes(
    model: ModelSpec, train: TrainingSpec, mesh: MeshShape, blocks: int, head: bool, mode: str | None = None,
    moe_blocks: int = 0,
) -> float:  # fmt: skip
    """Under autocast each forward saves its own compute-dtype copy of the matmul weights it used (the blocks
    not checkpointed and the output projection; the embedding and norms run in fp32), until its backward: one
    copy per pipeline micro-batch in flight (measured: tests/estimate/test_pipeline.py, docs/planning.md).
    An MoE block (``moe_blocks`` of the ``blocks``) casts every expert it holds (no FSDP under autocast: all)."""
    if not autocasts(train, mesh):
        return 0.0
    stored = blocks - checkpointed_blocks(blocks, mode or train.activation_checkpointing, train.selective_ac_option)
    matmul = stored * model.layer_matmul_params
    if moe_blocks:
        sparse = model.moe_matmul_params(model.n_experts) + model.router_params * (mesh.tp - 1)  # gate: whole
        matmul = stored * ((blocks - moe_blocks) * model.layer_matmul_params + moe_blocks * sparse) / blocks
    return train.bytes.compute * (matmul + head * model.vocab_size * model.dim) / mesh.tp


def pipeline_train(train: TrainingSpec, mesh: MeshShape) -> TrainingSpec:
    """Under pp the pipeline's micro-batches are the accumulation: ``micro_batch`` = local batch / m."""
    m = microbatches(train, mesh)
    if mesh.pp == 1 or not m or train.global_batch % (mesh.dp * m):
        return train
    return dataclasses.replace(train, micro_batch=train.global_batch // (mesh.dp * m))


def saved_activation_bytes(
    model: ModelSpec, train: TrainingSpec, mesh: MeshShape, pp_rank: int = 0, mode: str | None = None,
    saved_only: bool = False,
) -> float:  # fmt: skip
    """Activation bytes one pp rank holds at its schedule's peak: for each local stage, the micro-batches in
    flight (:func:`ndparallel.estimate.pipeline.in_flight`) x what that stage's micro-batch holds at the start of
    its backward (under autocast with the weight copies each micro-batch saves, :func:`autocast_weight_bytes`),
    and once, not per micro-batch, the most a backward adds while it recomputes a checkpointed block (a rank
    runs one backward at a time: :func:`activation_parts`). Under the measured schedules the head's stage runs
    each micro-batch's backward right after its forward, so while another local stage recomputes, the head's stage
    holds none (measured by the dry run, interleaved 1F1B: tests/dryrun/test_planner_matrix.py)."""
    train = pipeline_train(train, mesh)
    share = rank_shares(model, mesh)[pp_rank]
    counts = in_flight(mesh, microbatches(train, mesh), pp_rank)
    total, head_held, extras = 0.0, 0.0, []
    for i, (blocks, count) in enumerate(zip(share.stage_blocks, counts, strict=True)):
        head, moe = i == share.last_stage_local, share.moe_blocks_of(i)
        held, extra = activation_parts(model, train, mesh, mode, blocks, head, saved_only, moe)
        held = count * (held + autocast_weight_bytes(model, train, mesh, blocks, head, mode, moe))
        total += held
        if head and mesh.pp_schedule in MEASURED_SCHEDULES:
            head_held = held
        extras.append((head, extra if count else 0.0))
    recomputing = max((extra if head else extra - head_held for head, extra in extras), default=0.0)
    return total + max(0.0, recomputing)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank. ``peak`` = params + grads + optimizer + accumulated_grads + activations + transient."""

    params: float
    """Sharded parameters (fp32; under mixed precision this shard is the master copy)."""
    grads: float
    optimizer: float
    """AdamW exp_avg and exp_avg_sq, fp32."""
    activations: float
    """Saved activations of one micro-batch at the start of backward, chosen checkpointing mode."""
    transient: float
    """Largest short-lived buffer: all-gathered FSDP units (current + prefetched) and the unit's unsharded
    gradient before its reduce-scatter; replicate: gradient buckets (+ bf16 weight copies); under pp: the stage's
    gathered units and unsharded gradients (FSDP), or the flat gradient copy pure replicate all-reduces."""
    activations_by_mode: dict[str, float]
    accumulated_grads: float = 0.0
    """Unsharded gradients FSDP keeps between micro-batches when gradient sync waits for the last one."""
    pp_rank: int = 0
    """With pipeline parallelism: the pp rank these numbers are for."""

    @property
    def state(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> float:
        return self.state + self.accumulated_grads + self.activations + self.transient

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "state": self.state, "peak": self.peak}


def estimate_memory(
    model: ModelSpec, train: TrainingSpec, mesh: MeshShape, pp_rank: int | None = None
) -> MemoryEstimate:
    """Per-rank memory of ``model`` trained with ``train`` on ``mesh``. With pp: of ``pp_rank``, or (None) of
    the pp rank with the highest peak."""
    if mesh.pp > 1 and pp_rank is None:
        ranks = [estimate_memory(model, train, mesh, r) for r in range(mesh.pp)]
        return max(ranks, key=lambda e: e.peak)
    precision = train.bytes
    share = rank_shares(model, mesh)[pp_rank or 0]
    params = params_per_rank(model, mesh, share)
    unsharded = gathered_params(model, mesh, share) if share.moe_blocks else params * mesh.fsdp
    if mesh.pp > 1 and mesh.fsdp > 1:
        # Under pp the schedule keeps every unit gathered (reshard_after_forward=False) and its gradients
        # unsharded from the first micro-batch's backward to the last (docs/planning.md, "FSDP x pp").
        transient = unsharded * (precision.compute + precision.reduce)
    elif mesh.fsdp > 1:
        largest = largest_unit(model, mesh)
        if train.reshard_after_forward:
            gathered = 2 * largest * precision.compute  # the unit in use + the prefetched next one
        else:
            gathered = unsharded * precision.compute  # every unit stays gathered forward -> backward
        transient = gathered + largest * precision.reduce  # unsharded gradient before reduce-scatter
    else:
        tp_local = params
        weight_copy = tp_local * precision.compute if precision.compute != precision.param else 0.0
        if mesh.pp > 1:
            weight_copy = 0.0  # saved per micro-batch in flight: counted in the activations (autocast_weight_bytes)
        if mesh.pp > 1 and mesh.dp_replicate > 1:
            # After the schedule (activations freed) the runtime all-reduces one flat copy of every gradient
            # (ndparallel/parallel/pipeline/runtime.py, _average_replicas); the bucketed path is not used under pp.
            transient = max(weight_copy, params * precision.grad)
        else:
            transient = weight_copy + (2 * DDP_BUCKET_BYTES if mesh.dp_replicate > 1 else 0.0)
    if mesh.pp > 1:
        by_mode = {mode: saved_activation_bytes(model, train, mesh, pp_rank, mode) for mode in ACTIVATION_CHECKPOINTING}
    else:
        by_mode = {mode: activation_bytes(model, train, mesh, mode) for mode in ACTIVATION_CHECKPOINTING}
    deferred_sync = train.defer_grad_sync and train.accumulation_steps(mesh) > 1 and mesh.pp == 1
    accumulated = unsharded * precision.reduce if deferred_sync and mesh.fsdp > 1 else 0.0
    return MemoryEstimate(
        params=params * precision.param,
        grads=params * precision.grad,
        optimizer=params * precision.optimizer,
        activations=by_mode[train.activation_checkpointing],
        transient=transient,
        activations_by_mode=by_mode,
        accumulated_grads=accumulated,
        pp_rank=pp_rank or 0,
    )
