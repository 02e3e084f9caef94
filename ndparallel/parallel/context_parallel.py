"""Context parallel: split the sequence over ``mesh["cp"]`` and swap attention for ring attention.

Two pieces, used together::

    model = apply_context_parallel(model, mesh, cfg)     # the family's attention -> RingAttention (once)
    positions = make_positions(tokens)                   # [seq] = 0..seq-1, sharded like the tokens
    with context_parallel(mesh, [tokens, labels, positions], seq_dims=[1, 1, 0]):
        loss = loss_fn(model(tokens, positions), labels)  # each rank sees seq / cp tokens
        loss.backward()

``context_parallel`` shards the buffers in place (head-tail order when ``cfg.cp_load_balance``) and
restores them on exit; a tensor listed twice is sharded once. The model must index its position
encodings by the rank's global positions (else every rank numbers its shard 0..seq/cp-1): a ``forward``
taking ``positions`` (the reference Transformer) called without them gets them filled inside
``context_parallel`` (a pre-hook ``apply_context_parallel`` installs), and raises a ConfigError outside it.
The loss is the mean over the rank's local tokens; FSDP over ``dp_shard_cp`` averages gradients over the
cp ranks, and averaging the loss over ``mesh["dp_cp"]`` gives the global loss.

``cfg.cp_backend="torch"`` hands both pieces to torch's experimental ``context_parallel`` (CUDA only).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.config.sequence import check_sequence_length
from ndparallel.distributed.documents import DocumentMask, shard_indices
from ndparallel.distributed.mesh import Mesh
from ndparallel.distributed.ring import ROTATE_METHODS, ring_attention
from ndparallel.errors import ConfigError
from ndparallel.parallel.fqn import fqn_matches
from ndparallel.parallel.protocol import family_for

__all__ = [
    "MASKS",
    "RingAttention",
    "apply_context_parallel",
    "apply_ring_attention",
    "context_parallel",
    "gather_sequence",
    "make_positions",
    "sequence_indices",
    "shard_sequence",
]

MASKS = ("causal", "none")


# ------------------------------------------------------------------------------------ sequence layout


def sequence_indices(seq_len: int, cp_size: int, cp_rank: int, load_balance: bool, device=None) -> torch.Tensor:
    """Global positions held by ``cp_rank``: chunks ``r`` and ``2*cp-1-r`` of ``2*cp`` (head-tail), else block ``r``."""
    check_sequence_length(seq_len, cp_size, 1, load_balance)
    return shard_indices(seq_len, cp_size, cp_rank, load_balance, device)


def shard_sequence(x: torch.Tensor, dim: int, cp_size: int, cp_rank: int, load_balance: bool) -> torch.Tensor:
    """This rank's shard of ``x`` along ``dim`` (a new tensor), in the layout ring attention expects."""
    idx = sequence_indices(x.shape[dim], cp_size, cp_rank, load_balance, device=x.device)
    return x.index_select(dim, idx)


