"""Full (unsharded) weights of a prepared model: ``get_state_dict`` and ``save_model`` (a prepared Hugging Face
model's ``save_pretrained`` is its family's: ``on_prepared``). Every rank calls them (one gather per sharded
tensor); rank 0 writes."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ndparallel.accelerator.pipeline import PipelineModel
from ndparallel.distributed.agree import agree
from ndparallel.errors import ConfigError

__all__ = ["full_state_dict", "parse_size", "save_model", "take_rank0_weights"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def full_state_dict(model: nn.Module | PipelineModel) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every DTensor gathered: full CPU tensors on rank 0, ``{}`` on the other
    ranks (as Accelerate's FSDP2 ``get_state_dict``). Collective: every rank calls it. A pipeline model (pp)
    gathers every stage to rank 0."""
    if isinstance(model, PipelineModel):
        return model.full_state_dict()
    rank, result = _rank(), {}
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if rank == 0:
            result[name] = full.detach().to("cpu", copy=True).contiguous()
    return result


def parse_size(size: int | str) -> int:
    """``"10GB"`` / ``"500MiB"`` / ``1000`` -> bytes."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(f"max_shard_size={size!r} must be a positive size such as '10GB' or 500000000")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def _shards(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Split ``tensors`` in order into groups of at most ``limit`` bytes (a larger tensor gets its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def _write(tensors: dict[str, torch.Tensor], directory: Path, limit: int, safe: bool) -> None:
    stem, suffix = ("model", ".safetensors") if safe else ("pytorch_model", ".bin")
    if safe:
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ConfigError(
                "save_model writes safetensors: pip install safetensors, or pass safe_serialization=False"
            ) from None
    directory.mkdir(parents=True, exist_ok=True)
    shards = _shards(tensors, limit)
    names = (
        [f"{stem}{suffix}"]
        if len(shards) == 1
        else [f"{stem}-{i + 1:05d}-of-{len(shards):05d}{suffix}" for i in range(len(shards))]
    )
    for name, shard in zip(names, shards, strict=True):
        if safe:
            save_file(shard, str(directory / name), metadata={"format": "pt"})
        else:
            torch.save(shard, directory / name)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {key: name for name, shard in zip(names, shards, strict=True) for key in shard},
        }
        (directory / f"{stem}{suffix}.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def save_model(
    model: nn.Module | PipelineModel,
    save_directory: str | os.PathLike,
    max_shard_size: int | str = "10GB",
    safe_serialization=True,
) -> None:
    """Write the full weights of ``model`` to ``save_directory`` on rank 0: ``model.safetensors`` (or
    ``pytorch_model.bin``), split into numbered shards plus an index above ``max_shard_size``."""
    limit = parse_size(max_shard_size)
    tensors = full_state_dict(model)
    failure = None
    if _rank() == 0:
        try:
            if Path(save_directory).is_file():
                raise ConfigError(f"{str(save_directory)!r} is a file; pass a directory")
            _write(tensors, Path(save_directory), limit, bool(safe_serialization))
        except Exception as err:  # every rank must learn of it
            failure = f"{type(err).__name__}: {err}"
    # Every rank raises rank 0's failure (text in tensors, nothing pickled); also the barrier: rank 0 has
    # finished writing when the others return.
    agree(failure, f"save_model could not write {str(save_directory)!r}", error_type=ConfigError)


def take_rank0_weights(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` with every parameter and buffer overwritten by rank 0's (one broadcast each over the world), as
    Accelerate's FSDP2 preparation does with ``sync_module_states`` / ``cpu_ram_efficient_loading``. A model whose
    weights are on the meta device (transformers' ``from_pretrained`` leaves them there on the other ranks under
    ``accelerate launch --use_fsdp``) is given storage first."""
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        model = model.to_empty(device=device)
    else:
        model = model.to(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)
    return model
