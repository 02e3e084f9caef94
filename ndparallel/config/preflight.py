"""The one job pre-flight: what a job's sizes, batch and model shape must satisfy before any rank starts.

``ndparallel train``, ``ndparallel bench`` and ``ndparallel plan`` all ask :func:`job_problems` with a
resolved :class:`~ndparallel.config.parallelism.ParallelismConfig`, a :class:`JobShape` and a
:class:`ModelShape`, so one shape is refused with one message wherever it is typed in (the bench puts its
case name in front). Field names are the training YAML's (``train.global_batch``, ``data.seq_len``);
model fields are named as the model's config names them. ``parallelize`` applies the tp rule again on the
real model (:func:`check_tp_fields`), and the sequence rule lives in :mod:`ndparallel.config.sequence`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ndparallel.config.dims import data_parallel_size, divisors
from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.config.pipeline import (
    check_defer_grad_sync,
    check_microbatches,
    check_pp_split,
    stages_per_rank,
    stages_problem,
)
from ndparallel.config.precision import forward_autocast_dtype
from ndparallel.config.sequence import sequence_problem
from ndparallel.errors import ConfigError

__all__ = [
    "JobShape",
    "ModelShape",
    "alltoall_heads_problem",
    "check_alltoall_heads",
    "check_job",
    "check_seq_fits",
    "check_tp_fields",
    "default_pipeline_microbatches",
    "ep_problem",
    "job_problems",
    "moe_problem",
    "split_batch",
    "tp_fields_problem",
]


@dataclass(frozen=True)
class ModelShape:
    """What the pre-flight needs of a model, in its config's own field names."""

    n_blocks: int
    tp_fields: Mapping[str, int] = field(default_factory=dict)  # fields tp must divide: heads, FFN width, vocab
    heads: tuple[str, int] | None = None  # the query heads' field and count (Ulysses splits them over cp)
    max_seq_len: int | None = None
    blocks_field: str = "model.n_layers"  # how a refusal names the block count
    experts: tuple[str, int] | None = None  # the routed experts' field and count (ep splits them); None: dense


@dataclass(frozen=True)
class JobShape:
    """The batch and sequence of one optimizer step, as ``ndparallel train``'s ``train:`` / ``data:`` give them."""

    global_batch: int
    seq_len: int
    micro_batch: int | None = None  # sequences per rank per forward; None: the whole per-rank batch
    defer_grad_sync: bool | None = None


def tp_fields_problem(sizes: Mapping[str, int], tp_size: int) -> str | None:
    """Why ``tp_size`` cannot split the model fields ``sizes`` (head counts, FFN width, vocabulary), or None."""
    for name, value in sizes.items():
        if tp_size > 1 and value % tp_size:
            return f"tp_size={tp_size} does not divide {name}={value}; choose a tp_size that divides it"
    return None


def check_tp_fields(sizes: Mapping[str, int], tp_size: int) -> None:
    """:func:`tp_fields_problem` as a :class:`ConfigError`."""
    problem = tp_fields_problem(sizes, tp_size)
    if problem:
        raise ConfigError(problem)


ROUTERS = ("softmax", "sigmoid")