def gather_sequence(x: torch.Tensor, dim: int, group: dist.ProcessGroup, load_balance: bool) -> torch.Tensor:
    """Inverse of ``shard_sequence`` across ``group`` (no autograd): the full tensor on every rank."""
    cp_size = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(cp_size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    stacked = torch.cat(parts, dim=dim)
    seq_len = stacked.shape[dim]
    order = torch.cat([sequence_indices(seq_len, cp_size, r, load_balance) for r in range(cp_size)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_len)
    return stacked.index_select(dim, inverse.to(x.device))


def make_positions(tokens: torch.Tensor, seq_dim: int = 1) -> torch.Tensor:
    """``torch.arange(seq)`` on the tokens' device: pass it to ``context_parallel`` with seq dim 0 and to
    ``model(tokens, positions)`` so each rank's rotary embedding uses its tokens' global positions."""
    return torch.arange(tokens.shape[seq_dim], device=tokens.device)


# ------------------------------------------------------------------------------------- mesh plumbing


def _cp_parts(mesh: Mesh | DeviceMesh, cfg: ParallelismConfig | None) -> tuple[DeviceMesh, ParallelismConfig]:
    """The 1-D cp DeviceMesh and the config (``mesh.config`` unless ``cfg`` is given)."""
    if isinstance(mesh, Mesh):
        return mesh["cp"], cfg or mesh.config
    if isinstance(mesh, DeviceMesh) and mesh.ndim == 1:
        return mesh, cfg or ParallelismConfig(cp_size=mesh.size())
    raise ConfigError("context parallel needs an ndparallel Mesh (from init_distributed) or a 1-D cp DeviceMesh")


def _check_torch_backend(device_type: str) -> None:
    if device_type != "cuda":
        raise ConfigError(
            f"cp_backend='torch' needs CUDA: torch's context_parallel has no sharding rule for the "
            f"{device_type} SDPA kernel. Use cp_backend='ndparallel' (ring attention, CPU and CUDA)"
        )


def _torch_context_parallel(cp_mesh: DeviceMesh, cfg: ParallelismConfig, buffers, seq_dims, no_restore):
    # torch's experimental CP keeps its rotate method and load-balance switch in a private module
    # (torch.distributed.tensor.experimental._attention, torch 2.11-2.14); set both here, once.
    # Untested in ndparallel's suite (no GPU there): keep this path small.
    from torch.distributed.tensor.experimental import _attention
    from torch.distributed.tensor.experimental import context_parallel as torch_cp

    _attention.set_rotate_method("alltoall" if cfg.cp_rotate_method == "ring" else "allgather")
    _attention._cp_options.enable_load_balance = cfg.cp_load_balance
    return torch_cp(cp_mesh, buffers=list(buffers), buffer_seq_dims=list(seq_dims), no_restore_buffers=set(no_restore))


# ----------------------------------------------------------------------------------- context manager


@dataclass
class _Sharding:
    """One open ``context_parallel`` block: how its buffers were cut (read by the positions hook)."""

    cp_mesh: DeviceMesh
    load_balance: bool
    seq_len: int


_ACTIVE: list[_Sharding] = []  # open context_parallel blocks, innermost last


@contextlib.contextmanager
def context_parallel(
    mesh: Mesh | DeviceMesh,
    buffers: Sequence[torch.Tensor],
    seq_dims: Sequence[int],
    no_restore: Iterable[torch.Tensor] = (),
) -> Iterator[None]:
    """Shard ``buffers`` (tokens, labels, positions, ...) in place along ``seq_dims`` over ``mesh["cp"]``.

    Inside the block each buffer holds this rank's ``seq / cp`` positions (head-tail chunks when
    ``cp_load_balance``); on exit every buffer not listed in ``no_restore`` gets its full contents back.
    A no-op when cp size is 1. Buffers must share one sequence length and not require grad.
    """
    cp_mesh, cfg = _cp_parts(mesh, None)
    buffers, seq_dims, no_restore = list(buffers), list(seq_dims), list(no_restore)
    if len(buffers) != len(seq_dims):
        raise ConfigError(f"context_parallel got {len(buffers)} buffers but {len(seq_dims)} seq_dims; give one each")
    if any(not any(b is x for x in buffers) for b in no_restore):
        raise ConfigError("context_parallel: every tensor in no_restore must also be in buffers")
    cp_size = cp_mesh.size()
    if cp_size == 1:
        yield
        return
    buffers, seq_dims = _distinct_buffers(buffers, seq_dims, refuse_overlap=cfg.cp_backend == "torch")
    lengths = set()
    for i, (buf, dim) in enumerate(zip(buffers, seq_dims, strict=True)):
        if not isinstance(buf, torch.Tensor) or not -buf.dim() <= dim < buf.dim():
            raise ConfigError(f"context_parallel: buffer {i} must be a tensor with a dim {dim} (its sequence dim)")
        if buf.requires_grad:
            raise ConfigError(f"context_parallel: buffer {i} requires grad; shard inputs, not parameters")
        lengths.add(buf.shape[dim])
        check_sequence_length(buf.shape[dim], cp_size, 1, cfg.cp_load_balance, what=f"buffer {i} sequence length")
    if len(lengths) > 1:
        raise ConfigError(f"context_parallel: buffers have different sequence lengths {sorted(lengths)}; align them")
    if cfg.cp_backend == "torch":
        _check_torch_backend(cp_mesh.device_type)
        with _torch_context_parallel(cp_mesh, cfg, buffers, seq_dims, no_restore):
            yield
        return
    rank = cp_mesh.get_local_rank()
    originals = []
    for buf, dim in zip(buffers, seq_dims, strict=True):
        originals.append(torch.empty(0, dtype=buf.dtype, device=buf.device).set_(buf))  # aliases the full data
        buf.set_(shard_sequence(buf, dim, cp_size, rank, cfg.cp_load_balance))
    _ACTIVE.append(_Sharding(cp_mesh, cfg.cp_load_balance, lengths.pop()))
    try:
        yield
    finally:
        _ACTIVE.pop()
        for buf, original in zip(buffers, originals, strict=True):
            if not any(buf is x for x in no_restore):
                buf.set_(original)


def _distinct_buffers(
    buffers: list[torch.Tensor], seq_dims: list[int], refuse_overlap: bool
) -> tuple[list[torch.Tensor], list[int]]:
    """Each tensor once (Accelerate's examples list one tensor as both ``labels`` and ``shift_labels``):
    sharding it twice would cut it to seq / cp**2. Distinct tensors whose memory overlaps are refused
    where sharding writes into their storage (``cp_backend="torch"`` resizes and copies in place, so one
    view's shard would overwrite the other's data); ndparallel's own backend re-points each tensor to a
    new shard and never writes the storage, so overlapping views (``data[:, :-1]``, ``data[:, 1:]``) are
    sharded exactly."""
    kept: list[torch.Tensor] = []
    dims: list[int] = []
    for i, (buf, dim) in enumerate(zip(buffers, seq_dims, strict=True)):
        if not isinstance(buf, torch.Tensor):
            raise ConfigError(f"context_parallel: buffer {i} must be a tensor, got {type(buf).__name__}")
        same = next((j for j, seen in enumerate(kept) if seen is buf), None)
        if same is None:
            kept.append(buf)
            dims.append(dim)
        elif dim % max(buf.dim(), 1) != dims[same] % max(buf.dim(), 1):
            raise ConfigError(
                f"context_parallel: buffer {i} is the same tensor as an earlier buffer but with seq dim {dim} "
                f"instead of {dims[same]}; list each tensor once"
            )
    if refuse_overlap:
        for i, a in enumerate(kept):
            for b in kept[i + 1 :]:
                if _overlap(a, b):
                    raise ConfigError(
                        "context_parallel: two buffers are different views of overlapping memory (e.g. data[:, :-1] "
                        "and data[:, 1:]); cp_backend='torch' shards in place and would overwrite one with the "
                        "other: pass .clone() copies, or the same tensor object"
                    )
    return kept, dims


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory ranges in one storage intersect (conservative for interleaved strides)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        start = t.storage_offset() * t.element_size()
        extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True))
        return start, start + (extent + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


# ------------------------------------------------------------------------------------ module swap


class RingAttention(nn.Module):
    """Drop-in for ``CoreAttention``: ``forward(q, k, v)`` on ``[batch, seq_local, heads, head_dim]``."""

    def __init__(self, cp_mesh: DeviceMesh, rotate: str = "ring", load_balance: bool = True, mask: str = "causal"):
        super().__init__()
        if mask not in MASKS:
            raise ConfigError(
                f"context parallel supports attention masks {list(MASKS)}, got mask={mask!r}: "
                "arbitrary (document, sliding-window, padding) masks are not implemented"
            )
        if rotate not in ROTATE_METHODS:
            raise ConfigError(f"cp_rotate_method={rotate!r} is not one of {list(ROTATE_METHODS)}")
        self.cp_mesh = cp_mesh
        self.rotate = rotate
        self.load_balance = load_balance
        self.causal = mask == "causal"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        documents: DocumentMask | None = None,
    ):
        """``documents``: the whole rows' mask (documents, padding), as the model's ``document_ids`` become it."""
        if attn_mask is not None:
            raise ConfigError(
                "RingAttention got an attn_mask tensor: an arbitrary mask is neither padding nor documents; "
                "pass document_ids to the model (docs/context-parallel.md#masks)"
            )
        return ring_attention(
            q, k, v, self.cp_mesh.get_group(), self.causal, self.rotate, self.load_balance, documents=documents
        )

    def extra_repr(self) -> str:
        mask = "causal" if self.causal else "none"
        return f"cp={self.cp_mesh.size()}, rotate={self.rotate}, load_balance={self.load_balance}, mask={mask}"


