"""The everyday helpers of ``accelerate.utils`` that scripts import: ``tqdm`` on the main process,
``find_executable_batch_size``, ``release_memory``, ``wait_for_everyone``, ``save``/``load``, environment
parsing, ``patch_environment``, and the ``is_*_available`` checks (installed packages, present devices)."""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib.metadata
import importlib.util
import inspect
import operator
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ndparallel.errors import ConfigError

__all__ = [
    "AVAILABILITY",
    "compare_versions",
    "find_executable_batch_size",
    "get_int_from_env",
    "is_available",
    "is_port_in_use",
    "load",
    "parse_choice_from_env",
    "parse_flag_from_env",
    "patch_environment",
    "release_memory",
    "save",
    "should_reduce_batch_size",
    "str_to_bool",
    "tqdm",
    "wait_for_everyone",
]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", _rank()))


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm``, shown on the local main process only (unless ``main_process_only=False``)."""
    from tqdm.auto import tqdm as bar

    if args and isinstance(args[0], bool):
        raise ConfigError("tqdm(main_process_only, ...) as the first argument: pass main_process_only= by keyword")
    disable = kwargs.pop("disable", False) or (main_process_only and _local_rank() != 0)
    return bar(*args, **kwargs, disable=disable)


def wait_for_everyone() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def release_memory(*objects: Any) -> list[None]:
    """``[None] * len(objects)`` to assign back (dropping the references), after a garbage collection."""
    released: list[None] = [None] * len(objects)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return released


def should_reduce_batch_size(exception: BaseException) -> bool:
    """True for an out-of-memory error (CUDA's, or a CPU allocation failure)."""
    if isinstance(exception, torch.OutOfMemoryError):
        return True
    text = str(exception)
    return isinstance(exception, RuntimeError) and any(
        s in text for s in ("out of memory", "CUDNN_STATUS_NOT_SUPPORTED", "DefaultCPUAllocator: can't allocate")
    )


def find_executable_batch_size(
    function: Callable | None = None, starting_batch_size: int = 128, reduce_batch_size_fn: Callable | None = None
) -> Callable:
    """Decorate ``function(batch_size, *args)``: call it with ``starting_batch_size``, halving it (or applying
    ``reduce_batch_size_fn``) after each out-of-memory error, until it runs; 0 raises RuntimeError."""
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    reduce = reduce_batch_size_fn or (lambda size: size // 2)

    @functools.wraps(function)
    def runner(*args: Any, **kwargs: Any) -> Any:
        parameters = list(inspect.signature(function).parameters)
        if len(parameters) < len(args) + 1:
            raise TypeError(
                f"Batch size was passed into `{function.__name__}` as the first argument when called. Remove this as "
                "the decorator already does so: `function(*args)`"
            )
        batch_size = starting_batch_size
        while True:
            if batch_size == 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as error:
                if not should_reduce_batch_size(error):
                    raise
                release_memory()
                batch_size = reduce(batch_size)

    return runner


def save(obj: Any, f: Any, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
    """``torch.save`` (or safetensors) on the main process (the local main one with ``save_on_each_node``)."""
    if (_local_rank() if save_on_each_node else _rank()) != 0:
        return
    if safe_serialization:
        from safetensors.torch import save_file

        save_file(obj, str(f), metadata={"format": "pt"})
    else:
        torch.save(obj, f)


def load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """``torch.load`` (weights only unless ``weights_only=False`` is passed)."""
    return torch.load(f, map_location=map_location, **{"weights_only": True, **kwargs})


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """Accelerate's truth strings: y/yes/t/true/on/1 -> 1, n/no/f/false/off/0 -> 0."""
    lowered = value.lower()
    if lowered in ("y", "yes", "t", "true", "on", "1"):
        return True if to_bool else 1
    if lowered in ("n", "no", "f", "false", "off", "0"):
        return False if to_bool else 0
    raise ValueError(f"invalid truth value {value}")


def get_int_from_env(env_keys: list[str], default: int) -> int:
    """The first of ``env_keys`` set to a non-negative integer, else ``default``."""
    for key in env_keys:
        value = int(os.environ.get(key, -1))
        if value >= 0:
            return value
    return default


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    return str_to_bool(os.environ.get(key, str(default))) == 1


def parse_choice_from_env(key: str, default: str = "no") -> str:
    return os.environ.get(key, str(default))


@contextlib.contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set the upper-cased ``kwargs`` as environment variables inside the block, then restore them."""
    saved = {}
    for key, value in kwargs.items():
        key = key.upper()
        saved[key] = os.environ.get(key)
        os.environ[key] = str(value)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def clear_environment() -> Iterator[None]:
    """An empty ``os.environ`` inside the block, restored after."""
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def is_port_in_use(port: int | None = None) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("localhost", port or 29500)) == 0


_OPERATIONS = {
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    "<": operator.lt,
}  # noqa: E501


def compare_versions(library_or_version: Any, operation: str, requirement_version: str) -> bool:
    from packaging.version import parse

    if operation not in _OPERATIONS:
        raise ValueError(f"`operation` must be one of {list(_OPERATIONS)}, received {operation}")
    version = library_or_version
    if isinstance(version, str) and not version[:1].isdigit():
        version = importlib.metadata.version(version)
    return _OPERATIONS[operation](parse(str(version)), parse(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    return compare_versions(torch.__version__.split("+")[0], operation, version)


def _package(name: str) -> Callable[..., bool]:
    return lambda *args, **kwargs: importlib.util.find_spec(name) is not None


def _device(name: str) -> Callable[..., bool]:
    def check(*args: Any, **kwargs: Any) -> bool:
        module = getattr(torch, name, None)
        return bool(module is not None and hasattr(module, "is_available") and module.is_available())

    return check


def _never(*args: Any, **kwargs: Any) -> bool:
    return False


def _always(*args: Any, **kwargs: Any) -> bool:
    return True


# accelerate.utils.is_<name>_available -> the check here. Packages: importable; devices: torch sees one;
# engines ndparallel does not drive (DeepSpeed, Megatron, XLA, fp8 kernels...) are unavailable to it.
AVAILABILITY: dict[str, Callable[..., bool]] = {
    **{name: _package(module) for name, module in {
        "aim": "aim", "amdsmi": "amdsmi", "boto3": "boto3", "clearml": "clearml", "comet_ml": "comet_ml",
        "datasets": "datasets", "dvclive": "dvclive", "matplotlib": "matplotlib", "mlflow": "mlflow",
        "pandas": "pandas", "peft": "peft", "pynvml": "pynvml", "pytest": "pytest", "rich": "rich",
        "schedulefree": "schedulefree", "swanlab": "swanlab", "tensorboard": "tensorboard", "timm": "timm",
        "torchdata": "torchdata", "torchvision": "torchvision", "trackio": "trackio", "transformers": "transformers",
        "triton": "triton", "wandb": "wandb", "import_timer": "import_timer",
    }.items()},
    **{name: _device(name) for name in ("cuda", "xpu", "npu", "mlu", "musa", "hpu", "sdaa")},
    "mps": lambda *args, **kwargs: torch.backends.mps.is_available(),
    "bf16": _always,
    "fp16": _always,
    "xccl": _never,
    "neuron": _never,
    "rocm": lambda *args, **kwargs: torch.version.hip is not None,
    "sagemaker": lambda *args, **kwargs: "SAGEMAKER_INTERNAL_IMAGE_URI" in os.environ,
    **{name: _never for name in (
        "deepspeed", "megatron_lm", "torch_xla", "fp8", "transformer_engine", "transformer_engine_mxfp8",
        "torchao", "bnb", "4bit_bnb", "8bit_bnb", "bitsandbytes_multi_backend", "lomo", "torchdata_stateful_dataloader",
    )},
}  # fmt: skip


def is_available(name: str) -> Callable[..., bool]:
    """``is_<name>_available`` (AVAILABILITY)."""
    return AVAILABILITY[name]
