"""``ndparallel.verify.verify``: does a model train the same on every layout as in one process?"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence

from torch import nn

from ndparallel.errors import ConfigError
from ndparallel.verify.compare import (
    Row,
    VerifyTable,
    compare,
    describe_shrink,
    errors,
    float64_tolerance,
    tolerance_for,
)
from ndparallel.verify.layouts import Layout, parse_layouts, parse_reshards
from ndparallel.verify.localize import first_nondeterministic, localize
from ndparallel.verify.model import ModelSpec, check_fits_in_memory, model_spec
from ndparallel.verify.run import Settings, Trace, reference, resume_step, run_layouts, run_resumes

__all__ = ["reshard_divergence", "verify"]


def verify(
    model: str | Callable[[], nn.Module],
    layouts: str | Sequence[str | Layout] = "auto",
    *,
    dtype: str = "float64",
    tp_plan: str | None = None,
    steps: int = 3,
    seq: int = 16,
    batch: int = 4,
    cpu_ranks: int = 4,
    localize_failures: bool = False,
    shrink: bool = False,
    reshard: str | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> VerifyTable:
    """Train ``model`` (a preset, an HF config.json / folder, ``module:factory`` or a module-level factory) for
    ``steps`` AdamW steps (clipping at 1.0) in one process and on each layout (gloo ranks, at most
    ``cpu_ranks``), from the same seed on the same global batches; the table of differences and verdicts.
    ``shrink``: a preset or HF config at its architecture's tiny sizes (2 layers, a small width), said in the
    progress, the table and the JSON (``VerifyTable.shrunk``). ``reshard``: ``"A>B;..."`` layout pairs, each
    trained on A, saved after ``steps // 2`` steps (DCP), loaded on B and trained on: a row ``A>B`` each.

    Raises :class:`~ndparallel.errors.ConfigError` for bad input and for a model that is not deterministic.
    """
    spec = model_spec(model, dtype, tp_plan, shrink=shrink)
    chosen = _layouts(layouts, cpu_ranks, experts=layouts == "auto" and _has_experts(spec))
    settings = Settings(steps=steps, seq=seq, batch=batch)
    _check_settings(settings)
    pairs = parse_reshards(reshard, cpu_ranks) if reshard is not None else []
    if pairs and steps < 2:
        raise ConfigError(f"--reshard with --steps {steps}: it saves after steps // 2 and resumes; use --steps >= 2")
    chosen += [a for a in dict.fromkeys(a for a, _ in pairs) if a not in chosen]  # A trains, and saves
    check_fits_in_memory(spec, max(layout.ranks for layout in [*chosen, *(b for _, b in pairs)]))
    shrunk = spec.shrunk()
    progress(f"verify: {spec.name} in {dtype}, {steps} steps, batch {batch} x {seq} tokens")
    if shrink:
        progress(f"verify: --shrink: the same architecture at tiny sizes: {describe_shrink(shrunk)}")
    _check_deterministic(spec, settings)
    progress("verify: reference (one process)")
    ref = reference(spec, settings)
    notes, f64 = [], None
    aux = _auxiliary_loss_probe(spec, settings)
    if dtype == "float64":
        f64 = _with_fp32_aux(_float64_tolerance(spec, settings, ref, notes, progress, aux is not None), aux, notes)
    refused = _refused_for_aux_losses(chosen, aux)
    with tempfile.TemporaryDirectory(prefix="ndp-verify-") as tmp:
        saves = {a: os.path.join(tmp, f"ckpt-{i}") for i, a in enumerate(dict.fromkeys(a for a, _ in pairs))}
        runnable = [layout for layout in chosen if layout not in refused]
        traces = {**run_layouts(spec, runnable, settings, progress, saves), **refused}
        ready = [(a, b, saves[a]) for a, b in pairs if not (traces[a].refused or traces[a].error)]
        resumed = run_resumes(spec, ready, settings, progress) if ready else {}
    rows, localized = [], {}

    def localized_on(layout: Layout) -> dict:  # each layout localised once, at its own bound; A>B rows reuse it
        if layout not in localized:
            tol = tolerance_for(dtype, layout, f64).grad or 1e-6
            localized[layout] = _localize(spec, layout, settings, tol, progress)
        return localized[layout]

    for layout in chosen:
        row = compare(layout, traces[layout], ref, tolerance_for(dtype, layout, f64))
        progress(f"verify: {layout.name}: {row.verdict}{f' ({row.message})' if row.message else ''}")
        if row.verdict == "FAIL" and localize_failures:
            row.localized = localized_on(layout)
        rows.append(row)
    for a, b in pairs:
        row = _reshard_row(a, b, traces[a], resumed.get((a, b)), ref, settings, tolerance_for(dtype, b, f64))
        progress(f"verify: {row.layout}: {row.verdict}{f' ({row.message})' if row.message else ''}")
        if row.verdict == "FAIL" and localize_failures:
            row.localized = reshard_divergence(a, localized_on(a), b, localized_on(b))
        rows.append(row)
    return VerifyTable(
        spec.name, dtype, steps, rows, notes, {k: list(v) for k, v in shrunk.items()} if shrink else None
    )


def _reshard_row(a: Layout, b: Layout, saved: Trace, resumed: Trace | None, ref: Trace, settings, tol) -> Row:
    """The ``A>B`` row: A's first steps then B's after the checkpoint, against the uninterrupted reference."""
    name = f"{a.name}>{b.name}"
    if resumed is None:  # A was refused or failed: nothing was saved
        verdict = "refused" if saved.refused else "error"
        return Row(name, b.ranks, verdict, message=f"not run: {a.name} {verdict}: {saved.refused or saved.error}")
    k = resume_step(settings)
    if not (resumed.refused or resumed.error):
        losses, norms = saved.losses[:k] + resumed.losses, saved.grad_norms[:k] + resumed.grad_norms
        resumed = Trace(losses, norms, saved.grads, resumed.params)  # step-1 gradients: A's
    row = compare(b, resumed, ref, tol)
    row.layout = name
    return row


def reshard_divergence(a: Layout, on_a: dict, b: Layout, on_b: dict) -> dict:
    """``--localize`` on a failing ``A>B`` row: the first divergence of step 1 on A, else on B; when both match
    one process the difference entered between them, at the save on A or the load on B. A layout that could
    not be localised (pipeline) proves nothing, so then the checkpoint is not blamed."""
    for layout, found in ((a, on_a), (b, on_b)):
        if found.get("module") is not None:
            return {**found, "layout": layout.name, "summary": f"on {layout.name}: {found['summary']}"}
    unproved = [f"{layout.name}: {found['summary']}" for layout, found in ((a, on_a), (b, on_b)) if "error" in found]
    if unproved:
        return {"module": None, "layout": f"{a.name}>{b.name}", "summary": "; ".join(unproved)}
    summary = (
        f"{a.name} and {b.name} each match one process in step 1 ({on_a['summary']}; {on_b['summary']}): the "
        f"difference enters at the checkpoint, saved on {a.name} or loaded on {b.name} (model, AdamW state or "
        "the step count)"
    )
    return {"module": None, "layout": f"{a.name}>{b.name}", "summary": summary}


def _has_experts(spec: ModelSpec) -> bool:
    """Whether the model has mixture-of-experts modules its family can spread over ep (``auto`` then adds ep)."""
    from ndparallel.parallel.protocol import family_for

    model = spec.build()
    return bool(family_for(model).moe_layers(model))


def _layouts(layouts: str | Sequence[str | Layout], cpu_ranks: int, experts: bool = False) -> list[Layout]:
    if isinstance(layouts, str):
        return parse_layouts(layouts, cpu_ranks, experts)
    text = ";".join(layout.name if isinstance(layout, Layout) else layout for layout in layouts)
    return parse_layouts(text, cpu_ranks)


def _check_settings(settings: Settings) -> None:
    for name in ("steps", "seq", "batch"):
        value = getattr(settings, name)
        if value < 1:
            raise ConfigError(f"--{name} {value}: must be at least 1")


def _check_deterministic(spec: ModelSpec, settings: Settings) -> None:
    """The reference's forward twice under two RNG states: a module whose output changes (dropout left on)
    makes every comparison meaningless, so it is refused, by name."""
    module = first_nondeterministic(spec, settings)
    if module is not None:
        raise ConfigError(
            f"{spec.name} is not deterministic: {module} gives a different output for the same input and weights "
            "under another RNG state (dropout left on?): set its dropout p=0 (or drop the random op) and rerun"
        )


def _refused_for_aux_losses(layouts: Sequence[Layout], aux) -> dict[Layout, Trace]:
    """pp layouts of a model with auxiliary losses (an MoE's): its balancing loss uses each micro-batch's token
    fractions, and a pipeline's micro-batches are not the reference's one batch, so the comparison would fail
    for a reason that is not a bug. Refused by name (the suite proves MoE under pp against a reference with the
    same micro-batches: docs/expert-parallel.md)."""
    pipelined = [layout for layout in layouts if layout.size("pp") > 1]
    if not pipelined or aux is None:
        return {}
    why = (
        "an MoE's balancing loss uses each micro-batch's token fractions, and a pipeline's micro-batches are not "
        "the reference's one batch; MoE under pp is proved against the same micro-batches in ndparallel's suite "
        "(docs/expert-parallel.md#under-pipeline-parallel-pp)"
    )
    return {layout: Trace(refused=why) for layout in pipelined}


def _auxiliary_loss_probe(spec: ModelSpec, settings: Settings):
    """The model's auxiliary loss on the first batch (None for a model without one), and the dtype of its
    logits: what the tolerance and the pp refusal need to know."""
    import torch

    from ndparallel.verify.model import vocab_size
    from ndparallel.verify.run import make_batches

    model = spec.build()
    tokens, _ = make_batches(settings, vocab_size(model))[0]
    with torch.no_grad():
        logits, aux = spec.forward(model, tokens, torch.arange(tokens.shape[1]))
    return None if aux is None else (aux.detach(), logits.dtype)


def _with_fp32_aux(tol, aux, notes: list[str]):
    """transformers sums an MoE's balancing loss in fp32 even in a float64 model: under cp the rows reach that
    sum in another order, so its value (not its gradient) moves by fp32 ulps. The loss bound gains 8 of them."""
    import dataclasses

    import torch

    if aux is None or aux[0].dtype != torch.float32 or aux[1] != torch.float64:
        return tol
    allowance = 8 * torch.finfo(torch.float32).eps * abs(float(aux[0]))
    notes.append(f"loss bound + {allowance:.1e}: the model's aux loss sums in fp32 inside (8 fp32 ulps of it)")
    return dataclasses.replace(tol, loss=tol.loss + allowance)


def _float64_tolerance(spec: ModelSpec, settings: Settings, ref, notes: list[str], progress, routed: bool = False):
    """The model's own float64 floor: the reference again with the batch in two accumulated halves (``routed``:
    the model has auxiliary losses, :func:`~ndparallel.verify.compare.float64_tolerance`)."""
    if settings.batch % 2:
        notes.append("float64 floor not measured (odd --batch): tolerance 1e-10")
        return float64_tolerance(0.0)
    progress("verify: float64 floor (reference on two accumulated halves)")
    halves = reference(spec, Settings(**{**settings.__dict__, "accumulation": 2}))
    floor = max(errors(halves, ref).values())
    return float64_tolerance(floor, routed)


def _localize(spec: ModelSpec, layout: Layout, settings: Settings, tol: float, progress) -> dict:
    progress(f"verify: localizing {layout.name} (one step, every module hooked)")
    try:
        return localize(spec, layout, settings, tol)
    except ConfigError as err:
        return {"module": None, "error": str(err), "summary": f"not localized: {err}"}