def _is_target(name: str, module: nn.Module, targets: Sequence[type | str]) -> bool:
    for target in targets:
        if isinstance(target, str) and fqn_matches(name, target):
            return True
        if isinstance(target, type) and isinstance(module, target):
            return True
    return False


def _target_names(targets: Sequence[type | str]) -> str:
    """How a refusal names the attention modules it looked for."""
    names = [t.__name__ if isinstance(t, type) else repr(t) for t in targets]
    return " nor ".join(names) if names else "attention module to replace (no targets)"


def apply_context_parallel(
    model: nn.Module,
    mesh: Mesh | DeviceMesh,
    cfg: ParallelismConfig | None = None,
    targets: Iterable[type | str] = (),
    mask: str = "causal",
    positions_arg: str = "positions",
) -> nn.Module:
    """Replace every module the model's family names in ``cp_attention`` (the reference ``CoreAttention``), and
    every one matching ``targets`` (classes, or FQN patterns such as ``"layers.*.attn.core"``: :mod:`.fqn`),
    with a ``RingAttention`` on ``mesh["cp"]``; returns ``model``.

    Targets must take ``forward(q, k, v)`` on ``[batch, seq, heads, head_dim]``. The outermost module
    whose ``forward`` takes ``positions_arg`` gets it filled with the rank's global positions when called
    without it inside :func:`context_parallel`. No-op when cp is 1, and with ``cp_backend="torch"``
    (torch's SDPA dispatch does the ring inside ``context_parallel``).
    """
    return apply_ring_attention(model, mesh, cfg, (*family_for(model).cp_attention, *targets), mask, positions_arg)


