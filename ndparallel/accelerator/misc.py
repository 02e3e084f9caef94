"""Small helpers of ``accelerate.utils`` (its ``other``, ``modeling`` and ``operations`` odds and ends) that
scripts and libraries call: unwrapping a model, sizes in bytes, dict merging, tensor-structure utilities,
RNG synchronisation."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ndparallel.accelerator.dealing import check_rng_types, sync_rng
from ndparallel.accelerator.operations import is_namedtuple, recursively_apply

__all__ = [
    "CannotPadNestedTensorWarning",
    "TensorInformation",
    "check_os_kernel",
    "convert_bytes",
    "convert_file_size_to_int",
    "convert_outputs_to_fp32",
    "dtype_byte_size",
    "extract_model_from_parallel",
    "get_current_device_type",
    "get_data_structure",
    "get_pretty_name",
    "honor_type",
    "id_tensor_storage",
    "ignorant_find_batch_size",
    "initialize_tensors",
    "is_compiled_module",
    "is_habana_gaudi1",
    "is_peft_model",
    "is_tensor_information",
    "is_torch_tensor",
    "listify",
    "merge_dicts",
    "model_has_dtensor",
    "normalize_device",
    "recursive_getattr",
    "synchronize_rng_state",
    "synchronize_rng_states",
]


class CannotPadNestedTensorWarning(UserWarning):
    """Warned when a nested tensor cannot be padded across processes."""


@dataclass
class TensorInformation:
    shape: torch.Size
    dtype: torch.dtype


def is_torch_tensor(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor)


def is_tensor_information(value: Any) -> bool:
    return isinstance(value, TensorInformation)


def honor_type(obj: Any, generator: Any) -> Any:
    """A tuple/list/namedtuple of ``obj``'s type from ``generator``."""
    return type(obj)(*list(generator)) if is_namedtuple(obj) else type(obj)(generator)


def get_data_structure(data: Any) -> Any:
    """``data`` with each tensor replaced by its shape and dtype."""
    return recursively_apply(lambda t: TensorInformation(shape=t.shape, dtype=t.dtype), data)


def initialize_tensors(data_structure: Any) -> Any:
    """Empty tensors of the shapes and dtypes ``get_data_structure`` recorded."""
    return recursively_apply(
        lambda t: torch.empty(*t.shape, dtype=t.dtype), data_structure, test_type=is_tensor_information
    )


def ignorant_find_batch_size(data: Any) -> int | None:
    from ndparallel.accelerator.operations import find_batch_size

    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


def convert_outputs_to_fp32(model_forward: Any) -> Any:
    """``model_forward`` returning half-precision outputs as fp32."""
    from ndparallel.accelerator.operations import convert_to_fp32

    def forward(*args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(model_forward(*args, **kwargs))

    return forward


def is_compiled_module(module: Any) -> bool:
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule) if hasattr(torch, "_dynamo") else False


def extract_model_from_parallel(model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> Any:
    """``model`` without DDP/DataParallel and (``keep_torch_compile=False``) ``torch.compile`` wrappers."""
    if not keep_torch_compile and is_compiled_module(model):
        model = model._orig_mod
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


def is_peft_model(model: Any) -> bool:
    return type(model).__module__.startswith("peft.")


def model_has_dtensor(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def check_os_kernel() -> None:
    """Accelerate warns about old Linux kernels (hangs); nothing to check here."""


def is_habana_gaudi1() -> bool:
    return False


def get_current_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def normalize_device(device: Any) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def listify(data: Any) -> Any:
    """Tensors inside ``data`` as (nested) Python lists / numbers."""
    return recursively_apply(lambda t: t.tolist(), data)


def merge_dicts(source: dict, destination: dict) -> dict:
    """``source`` merged into ``destination`` recursively; returns ``destination``."""
    for key, value in source.items():
        if isinstance(value, Mapping):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination


def get_pretty_name(obj: Any) -> str:
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    return str(getattr(obj, "__qualname__", getattr(obj, "__name__", obj)))


def recursive_getattr(obj: Any, attr: str) -> Any:
    for name in attr.split("."):
        obj = getattr(obj, name)
    return obj


def convert_bytes(size: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def convert_file_size_to_int(size: int | str) -> int:
    """``"5GB"`` / ``"300MiB"`` -> bytes (decimal units, ``iB`` binary)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]I?B)", size.upper())
    if not match:
        raise ValueError("`size` is not in a valid format. Use an integer or a string like '5GB' or '300MiB'")
    scale = {"K": 1, "M": 2, "G": 3, "T": 4}[match.group(2)[0]]
    return int(float(match.group(1)) * ((1024 if "I" in match.group(2) else 1000) ** scale))


def dtype_byte_size(dtype: torch.dtype) -> float:
    if dtype == torch.bool:
        return 1 / 8
    return torch.finfo(dtype).bits / 8 if dtype.is_floating_point else torch.iinfo(dtype).bits / 8


def id_tensor_storage(tensor: torch.Tensor) -> tuple[torch.device, int, int]:
    """An id of ``tensor``'s storage (device, address, size): tensors sharing memory share it."""
    storage = tensor.untyped_storage()
    return tensor.device, storage.data_ptr(), storage.nbytes()


def synchronize_rng_state(rng_type: Any = None, generator: torch.Generator | None = None) -> None:
    """Overwrite this process's ``rng_type`` generator (``"torch"``, ``"cuda"``, ``"generator"``) with rank 0's."""
    sync_rng(check_rng_types([rng_type]), generator)


def synchronize_rng_states(rng_types: list[Any], generator: torch.Generator | None = None) -> None:
    sync_rng(check_rng_types(rng_types), generator)
