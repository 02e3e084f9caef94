"""Present bench results: a terminal table, a JSON file, and PNG plots when matplotlib is installed."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ndparallel.bench.result import CaseResult
from ndparallel.distributed.peak import Peak

__all__ = [
    "SCHEMA",
    "bus_factor",
    "format_comm_table",
    "format_experts_table",
    "format_table",
    "machine_info",
    "plot",
    "read_json",
    "write_json",
]

SCHEMA = "ndparallel-bench/1"
_KIND = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "send_recv": "P2P", "broadcast": "BC"}


def _mib(n: float) -> str:
    return "-" if n is None or n < 0 else f"{n / 2**20:.2f}"


def _rate(n: float) -> str:
    return f"{n / 1e3:.1f}k" if n >= 1e3 else f"{n:.0f}"


def _table(header: Sequence[str], rows: list[Sequence[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        padded = [
            str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(padded)

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _pipeline_cell(r: CaseResult) -> str:
    p = r.pipeline
    if not p:
        return "-"
    per_rank = f" v{p['stages_per_rank']}" if p["stages_per_rank"] > 1 else ""
    return f"pp{p['pp']} {p['schedule']} m{p['microbatches']}{per_rank} bubble {100 * p['bubble']:.0f}%"


def format_table(results: Sequence[CaseResult]) -> str:
    """One row per case: time, throughput, MFU, memory, communication volume and exposed comm; pp cases also
    name their schedule, micro-batches and the cost model's bubble (docs/planning.md). A case that could not be
    measured says why instead of showing numbers."""
    header = ["case", "ranks", "pipeline (schedule, m, predicted bubble)", "step ms (min-max)", "tok/s",
              "tok/s/rank", "MFU %", "peak MiB/rank", "state MiB/rank", "comm MiB/step", "exposed comm ms"]  # fmt: skip
    rows = []
    for r in results:
        name = f"{r.case['sweep']}/{r.case['label']}"
        if r.error:
            rows.append([name, str(r.world_size), _pipeline_cell(r), f"not measured: {r.error}", *["-"] * 7])
            continue
        exposed = "-" if r.exposed_comm_s is None else f"{r.exposed_comm_s * 1e3:.0f}"
        if r.exposed_comm_s is not None and r.step_min_s > 0 and r.world_size > 1:
            exposed += f" ({100 * r.exposed_comm_s / r.step_min_s:.0f}%)"
        rows.append([
            name,
            str(r.world_size),
            _pipeline_cell(r),
            f"{r.step_median_s * 1e3:.0f} ({r.step_min_s * 1e3:.0f}-{r.step_max_s * 1e3:.0f})",
            _rate(r.tokens_per_s),
            _rate(r.tokens_per_s_per_rank),
            "-" if math.isnan(r.mfu) else f"{100 * r.mfu:.1f}",
            _mib(r.peak_memory_bytes),
            _mib(r.param_bytes * 2 + r.optimizer_bytes),
            _mib(r.comm_bytes),
            exposed,
        ])  # fmt: skip
    return _table(header, rows)


def bus_factor(kind: str, group_size: int) -> float:
    """Bytes a rank sends per payload byte with ring algorithms: (n-1)/n, 2(n-1)/n for all-reduce, 1 for P2P; an
    all-to-all's (n-1)/n assumes balanced routing."""
    n = group_size
    if n <= 0:
        return float("nan")
    # all-to-all: a rank keeps 1/n of what it sends (the rows routed to its own experts, when balanced)
    ring = {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_to_all": (n - 1) / n}
    return {**ring, "all_reduce": 2 * (n - 1) / n}.get(kind, 1.0)


def format_comm_table(results: Sequence[CaseResult]) -> str:
    """Per case, per mesh dims and collective kind: calls and payload MiB in one step (rank 0)."""
    header = ["case", "mesh dims", "collective", "calls", "payload MiB", "per-rank bus MiB"]
    rows = []
    for r in results:
        for row in r.comm:
            factor = bus_factor(row["kind"], row.get("group_size", 0))
            rows.append([f"{r.case['sweep']}/{r.case['label']}", row["dims"], row["kind"], str(row["calls"]),
                         _mib(row["bytes"]), _mib(row["bytes"] * factor)])  # fmt: skip
    return _table(header, rows) if rows else "(no collectives)"


def format_experts_table(results: Sequence[CaseResult]) -> str:
    """MoE cases: the router's health and the ep all-to-all volume of one step against the routing's minimum
    (empty when no case is an MoE)."""
    header = ["case", "ep", "experts max/mean", "dropped", "all-to-all MiB", "routing minimum MiB", "x minimum"]
    rows = []
    for r in results:
        if not r.experts:
            continue
        sent = sum(row["bytes"] for row in r.comm if row["kind"] == "all_to_all")
        least = r.experts.get("all_to_all_min_bytes", 0)
        ep = str(r.case["parallelism"].get("ep_size", 1))
        ratio = f"{sent / least:.4f}" if least else "-"
        rows.append([f"{r.case['sweep']}/{r.case['label']}", ep, f"{r.experts['imbalance']:.2f}",
                     str(r.experts["dropped"]), _mib(sent), _mib(least), ratio])  # fmt: skip
    return _table(header, rows) if rows else ""


def machine_info(peak: Peak) -> dict[str, Any]:
    """Where and with what the numbers were measured."""
    info = {
        "host_cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "peak_flops": peak.flops,
        "peak_source": peak.source,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_count"] = torch.cuda.device_count()
    return info


def write_json(
    path: str | os.PathLike,
    results: Sequence[CaseResult],
    peak: Peak,
    config: str | None = None,
    machine: dict[str, Any] | None = None,
) -> Path:
    """Write ``{schema, created, command, config, machine, results: [...]}``; returns the path.

    ``machine`` adds entries to the machine record (the CLI adds the load average at the start).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["ndparallel", *sys.argv[1:]]) if sys.argv and sys.argv[0].endswith("ndparallel") else
        " ".join(sys.argv),
        "config": config,
        "machine": {**machine_info(peak), **(machine or {})},
        "results": [r.to_dict() for r in results],
    }  # fmt: skip
    path.write_text(json.dumps(doc, indent=1, default=float) + "\n")
    return path


def read_json(path: str | os.PathLike) -> tuple[dict[str, Any], list[CaseResult]]:
    """The document and its results from a file ``write_json`` wrote (to re-render tables and plots)."""
    doc = json.loads(Path(path).read_text())
    if doc.get("schema") != SCHEMA:
        from ndparallel.errors import ConfigError

        raise ConfigError(f"{path}: not an ndparallel bench result (schema {doc.get('schema')!r}, expected {SCHEMA!r})")
    return doc, [CaseResult(**r) for r in doc["results"]]


def plot(results: Sequence[CaseResult], out_dir: str | os.PathLike) -> list[Path]:
    """``scaling.png`` (throughput vs ranks, step time split) and ``memory.png`` (memory and comm per rank).

    Returns the files written; ``[]`` when matplotlib is not installed (``pip install ndparallel[plot]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    results = [r for r in results if not r.error]  # unmeasured cases have no numbers to draw
    if not results:
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sweeps: dict[str, list[CaseResult]] = defaultdict(list)
    for r in results:
        sweeps[r.case["sweep"]].append(r)
    labels = [f"{r.case['sweep']}/{r.case['label']}" for r in results]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, rs in sweeps.items():
        points = ax1.scatter([r.world_size for r in rs], [r.tokens_per_s for r in rs], label=f"{name}: every shape")
        color = points.get_facecolor()[0]
        for r in rs:
            ax1.annotate(r.case["label"], (r.world_size, r.tokens_per_s), fontsize=6, xytext=(3, 2),
                         textcoords="offset points")  # fmt: skip
        best: dict[int, float] = {}
        for r in rs:
            best[r.world_size] = max(best.get(r.world_size, 0.0), r.tokens_per_s)
        worlds = sorted(best)
        ax1.plot(worlds, [best[w] for w in worlds], "-", color=color, label=f"{name}: best per rank count")
        ax1.plot(worlds, [best[worlds[0]] * w / worlds[0] for w in worlds], ":", color=color, label=f"{name}: linear")
    ax1.set(xlabel="ranks", ylabel="tokens / s (global)", title="throughput vs ranks", xscale="log", yscale="log")
    ax1.set_xticks(sorted({r.world_size for r in results}), [str(w) for w in sorted({r.world_size for r in results})])
    ax1.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax1.legend(fontsize=8)
    compute = [(r.twin_step_min_s if r.twin_step_min_s is not None else r.step_min_s) * 1e3 for r in results]
    exposed = [max(0.0, r.exposed_comm_s or 0.0) * 1e3 for r in results]
    x = range(len(results))
    ax2.bar(x, compute, label="compute-only twin")
    ax2.bar(x, exposed, bottom=compute, label="exposed communication")
    ax2.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=7)
    ax2.set(ylabel="ms / step (fastest step)", title="step time: compute-only twin + exposed comm")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    scaling = out / "scaling.png"
    fig.savefig(scaling, dpi=110)
    plt.close(fig)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    state = [(r.param_bytes * 2 + r.optimizer_bytes) / 2**20 for r in results]
    peak = [max(0, r.peak_memory_bytes) / 2**20 for r in results]
    ax1.bar(x, peak, label="peak live (params+grads+optimizer+activations)")
    ax1.bar(x, state, width=0.5, label="params + grads + optimizer state")
    ax1.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=7)
    ax1.set(ylabel="MiB per rank", title="memory per rank by mesh shape")
    ax1.legend(fontsize=8)
    keys = sorted({(row["dims"], row["kind"]) for r in results for row in r.comm})
    bottom = [0.0] * len(results)
    colors = plt.get_cmap("tab20").colors
    for i, (dims, kind) in enumerate(keys):
        values = [sum(row["bytes"] * bus_factor(kind, row.get("group_size", 0)) for row in r.comm
                      if (row["dims"], row["kind"]) == (dims, kind)) / 2**20 for r in results]  # fmt: skip
        ax2.bar(x, values, bottom=bottom, color=colors[i % len(colors)], label=f"{dims} {_KIND.get(kind, kind)}")
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax2.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=7)
    ax2.set(ylabel="MiB sent per rank per step (ring)", title="communication per rank by mesh dim and collective")
    if keys:
        ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    memory = out / "memory.png"
    fig.savefig(memory, dpi=110)
    plt.close(fig)
    return [scaling, memory]