def apply_ring_attention(
    model: nn.Module,
    mesh: Mesh | DeviceMesh,
    cfg: ParallelismConfig | None,
    targets: Iterable[type | str],
    mask: str = "causal",
    positions_arg: str = "positions",
) -> nn.Module:
    """:func:`apply_context_parallel` with exactly ``targets`` (a family's default ``apply_attention``: its own)."""
    cp_mesh, cfg = _cp_parts(mesh, cfg)
    if cp_mesh.size() == 1:
        return model
    if cfg.cp_backend == "torch":
        _check_torch_backend(cp_mesh.device_type)
        return model
    all_targets = tuple(dict.fromkeys(targets))
    found: list[str] = []
    for name, mod in model.named_modules():  # the outermost match: nothing inside a swapped module
        if name and not any(name.startswith(f"{o}.") for o in found) and _is_target(name, mod, all_targets):
            found.append(name)
    if not found:
        raise ConfigError(
            f"cp_size={cp_mesh.size()} but the model has no {_target_names(all_targets)}: "
            "pass targets=[YourAttentionClass or 'fqn.pattern'] to apply_context_parallel (through "
            "ndparallel.parallelize: a ModelFamily whose cp_attention names it, docs/parallelize.md#model-families)"
        )
    for name in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, RingAttention(cp_mesh, cfg.cp_rotate_method, cfg.cp_load_balance, mask))
    _hook_positions(model, cp_mesh, positions_arg)
    _hook_positions(model, cp_mesh, DOCUMENT_IDS_ARG)
    return model


