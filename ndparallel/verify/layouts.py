"""The meshes ``ndparallel verify`` tries: parsed from ``--layouts``, generated (``auto``), or folded down
from a real job's sizes to the ranks a laptop has.

A :class:`Layout` is the mesh sizes that are not 1, e.g. ``{"dp_shard": 2, "tp": 2}``, named
``dp_shard=2,tp=2``. It becomes a :class:`~ndparallel.config.parallelism.ParallelismConfig` in the ranks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from ndparallel.errors import ConfigError

__all__ = ["DIMS", "Layout", "auto_layouts", "fold", "parse_layouts", "parse_reshards"]

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outer -> inner, as the mesh orders them
BORROWED = ("ep",)  # sizes that take their ranks from the dims above (ep from dp_shard x cp): not multiplied in
AUTO_SINGLES = ("dp_shard", "dp_replicate", "tp", "cp", "pp")
# Pairs worth a run each: the compositions users ship (FSDP x TP, HSDP, ring x TP, FSDP x ring, pp x FSDP).
AUTO_PAIRS = (("dp_shard", "tp"), ("dp_replicate", "dp_shard"), ("tp", "cp"), ("dp_shard", "cp"), ("pp", "dp_shard"))
# A mixture of experts also gets its experts spread: ep alone (over dp_shard), then with tp and with cp at 4 ranks.
AUTO_EXPERTS = ({"dp_shard": 2, "ep": 2},)
AUTO_EXPERT_PAIRS = ({"dp_shard": 2, "tp": 2, "ep": 2}, {"dp_shard": 2, "cp": 2, "ep": 2})


@dataclass(frozen=True)
class Layout:
    sizes: tuple[tuple[str, int], ...]  # (dim, size > 1), in DIMS order

    @classmethod
    def of(cls, sizes: Mapping[str, int]) -> Layout:
        for dim, size in sizes.items():
            if dim not in DIMS + BORROWED:
                raise ConfigError(f"layout dimension {dim!r} is unknown; use {', '.join(DIMS + BORROWED)}")
            if not isinstance(size, int) or size < 1:
                raise ConfigError(f"layout {dim}={size!r}: a size is a positive integer")
        return cls(tuple((d, sizes[d]) for d in DIMS + BORROWED if sizes.get(d, 1) > 1))

    @property
    def name(self) -> str:
        return ",".join(f"{d}={s}" for d, s in self.sizes) or "single"

    @property
    def ranks(self) -> int:
        return math.prod(s for d, s in self.sizes if d not in BORROWED)

    def size(self, dim: str) -> int:
        return dict(self.sizes).get(dim, 1)

    def parallelism(self, **extra) -> dict:
        """The ParallelismConfig fields of this layout (plus ``extra``, e.g. mixed_precision)."""
        return {**{f"{d}_size": s for d, s in self.sizes}, **extra}


def parse_layouts(text: str, cpu_ranks: int, experts: bool = False) -> list[Layout]:
    """``"dp_shard=2;tp=2;dp_shard=2,tp=2"`` (``auto``: :func:`auto_layouts`, with ep layouts when the model has
    ``experts``; ``from:job.yaml``: that job's mesh, :func:`fold`-ed); each must fit ``cpu_ranks``."""
    if text.strip() == "auto":
        return auto_layouts(cpu_ranks, experts)
    layouts = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        if item.startswith("from:"):
            layouts.append(_folded(item.removeprefix("from:"), cpu_ranks))
            continue
        sizes = {}
        for field in item.split(","):
            dim, eq, value = field.strip().partition("=")
            dim = dim.strip().removesuffix("_size")
            if not eq or not value.strip().isdigit():
                raise ConfigError(f"layout {item!r}: expected dim=size[,dim=size], e.g. dp_shard=2,tp=2")
            if dim in sizes:
                raise ConfigError(f"layout {item!r} gives {dim} twice: give each dimension once, e.g. dp_shard=2,tp=2")
            sizes[dim] = int(value)
        layout = Layout.of(sizes)
        if layout.size("ep") > 1 and layout.ranks < 2:
            raise ConfigError(
                f"layout {item!r}: ep borrows its ranks from dp_shard x cp, which this layout leaves at 1; give e.g. "
                f"dp_shard={layout.size('ep')},ep={layout.size('ep')}"
            )
        if layout.ranks < 2:
            raise ConfigError(f"layout {item!r} uses one rank: it is the reference itself; give a size > 1")
        if layout.ranks > cpu_ranks:
            raise ConfigError(
                f"layout {layout.name} needs {layout.ranks} ranks but --cpu-ranks is {cpu_ranks}: raise --cpu-ranks "
                f"or shrink the layout"
            )
        layouts.append(layout)
    if not layouts:
        raise ConfigError(f"--layouts {text!r} names no layout; e.g. --layouts 'dp_shard=2;tp=2' or auto")
    return list(dict.fromkeys(layouts))


def parse_reshards(text: str, cpu_ranks: int) -> list[tuple[Layout, Layout]]:
    """``--reshard "dp_shard=2>tp=2;tp=2>pp=2"``: (save on, load on) layout pairs, each side as in
    :func:`parse_layouts` (one layout)."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        sides = item.split(">")
        if len(sides) != 2 or not all(side.strip() for side in sides):
            raise ConfigError(f"--reshard {item!r}: expected A>B (save on layout A, load on B), e.g. dp_shard=2>tp=2")
        a, b = (parse_layouts(side, cpu_ranks) for side in sides)
        if len(a) != 1 or len(b) != 1:
            raise ConfigError(f"--reshard {item!r}: each side is one layout (dims joined by ','), e.g. dp_shard=2>tp=2")
        if a == b:
            raise ConfigError(f"--reshard {item!r}: the same layout on both sides reshards nothing")
        pairs.append((a[0], b[0]))
    if not pairs:
        raise ConfigError(f"--reshard {text!r} names no layout pair; e.g. dp_shard=2>tp=2")
    return pairs


def auto_layouts(cpu_ranks: int, experts: bool = False) -> list[Layout]:
    """Every dimension alone at size 2, then the pairs of :data:`AUTO_PAIRS` at 2 x 2 when 4 ranks fit; for a
    model with ``experts`` (a mixture of experts) also :data:`AUTO_EXPERTS`, and :data:`AUTO_EXPERT_PAIRS` at 4."""
    if cpu_ranks < 2:
        raise ConfigError(f"--cpu-ranks {cpu_ranks}: verify needs at least 2 ranks")
    layouts = [Layout.of({dim: 2}) for dim in AUTO_SINGLES]
    layouts += [Layout.of(sizes) for sizes in AUTO_EXPERTS if experts]
    if cpu_ranks >= 4:
        layouts += [Layout.of({a: 2, b: 2}) for a, b in AUTO_PAIRS]
        layouts += [Layout.of(sizes) for sizes in AUTO_EXPERT_PAIRS if experts]
    return layouts


def _folded(path: str, cpu_ranks: int) -> Layout:
    """``from:FILE.yaml``: the mesh sizes of a job's config (its ``parallelism:`` section), folded."""
    from ndparallel.config.parallelism import ParallelismConfig

    cfg = ParallelismConfig.from_yaml(path)
    return fold({**cfg.sizes, "ep": cfg.ep_size}, cpu_ranks)


def fold(sizes: Mapping[str, int], cpu_ranks: int) -> Layout:
    """A production mesh shrunk to a laptop: every dimension > 1 becomes 2 (the algorithm is the same at 2 as
    at 64), then the outermost dimensions are dropped until the product fits ``cpu_ranks``. An ``ep`` > 1 stays
    ep=2 when the folded dp_shard x cp can lend it 2 ranks (it adds none)."""
    dims = [d for d in DIMS if sizes.get(d, 1) > 1 or sizes.get(d, 1) == -1]
    for keep in range(len(dims), 0, -1):
        for chosen in itertools.combinations(reversed(dims), keep):  # inner dimensions first
            if 2 ** len(chosen) <= cpu_ranks:
                folded = dict.fromkeys(chosen, 2)
                if sizes.get("ep", 1) > 1 and ("dp_shard" in folded or "cp" in folded):
                    folded["ep"] = 2
                return Layout.of(folded)
    raise ConfigError(f"--cpu-ranks {cpu_ranks}: folding {dict(sizes)} needs at least 2 ranks")
