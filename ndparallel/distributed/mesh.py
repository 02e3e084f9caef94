"""The named device mesh: dims ``pp, dp_replicate, dp_shard, cp, tp`` (outer -> inner) and flattened views.

Views, each a 1-D mesh over the product of some dims, built inside one pp slice (on the mesh without
pp: a view never spans pipeline stages, so every planner sees the mesh it saw before pp existed):

=============  ==============================  ==========================================
view           dims                            used for
=============  ==============================  ==========================================
``dp``         dp_replicate x dp_shard         data loading: ranks with equal dp index get equal batches
``dp_shard_cp``  dp_shard x cp                 FSDP sharding (cp ranks also shard parameters)
``dp_cp``      dp_replicate x dp_shard x cp    loss and gradient-norm averaging
``ep``         inner ep_size of dp_shard x cp  expert parallel: all-to-all of routed tokens (ep_size > 1)
``ep_fsdp``    the rest of dp_shard x cp       the experts' own FSDP (ep_size > 1)
=============  ==============================  ==========================================

Expert parallelism borrows its ranks: ``dp_shard_cp`` is split into ``(ep_fsdp, ep)``, ep inner, so the ranks of
one ep group are neighbours in dp_shard x cp (with cp > 1, ep groups would take cp ranks first). With
dp_replicate > 1 the experts replicate over it too: ``Mesh.experts_fsdp`` is then the 2-D ``(ep_replicate,
ep_fsdp)`` mesh of their HSDP. With tp > 1 each ep group lives inside one tp index (the tp ranks see the same
routed tokens) and the expert weights are also split over tp: ``Mesh.experts_shard`` is the ``(ep, tp)`` mesh.

``mesh["pp"]`` is the 1-D pipeline mesh; ``mesh.without_pp()`` the same Mesh minus the pp dim (what each
stage is parallelised over). ``rank_groups(cfg)`` computes every group's global ranks without starting processes (what
``ndparallel mesh CONFIG`` prints); ``ndparallel.distributed.process.init_distributed(cfg)`` builds the real mesh.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh

from ndparallel.config.dims import MESH_DIMS
from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.errors import ConfigError

__all__ = ["EP_VIEWS", "INNER_DIMS", "VIEWS", "Mesh", "format_rank_table", "flatten", "rank_groups"]

INNER_DIMS: tuple[str, ...] = MESH_DIMS[1:]  # the dims of one pp slice, where every view lives

# Flattened views: name -> the mesh dims it joins, outer to inner.
VIEWS: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
EP_VIEWS: tuple[str, ...] = ("ep", "ep_fsdp")  # split out of dp_shard_cp when ep_size > 1 (inner: ep)


def _ep_sizes(cfg: ParallelismConfig) -> dict[str, int]:
    """``{"ep": ep_size, "ep_fsdp": dp_shard x cp / ep_size}``: the two views expert parallelism cuts."""
    return {"ep": cfg.ep_size, "ep_fsdp": cfg.dp_shard_size * cfg.cp_size // cfg.ep_size}


def rank_groups(cfg: ParallelismConfig) -> dict[str, list[list[int]]]:
    """For each dim and view, the lists of global ranks that form its process groups.

    ``cfg`` must be resolved (no -1). Ranks are laid out row-major over
    ``(pp, dp_replicate, dp_shard, cp, tp)``, exactly as the DeviceMesh is built.
    """
    sizes = cfg.sizes
    if -1 in sizes.values():
        raise ConfigError("rank_groups needs a resolved config: call cfg.resolve(world_size) first")
    grid = np.arange(math.prod(sizes.values())).reshape(tuple(sizes.values()))
    groups = {}
    for name, dims in [(d, (d,)) for d in MESH_DIMS] + list(VIEWS.items()):
        axes = [MESH_DIMS.index(d) for d in dims]
        rest = [a for a in range(grid.ndim) if a not in axes]
        group_size = math.prod(sizes[d] for d in dims)
        groups[name] = np.transpose(grid, rest + axes).reshape(-1, group_size).tolist()
    if cfg.ep_size > 1:
        ep = cfg.ep_size
        groups["ep"] = [g[i : i + ep] for g in groups["dp_shard_cp"] for i in range(0, len(g), ep)]
        groups["ep_fsdp"] = [g[j::ep] for g in groups["dp_shard_cp"] for j in range(ep)]
    return groups


def format_rank_table(cfg: ParallelismConfig) -> str:
    """A readable table of every rank's coordinate and every group's ranks."""
    sizes = cfg.sizes
    world = cfg.world_size
    lines = [f"mesh {cfg.describe()}  (world size {world}; dims outer -> inner: {', '.join(MESH_DIMS)})", ""]
    header = ["rank"] + list(MESH_DIMS)
    lines.append("  ".join(f"{h:>12}" for h in header))
    coords = np.stack(np.unravel_index(np.arange(world), tuple(sizes.values())), axis=1)
    for rank, coord in enumerate(coords):
        lines.append("  ".join(f"{v:>12}" for v in [rank, *coord.tolist()]))
    lines.append("")
    for name, groups in rank_groups(cfg).items():
        dims = VIEWS.get(name, (name,))
        label = name if len(dims) == 1 else f"{name} ({' x '.join(dims)})"
        if name in EP_VIEWS:
            label = f"{name} ({'inner' if name == 'ep' else 'outer'} part of dp_shard_cp)"
        size = len(groups[0])
        shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups)
        lines.append(f"{label:<40} size {size:<4} groups: {shown}")
    return "\n".join(lines)


def flatten(mesh: DeviceMesh, name: str) -> DeviceMesh:
    # Private torch API, isolated here: DeviceMesh has no public way to merge dims into one
    # named 1-D mesh whose process group spans them (torch 2.11-2.14 all keep `_flatten`).
    return mesh._flatten(name)


def _slice_with_flattened(root: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    # Deprecated torch behaviour, isolated here: slicing a flattened dim's name (``dp_shard_cp``) out
    # of the root mesh, next to a real dim, is the only way to get a 2-D mesh whose second dim is a
    # flattened view without new process groups. torch 2.11-2.13 allow it with a deprecation warning
    # (silenced for this call only); later versions may raise, and the caller then unflattens.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return root[names]


def _unflatten(mesh: DeviceMesh, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    # Private torch API, isolated here: DeviceMesh._unflatten splits a 1-D mesh into named dims;
    # no public call does. It creates new process groups, so every rank must call it together.
    return mesh._unflatten(0, sizes, names)


def _hsdp_mesh(root: DeviceMesh, views: dict[str, DeviceMesh], sizes: dict[str, int]) -> DeviceMesh:
    """The 2-D ``(dp_replicate, dp_shard_cp)`` mesh HSDP shards over when cp > 1."""
    names = ("dp_replicate", "dp_shard_cp")
    try:
        return _slice_with_flattened(root, names)
    except (KeyError, RuntimeError, ValueError):
        return _unflatten(views["dp_cp"], (sizes["dp_replicate"], sizes["dp_shard"] * sizes["cp"]), names)


class Mesh:
    """A named 5-D DeviceMesh plus its flattened views. ``mesh["tp"]``, ``mesh["pp"]``, ``mesh["dp_shard_cp"]``,
    ``mesh["dp_shard", "tp"]`` return torch DeviceMeshes; ``mesh.size("cp")`` and
    ``mesh.coordinate`` give sizes and this rank's position. ``without_pp()``: the mesh of this rank's pp
    slice (4-D, config with ``pp_size=1``), which the planners receive."""

    def __init__(
        self,
        device_mesh: DeviceMesh,
        config: ParallelismConfig,
        views: dict[str, DeviceMesh],
        inner: Mesh | None = None,
    ):
        self.device_mesh = device_mesh
        self.config = config
        self._views = views
        self._inner = inner
        self.fsdp = self._build_fsdp_mesh()
        """The data-parallel mesh FSDP shards over: ``self["dp_shard_cp"]`` (1-D) when only sharding; a 2-D
        ``(dp_replicate, dp_shard_cp)`` mesh for HSDP; None when ``dp_shard x cp == 1`` (no FSDP: pure
        replicate, or no data parallelism). Built here, with the views, on every rank at once: HSDP with
        cp > 1 may need new process groups."""
        self.experts = self._build_expert_mesh()
        """ep_size > 1: the ``(ep_fsdp, ep)`` mesh split out of ``dp_shard_cp``, ``(ep_replicate, ep_fsdp, ep)``
        out of ``dp_cp`` when dp_replicate > 1, each with a trailing ``tp`` dim when tp_size > 1 (new process
        groups, built on every rank at once); None otherwise. ``mesh["ep"]`` and ``mesh["ep_fsdp"]`` are its dims."""

    def _build_expert_mesh(self) -> DeviceMesh | None:
        if self.config.ep_size == 1:
            return None
        sizes = _ep_sizes(self.config)
        hsdp = self.size("dp_replicate") > 1
        outer = (("ep_replicate",), (self.size("dp_replicate"),)) if hsdp else ((), ())
        names = (*outer[0], "ep_fsdp", "ep")
        shape = (*outer[1], sizes["ep_fsdp"], sizes["ep"])
        if self.size("tp") == 1:
            return _unflatten(self["dp_cp" if hsdp else "dp_shard_cp"], shape, names)
        # ep x tp: the experts are sharded over (ep, tp), so ep and tp must be dims of one mesh, which FSDP's
        # (ep_replicate,) ep_fsdp shares: split the flattened data dims x tp, tp inner as on the root mesh.
        dims = ("dp_replicate", "dp_shard", "cp", "tp") if hsdp else ("dp_shard", "cp", "tp")
        joined = flatten(self.device_mesh[dims], "_".join(d.removeprefix("dp_") for d in dims) + "_experts")
        return _unflatten(joined, (*shape, self.size("tp")), (*names, "tp"))

    @property
    def experts_shard(self) -> DeviceMesh | None:
        """The mesh the expert weights are sharded over: ``ep`` (dim 0: the expert), then ``tp`` (their hidden
        width) when tp_size > 1; the plain ``tp`` mesh when only tp splits them; None when neither does."""
        if self.experts is not None:
            return self.experts["ep", "tp"] if self.size("tp") > 1 else self.experts["ep"]
        return self["tp"] if self.size("tp") > 1 else None

    @property
    def experts_fsdp(self) -> DeviceMesh | None:
        """The mesh the experts' FSDP shards over (ep_size > 1): ``mesh["ep_fsdp"]``, or the 2-D
        ``(ep_replicate, ep_fsdp)`` HSDP mesh when dp_replicate > 1; None when ep_size is 1."""
        if self.experts is None:
            return None
        if self.size("dp_replicate") == 1:
            return self.experts["ep_fsdp"]
        return self.experts["ep_replicate", "ep_fsdp"]

    def _build_fsdp_mesh(self) -> DeviceMesh | None:
        if self.size("dp_shard_cp") == 1:
            return None
        if self.size("dp_replicate") == 1:
            return self["dp_shard_cp"]
        if self.size("cp") == 1:
            return self["dp_replicate", "dp_shard"]  # public slicing: no flattened dim involved
        return _hsdp_mesh(self.device_mesh, self._views, self.config.sizes)

    def without_pp(self) -> Mesh:
        """This rank's pp slice as a Mesh of its own (the same object when ``pp_size`` is 1)."""
        return self if self._inner is None else self._inner

    @property
    def device_type(self) -> str:
        return self.device_mesh.device_type

    @property
    def device(self) -> torch.device:
        """This rank's device: its current CUDA device on a cuda mesh, else the CPU (the one place that says so)."""
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_type)

    def __getitem__(self, names: str | Sequence[str]) -> DeviceMesh:
        if isinstance(names, str):
            if names in EP_VIEWS:
                if self.experts is None:
                    raise KeyError(f"this mesh has no {names!r} view: ep_size is 1")
                return self.experts[names]
            if names in self._views:
                return self._views[names]
            names = (names,)
        names = tuple(names)
        if "pp" in names and "pp" not in (self.device_mesh.mesh_dim_names or ()):
            raise KeyError("this mesh has no pp dim: it is one pp slice (Mesh.without_pp()); ask the whole mesh")
        unknown = [n for n in names if n not in MESH_DIMS]
        if unknown:
            raise KeyError(f"unknown mesh dim(s) {unknown}; dims are {list(MESH_DIMS)}, views {list(VIEWS)}")
        return self.device_mesh[names]

    def size(self, name: str | None = None) -> int:
        """Size of one dim or view; the world size when ``name`` is None."""
        if name is None:
            return self.device_mesh.size()
        if name in EP_VIEWS:  # ep 1: no expert split, the experts shard over all of dp_shard x cp
            if self.config.ep_size == 1:
                return 1 if name == "ep" else self.size("dp_shard_cp")
            return _ep_sizes(self.config)[name]
        dims = VIEWS.get(name, (name,))
        return math.prod(self.config.sizes[d] for d in dims)

    def local_rank(self, name: str) -> int:
        """This rank's index inside its group of dim or view ``name`` (0 along a dim of size 1)."""
        if self.size(name) == 1:
            return 0
        return self[name].get_local_rank()

    @property
    def coordinate(self) -> dict[str, int]:
        """This rank's index along every dim and view."""
        ep = EP_VIEWS if self.config.ep_size > 1 else ()
        return {name: self.local_rank(name) for name in (*MESH_DIMS, *VIEWS, *ep)}

    def rank_table(self) -> str:
        return format_rank_table(self.config)

    def __repr__(self) -> str:
        return f"Mesh({self.config.describe()}, device_type={self.device_type!r})"