# ------------------------------------------------------------------------------------- positions


DOCUMENT_IDS_ARG = "document_ids"


def _hook_positions(model: nn.Module, cp_mesh: DeviceMesh, arg: str) -> None:
    """A forward pre-hook on each outermost module whose ``forward`` takes ``arg`` (``positions``) and holds ring
    attention (the reference Transformer itself): a call without positions gets this rank's global ones.
    ``arg="document_ids"``: the rank's shard of document ids becomes the whole rows' mask (:func:`_documents_hook`).
    """
    hooked: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{outer}.") or outer == "" for outer in hooked):
            continue
        index = _positions_index(module, arg)
        if index is not None and any(isinstance(m, RingAttention) for m in module.modules()):
            make = _documents_hook if arg == DOCUMENT_IDS_ARG else _positions_hook
            module.register_forward_pre_hook(make(cp_mesh, index, arg), with_kwargs=True)
            hooked.append(name)


def _positions_index(module: nn.Module, arg: str) -> int | None:
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return None
    return names.index(arg) if arg in names else None


def _positions_hook(cp_mesh: DeviceMesh, index: int, arg: str):
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        positional = len(args) > index
        positions = args[index] if positional else kwargs.get(arg)
        sharding = next((s for s in reversed(_ACTIVE) if s.cp_mesh == cp_mesh), None)
        cp = cp_mesh.size()
        if sharding is None:
            if positions is None:
                raise ConfigError(
                    f"{type(module).__name__} under cp_size={cp} was called without {arg} outside "
                    "ndparallel.context_parallel: every rank would number its tokens from 0. Call it inside "
                    "context_parallel (positions are then filled in), or pass each rank's global positions"
                )
            return None
        local = sharding.seq_len // cp
        if positions is not None:
            if positions.shape[-1] != local:
                raise ConfigError(
                    f"{arg} has {positions.shape[-1]} entries but each rank holds {local} of the "
                    f"{sharding.seq_len} tokens (cp_size={cp}): pass {arg} as a context_parallel buffer "
                    "(seq dim 0 for [seq], 1 for [batch, seq]) so they are sharded with the tokens, or omit them"
                )
            return None
        device = next((t.device for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
        positions = sequence_indices(sharding.seq_len, cp, cp_mesh.get_local_rank(), sharding.load_balance, device)
        if positional:
            return (*args[:index], positions, *args[index + 1 :]), kwargs
        return args, {**kwargs, arg: positions}

    return hook


def _documents_hook(cp_mesh: DeviceMesh, index: int, arg: str):
    """``document_ids`` given to the model inside ``context_parallel`` (the rank's shard, or the whole rows)
    become one :class:`DocumentMask` of the whole rows, gathered over cp once per forward (not per layer)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        positional = len(args) > index
        ids = args[index] if positional else kwargs.get(arg)
        if ids is None or isinstance(ids, DocumentMask):
            return None
        sharding = next((s for s in reversed(_ACTIVE) if s.cp_mesh == cp_mesh), None)
        cp, length = cp_mesh.size(), ids.shape[-1]
        if sharding is None or length not in (sharding.seq_len, sharding.seq_len // cp) or ids.dim() != 2:
            where = f"inside context_parallel each rank holds {sharding.seq_len // cp}" if sharding else "outside"
            raise ConfigError(
                f"{arg} of shape {list(ids.shape)} under cp_size={cp} ({where} of the tokens): pass [batch, seq] "
                f"{arg} as a context_parallel buffer (seq dim 1), sharded with the tokens, and call the model inside it"
            )
        if length != sharding.seq_len:
            ids = gather_sequence(ids.contiguous(), 1, cp_mesh.get_group(), sharding.load_balance)
        mask = DocumentMask.from_document_ids(ids)
        if positional:
            return (*args[:index], mask, *args[index + 1 :]), kwargs
        return args, {**kwargs, arg: mask}

    return hook