def moe_problem(n_experts: int, top_k: int, n_shared: int, router: str, prefix: str = "model.") -> str | None:
    """Why a mixture-of-experts shape cannot route (top-k beyond the experts, an unknown router), or None.
    ``n_experts`` 0 is a dense model (the other fields are then ignored)."""
    for name, value in (("n_experts", n_experts), ("top_k", top_k), ("n_shared_experts", n_shared)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return f"{prefix}{name}={value!r} must be an integer >= 0"
    if n_experts == 0:
        return None
    if router not in ROUTERS:
        return f"{prefix}router={router!r} is not one of {list(ROUTERS)}"
    if not 1 <= top_k <= n_experts:
        return (
            f"{prefix}top_k={top_k} must be between 1 and {prefix}n_experts={n_experts}: each token picks top_k "
            "distinct experts; lower top_k or add experts"
        )
    return None


def ep_problem(ep_size: int, experts: tuple[str, int] | None, p: ParallelismConfig | None = None) -> str | None:
    """Why ``ep_size`` cannot split the routed experts (a dense model, or a count ep does not divide), or why the
    knobs of ``p`` are not proved on a mixture of experts yet (compile, activation checkpointing), or None.
    The rules on the mesh alone (ep fits dp_shard x cp) are :class:`ParallelismConfig`'s."""
    if p is not None and experts is not None and experts[1]:
        for knob in ("compile", "activation_checkpointing"):
            if getattr(p, knob) != "none":
                return (
                    f"{knob}={getattr(p, knob)!r} on a mixture-of-experts model ({experts[0]}={experts[1]}) is not "
                    f"proved against one process yet; use {knob}='none'"
                )
    if ep_size <= 1:
        return None
    if experts is None or experts[1] == 0:
        return (
            f"ep_size={ep_size} but the model is dense (no routed experts its family shards); use ep_size=1, or a "
            "mixture of experts (the reference model.preset: tiny-moe, or a Hugging Face MoE such as Mixtral)"
        )
    name, count = experts
    if count % ep_size:
        return (
            f"ep_size={ep_size} does not divide {name}={count}: every ep rank owns {name} / ep_size experts; "
            "choose an ep_size that divides it"
        )
    return None


def alltoall_heads_problem(heads: int, tp: int, cp: int, what: str = "n_heads") -> str | None:
    """Why Ulysses cannot split ``heads / tp`` query heads per tp rank over ``cp`` ranks, or None."""
    if cp <= 1 or (heads // tp) % cp == 0:
        return None
    per_rank = f"{what}={heads} / tp_size={tp} = {heads // tp}" if tp > 1 else f"{what}={heads}"
    return (
        f"cp_rotate_method='alltoall' (Ulysses) splits the attention heads over cp, but {per_rank} query heads "
        f"per tp rank do not divide by cp_size={cp}: choose a cp_size that divides {heads // tp}, or "
        "cp_rotate_method='ring' or 'allgather' (no rule on heads; Accelerate's cp_comm_strategy: alltoall also "
        "selects Ulysses here)"
    )


def check_alltoall_heads(heads: int, tp: int, cp: int, what: str = "n_heads") -> None:
    """:func:`alltoall_heads_problem` as a :class:`ConfigError`."""
    problem = alltoall_heads_problem(heads, tp, cp, what)
    if problem:
        raise ConfigError(problem)


def split_batch(global_batch: int, micro_batch: int | None, dp_size: int, prefix: str = "train.") -> int:
    """Micro-batches per optimizer step on each data-parallel rank: the one batch rule.

    ``global_batch`` sequences split over ``dp_size`` ranks, then into micro-batches of ``micro_batch``
    (None: the whole per-rank batch). A split that does not divide raises ConfigError naming
    ``{prefix}global_batch`` / ``{prefix}micro_batch``.
    """
    if global_batch % dp_size:
        raise ConfigError(
            f"{prefix}global_batch={global_batch} is not divisible by the data-parallel size {dp_size} "
            f"(dp_replicate x dp_shard); use a multiple of {dp_size}"
        )
    per_rank = global_batch // dp_size
    micro = micro_batch or per_rank
    if per_rank % micro:
        raise ConfigError(
            f"{prefix}micro_batch={micro} does not divide the per-rank batch {per_rank} "
            f"(global_batch {global_batch} / dp {dp_size}); pick a divisor of {per_rank}"
        )
    return per_rank // micro


def default_pipeline_microbatches(schedule: str, pp_size: int, per_rank: int, batch: int) -> int | None:
    """The pipeline's micro-batches when neither ``pp_microbatches`` nor ``train.micro_batch`` is set: the
    smallest count the schedule accepts (1F1B: one per stage at least) that divides the per-rank ``batch``;
    None when no divisor fits. The smallest, not torchtitan's one sample per micro-batch: every job that
    ran before (gpipe, m = 1) keeps its count, and micro-batches stay as large as the schedule allows."""
    for m in divisors(batch):
        try:
            check_microbatches(schedule, m, pp_size, per_rank, "pp_microbatches")
        except ConfigError:
            continue
        return m
    return None


def _pipeline_microbatches(p: ParallelismConfig, job: JobShape, model: ModelShape, accumulation: int) -> int:
    """Under pp the accumulation IS the pipeline's micro-batching: ``pp_microbatches`` if set (it must agree
    with ``train.micro_batch`` when both are set), else the accumulation steps of ``train.micro_batch``, else
    :func:`default_pipeline_microbatches`; checked against the schedule and the model's blocks."""
    per_rank = stages_per_rank(p.pp_schedule, p.pp_stages_per_rank)
    n_stages = p.pp_size * per_rank
    problem = stages_problem(p.pp_size, per_rank, model.n_blocks, model.blocks_field)
    if problem:
        raise ConfigError(problem)
    check_pp_split(p.pp_split, n_stages=n_stages, n_blocks=model.n_blocks)
    check_defer_grad_sync(job.defer_grad_sync, p)
    field_name = "pp_microbatches"
    per_rank_batch = job.global_batch // data_parallel_size(p)
    if p.pp_microbatches is None and job.micro_batch is None:
        chosen = default_pipeline_microbatches(p.pp_schedule, p.pp_size, per_rank, per_rank_batch)
        if chosen is None:
            raise ConfigError(
                f"no pipeline micro-batch count that pp_schedule={p.pp_schedule!r} accepts on {n_stages} stages "
                f"divides the per-rank batch {per_rank_batch} (train.global_batch / dp); raise train.global_batch "
                f"(e.g. to {n_stages * data_parallel_size(p)}) or set pp_microbatches"
            )
        return chosen
    if p.pp_microbatches is None:
        field_name = "the pipeline's micro-batches (pp_microbatches unset: train.global_batch / dp / train.micro_batch)"
    elif job.micro_batch is not None and p.pp_microbatches != accumulation:
        raise ConfigError(
            f"pp_microbatches={p.pp_microbatches} and train.micro_batch={job.micro_batch} ({accumulation} "
            "micro-batches per rank) disagree: under pp the accumulation is the pipeline's micro-batching; set one"
        )
    else:
        if per_rank_batch % p.pp_microbatches:
            raise ConfigError(
                f"pp_microbatches={p.pp_microbatches} does not divide the per-rank batch {per_rank_batch} "
                "(train.global_batch / dp): torch's pipeline needs equal micro-batches"
            )
        accumulation = p.pp_microbatches
    try:
        check_microbatches(p.pp_schedule, accumulation, p.pp_size, per_rank, field_name)
    except ConfigError as err:
        if p.pp_microbatches is not None:
            raise
        raise ConfigError(f"{err} (set pp_microbatches, or a smaller train.micro_batch)") from None
    return accumulation


def check_seq_fits(seq_len: int, max_seq_len: int | None) -> None:
    """Refuse a sequence longer than the model's position table."""
    if max_seq_len is not None and seq_len > max_seq_len:
        raise ConfigError(
            f"data.seq_len={seq_len} exceeds model.max_seq_len={max_seq_len}; "
            "raise model.max_seq_len or shorten data.seq_len"
        )


def _rules(p: ParallelismConfig, job: JobShape, model: ModelShape) -> list[Callable[[], object]]:
    """The rules, each a call that raises :class:`ConfigError`; the last returns the micro-batches per rank."""

    def raise_problem(problem: str | None) -> None:
        if problem:
            raise ConfigError(problem)

    def batch() -> int:
        accumulation = split_batch(job.global_batch, job.micro_batch, data_parallel_size(p))
        return _pipeline_microbatches(p, job, model, accumulation) if p.pp_size > 1 else accumulation

    heads = model.heads if p.cp_rotate_method == "alltoall" else None
    return [
        lambda: check_seq_fits(job.seq_len, model.max_seq_len),
        lambda: raise_problem(sequence_problem(job.seq_len, p.cp_size, p.tp_size, p.cp_load_balance, "data.seq_len")),
        lambda: raise_problem(tp_fields_problem(model.tp_fields, p.tp_size)),
        lambda: raise_problem(heads and alltoall_heads_problem(heads[1], p.tp_size, p.cp_size, what=heads[0])),
        lambda: raise_problem(ep_problem(p.ep_size, model.experts, p)),
        lambda: forward_autocast_dtype(p),  # refuses fp16 without FSDP
        batch,
    ]


def check_job(p: ParallelismConfig, job: JobShape, model: ModelShape) -> int:
    """Raise the job's first problem as a :class:`ConfigError`; else return the micro-batches each rank runs
    per optimizer step (under pp: the pipeline's micro-batches). ``p`` must be resolved (no ``-1``)."""
    *checks, batch = _rules(p, job, model)
    for check in checks:
        check()
    return batch()


def job_problems(p: ParallelismConfig, job: JobShape, model: ModelShape) -> list[str]:
    """Why the job cannot run: every broken rule's message, as :func:`check_job` raises them (empty: it can)."""
    problems = []
    for check in _rules(p, job, model):
        try:
            check()
        except ConfigError as err:
            problems.append(str(err))
    return problems
