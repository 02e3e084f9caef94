"""Load a Hugging Face checkpoint straight into a sharded model, and save one back.

``load_pretrained`` builds the model on the meta device (no memory for weights), parallelises it,
allocates only each rank's shards, and reads from the safetensors files only the slice each rank
owns (``safe_open(...).get_slice(name)[region]``). ``load_pretrained_pipeline`` does the same under
``pp_size > 1``: each rank materialises and reads only the tensors of its own pipeline stages.
``save_pretrained`` gathers one full tensor at a time onto rank 0, which writes ``model.safetensors`` and
``config.json``: the folder loads with ``transformers``' ``from_pretrained`` and with ``load_pretrained`` on
any mesh.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ndparallel.config.parallelism import ParallelismConfig
from ndparallel.config.precision import stored_dtype_fits
from ndparallel.distributed.agree import agree
from ndparallel.distributed.memory import check_fits_in_memory as fits_in_memory
from ndparallel.distributed.memory import ranks_on_this_machine
from ndparallel.distributed.mesh import Mesh
from ndparallel.distributed.process import init_distributed
from ndparallel.distributed.regions import local_region
from ndparallel.errors import ConfigError
from ndparallel.models.hf.init import init_buffers
from ndparallel.parallel.fully_shard import fsdp_mesh
from ndparallel.parallel.parallelize import parallelize

if TYPE_CHECKING:  # floor 4; imported where called (docs/architecture.md: the loader's exception)
    from ndparallel.parallel.pipeline.runtime import Pipeline

__all__ = ["load_pretrained", "load_pretrained_pipeline", "local_region", "save_pretrained"]

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"


def _require_transformers() -> Any:
    try:
        import safetensors  # noqa: F401
        import transformers
    except ImportError as err:
        raise ConfigError(
            f"Hugging Face support needs transformers and safetensors ({err}): pip install 'ndparallel[hf]'"
        ) from None
    return transformers


# ------------------------------------------------------------------------------------ shard regions


# ------------------------------------------------------------------------------------------ loading


@contextlib.contextmanager
def _safetensors(file: Path) -> Iterator[Any]:
    """``safe_open(file)``; a file safetensors cannot read (truncated, corrupt) is a ConfigError naming it, not
    safetensors' bare ``SafetensorError: incomplete metadata``."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except SafetensorError as err:
        raise ConfigError(
            f"{str(file)!r} is not a readable safetensors file (truncated or corrupt: {err}); save or copy it again"
        ) from None


def unreadable_weights(folder: str | os.PathLike) -> str | None:
    """Why ``folder/model.safetensors`` cannot be read (truncated, corrupt), or None (readable, or absent)."""
    file = Path(folder) / SAFE_WEIGHTS
    if not file.is_file():
        return None
    try:
        with _safetensors(file) as f:
            f.keys()
    except ConfigError as err:
        return str(err).split("; save or copy it again")[0]
    return None


def _stored_files(path: Path) -> dict[str, Path]:
    """Stored tensor name -> safetensors file, from ``model.safetensors`` or a sharded index."""
    index = path / SAFE_INDEX
    if index.is_file():
        stored = {name: path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
        missing = sorted({file.name for file in stored.values() if not file.is_file()})
        if missing:
            raise ConfigError(
                f"{str(index)!r} maps tensors to {missing[:3]} ({len(missing)} shard(s)), which are not in "
                f"{str(path)!r}: copy the missing shard files there, or save the model again"
            )
        return stored
    single = path / SAFE_WEIGHTS
    if not single.is_file():
        raise ConfigError(f"no {SAFE_WEIGHTS} or {SAFE_INDEX} in {str(path)!r}: save it with save_pretrained")
    with _safetensors(single) as f:
        return {name: single for name in f.keys()}


def _weight_files(path: Path, model: nn.Module) -> dict[str, tuple[Path, str]]:
    """The model's tensor name -> (safetensors file, the name stored there) for ``model``'s checkpoint folder
    ``path``: transformers' own renaming of the model type's checkpoint keys applied (GPT-NeoX's ``embed_out``,
    EXAONE's ``transformer.h``), as ``from_pretrained`` applies it. A stored tensor that transformers would
    convert rather than rename (per-expert weights it fuses into one) is refused by name."""
    stored = _stored_files(path)
    renamed = _checkpoint_renaming(model, stored)
    converted = sorted(key for key, (_, pattern) in renamed.items() if pattern is not None)
    if converted:
        raise ConfigError(
            f"transformers converts the stored tensors {converted[:3]} of model_type="
            f"{getattr(model.config, 'model_type', None)!r} when it loads them (e.g. per-expert weights fused into "
            "one), which load_pretrained does not: load it with AutoModelForCausalLM.from_pretrained(path) and pass "
            "the model to ndparallel.parallelize"
        )
    return {renamed[key][0]: (file, key) for key, file in stored.items()}


def _check_tied_stored_alike(model: nn.Module, files: dict[str, tuple[Path, str]]) -> None:
    """Refuse a checkpoint that stores a tied weight under two of its names with different values (a stale
    ``lm_head.weight`` beside the embedding): transformers then unties them on load, so one process would
    train two tensors where this load keeps one. Equal copies are fine (either is the weight). Only such a
    checkpoint costs every rank a whole read of both tensors."""
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    for names in names_of.values():
        stored = [n for n in names if n in files]
        if len(stored) < 2:
            continue
        values = []
        for name in stored:
            file, key = files[name]
            with _safetensors(file) as f:
                values.append(f.get_slice(key)[:])
        if not all(v.shape == values[0].shape and torch.equal(v, values[0]) for v in values[1:]):
            raise ConfigError(
                f"the checkpoint stores the tied weight {stored[0]!r} also as {stored[1:]} with other values: "
                "transformers would untie them on load; set tie_word_embeddings=false in its config.json (two "
                "tensors) or drop the stale tensor from the safetensors file"
            )


def _checkpoint_renaming(model: nn.Module, stored: dict[str, Path]) -> dict[str, tuple[str, str | None]]:
    """Stored name -> (the model's name, the pattern of a conversion transformers would apply, or None) by
    transformers' own loading rule (``get_model_conversion_mapping`` + ``rename_source_key``, public functions
    of its loader). A transformers without them: names are the model's own."""
    try:
        from transformers.conversion_mapping import WeightRenaming, get_model_conversion_mapping
        from transformers.core_model_loading import rename_source_key
    except ImportError:
        return {key: (key, None) for key in stored}
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    names = model.state_dict()  # on the meta device: names and shapes only
    prefix = getattr(model, "base_model_prefix", None)
    return {key: rename_source_key(key, renamings, converters, prefix, names) for key in stored}


@torch.no_grad()
def _fill_from_files(model: nn.Module, files: dict[str, tuple[Path, str]]) -> None:
    """Read into ``model`` (the whole model or a pipeline stage) the region of each tensor this rank holds;
    ``files``: :func:`_weight_files`' map."""
    wanted = dict(model.named_parameters())
    # persistent buffers come from the checkpoint (init_buffers recomputes only the non-persistent ones)
    non_persistent = _non_persistent(model)
    wanted.update((n, b) for n, b in model.named_buffers() if n in files or n not in non_persistent)
    # a pipeline stage's copy of a tied weight reads the weight's one-process name (the embedding's); a head
    # tensor stored beside it holds the same values (_check_tied_stored_alike)
    tied = getattr(model, "tied_weights", {}) or {}
    source = {name: tied[name] if tied.get(name) in files else name for name in wanted}
    missing = sorted(name for name, key in source.items() if key not in files)
    if missing:
        raise ConfigError(f"checkpoint lacks tensors {missing[:4]} of {type(model).__name__}; is it the same model?")
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[source[name]][0], []).append(name)
    for file, names in by_file.items():
        with _safetensors(file) as f:
            held = set(f.keys())
            for name in names:
                target = wanted[name]
                key = files[source[name]][1]
                if key not in held:  # only an index can point a tensor at a file that lacks it
                    raise ConfigError(
                        f"{SAFE_INDEX} maps {key!r} to {file.name!r}, which does not hold it ({len(held)} other "
                        f"tensors): fix that entry of the index's weight_map, or save the model again"
                    )
                stored = f.get_slice(key)
                if tuple(stored.get_shape()) != tuple(target.shape):
                    raise ConfigError(
                        f"{name}: checkpoint shape {tuple(stored.get_shape())} != model shape {tuple(target.shape)}"
                    )
                _check_stored_dtype(name, stored.get_dtype(), target, file)
                local = target.to_local() if isinstance(target, DTensor) else target
                if local.numel():
                    local.copy_(stored[local_region(target)])


def _check_stored_dtype(name: str, dtype: str, target: torch.Tensor, file: Path) -> None:
    """Refuse a stored dtype of another kind than the tensor it loads into: the bytes of a float weight
    declared ``I32`` would be cast integer by integer (garbage, no error). Another float width is a cast."""
    if not stored_dtype_fits(dtype, target.dtype):
        raise ConfigError(
            f"{name}: {file.name!r} stores it as {dtype}, which does not fit the model's {target.dtype} (its bytes "
            "would load as other numbers); the file's header is corrupt or of another model: save or copy it again"
        )


def load_pretrained(
    path: str | os.PathLike,
    cfg: ParallelismConfig | None = None,
    mesh: Mesh | None = None,
    *,
    model_class: type | None = None,
    dtype: torch.dtype = torch.float32,
    **parallelize_kwargs: Any,
) -> nn.Module:
    """Build the HF model of the local folder ``path`` on the meta device, parallelise it on ``mesh`` and
    load its safetensors weights, each rank reading only the shards it holds. Every rank calls it.

    ``model_class`` defaults to ``AutoModelForCausalLM``; ``dtype`` is the parameters' dtype (stored
    tensors are cast); buffers keep the dtype the model builds them in (fp32 rotary ``inv_freq``, as
    ``from_pretrained`` keeps them); ``parallelize_kwargs`` go to :func:`ndparallel.parallelize` (``tp_plan``, ...).
    Nothing is downloaded: ``path`` must be a folder written by ``save_pretrained``.
    """
    if mesh is None:
        mesh = init_distributed(cfg or ParallelismConfig())
    if mesh.size("pp") > 1:
        raise ConfigError(
            f"load_pretrained builds one model, but pp_size={mesh.size('pp')}: use "
            "ndparallel.hf.load_pretrained_pipeline, which returns this rank's pipeline stages"
        )
    _check_meta_init(mesh)  # pp stages are materialised before parallelize: no such limit there
    model, files = _meta_model(path, model_class, dtype, mesh)
    model = parallelize(model, cfg, mesh, **parallelize_kwargs)
    model.to_empty(device=mesh.device)
    init_buffers(model)
    _fill_from_files(model, files)
    return model


def load_pretrained_pipeline(
    path: str | os.PathLike,
    cfg: ParallelismConfig | None = None,
    mesh: Mesh | None = None,
    *,
    microbatches: int | None = None,
    model_class: type | None = None,
    dtype: torch.dtype = torch.float32,
) -> Pipeline:
    """:func:`load_pretrained` under ``pp_size > 1``: the model is built on the meta device, each rank
    materialises only its stages (:func:`ndparallel.parallel.pipeline.build_pipeline`), and reads from the
    safetensors files only its stages' tensors (their local shards under tp / FSDP inside the stage).

    Returns the :class:`ndparallel.parallel.pipeline.Pipeline`; the weights equal a full load's
    (docs/pipeline-parallel.md#hugging-face-models). Every rank calls it.
    """
    from ndparallel.models.hf.stage import LOAD_MARKER
    from ndparallel.parallel.pipeline import build_pipeline

    mesh = mesh or init_distributed(cfg or ParallelismConfig())
    model, files = _meta_model(path, model_class, dtype, mesh)
    setattr(model, LOAD_MARKER, True)  # stages compute only their non-persistent buffers; parameters: files
    pipe = build_pipeline(model, cfg, mesh, microbatches=microbatches)
    failure = None
    try:
        for stage in pipe.stages:
            _fill_from_files(stage, files)
    except Exception as err:  # any failure (a bad file, a failed copy): every rank must learn of it, or they hang
        failure = err
    agree(failure, "load_pretrained_pipeline", error_type=ConfigError)
    return pipe


def _meta_model(path: str | os.PathLike, model_class: type | None, dtype: torch.dtype, mesh: Mesh) -> tuple:
    """The model of folder ``path`` on the meta device, parameters in ``dtype``; its tensor name -> file map."""
    transformers = _require_transformers()
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{str(path)!r} has no config.json: pass a local folder written by save_pretrained")
    config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    _check_fits_this_machine(config, dtype, mesh, path / "config.json")
    model_class = model_class or transformers.AutoModelForCausalLM
    with torch.device("meta"):
        build = getattr(model_class, "from_config", None) or model_class
        model = build(config)
    files = _weight_files(path, model)
    _check_tied_stored_alike(model, files)
    _cast_parameters(model, dtype)
    return model, files


def _parameter_floor(config: Any) -> tuple[int, str]:
    """A lower bound on the parameters of a decoder with ``config``'s sizes (the embedding, and per block an
    MLP's up and down projections and one norm: every family has at least these), and the fields of its
    largest term. Plain integer arithmetic, so a config of 10**12 of anything costs nothing to check."""
    sizes = {
        k: getattr(config, k, None) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size")
    }
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes.values()):
        return 0, ""  # not a decoder of the usual fields: the model's own construction judges it
    vocab, hidden, layers, ffn = sizes.values()
    embedding, blocks = vocab * hidden, layers * (2 * hidden * ffn + hidden)
    if embedding >= blocks:
        return embedding + blocks, f"vocab_size={vocab} x hidden_size={hidden}"
    return embedding + blocks, f"num_hidden_layers={layers} x hidden_size={hidden} x intermediate_size={ffn}"


def _check_fits_this_machine(config: Any, dtype: torch.dtype, mesh: Mesh, source: Path) -> None:
    """Refuse, before anything is built, a config whose parameters cannot fit: even spread evenly over every
    rank of the mesh, this machine's ranks would hold more bytes than its physical memory (a lower bound:
    replicas hold more). Building such a model hangs or dies with a raw storage-size error on every rank.
    The rule is :func:`ndparallel.distributed.memory.check_fits_in_memory`; this counts the parameters."""
    count, fields = _parameter_floor(config)
    if not count:
        return
    here = min(ranks_on_this_machine(), mesh.size())
    fits_in_memory(
        count, dtype.itemsize, factor=1 / mesh.size(), holders=here, fix="is the config right?",
        what=f"{source}: {fields} gives at least {count:.3g} parameters, which need",
        held=f"in {dtype} on this machine's {here} of {mesh.size()} ranks",
    )  # fmt: skip


def _cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating-point parameters to ``dtype``; buffers untouched (a bf16 rotary table changes the logits).
    Tied parameters stay one parameter."""
    cast: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_floating_point() and param.dtype != dtype:
                if id(param) not in cast:
                    cast[id(param)] = nn.Parameter(param.to(dtype), requires_grad=param.requires_grad)
                setattr(module, name, cast[id(param)])


def _check_meta_init(mesh: Mesh) -> None:
    if fsdp_mesh(mesh) is None and mesh.size("dp_replicate") > 1:
        # The replicate reducer fixes its bucket device when applied (meta here), so gradients would not be
        # averaged after to_empty: refuse rather than train replicas apart.
        raise ConfigError(
            f"load_pretrained on dp_replicate_size={mesh.size('dp_replicate')} without FSDP is not supported "
            "(meta-device init): use dp_shard_size instead (HSDP with dp_replicate_size works), or "
            "from_pretrained + ndparallel.parallelize"
        )


# ------------------------------------------------------------------------------------------- saving


def _full_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` per parameter and persistent buffer; a collective per DTensor."""
    persistent = {n for n, _ in model.named_buffers()} - _non_persistent(model)
    for name, tensor in [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in persistent)]:
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _non_persistent(model: nn.Module) -> set[str]:
    names = set()
    for prefix, module in model.named_modules():
        names.update(f"{prefix}.{b}" if prefix else b for b in getattr(module, "_non_persistent_buffers_set", ()))
    return names


def save_pretrained(model: nn.Module, path: str | os.PathLike) -> str | None:
    """Write ``model`` (sharded or not) as a ``save_pretrained`` folder: ``model.safetensors`` + ``config.json``.

    Every rank calls it; full tensors are gathered one at a time and only rank 0 writes. Tied weights
    are stored once (as ``transformers`` does). Returns the folder on rank 0, ``None`` elsewhere.
    """
    _require_transformers()
    from safetensors.torch import save_file

    rank = dist.get_rank() if dist.is_initialized() else 0
    tensors = {}
    for name, full in _full_tensors(model):
        if rank == 0:
            tensors[name] = full.detach().to("cpu", copy=True).contiguous()
    path = Path(path)
    failure = None
    if rank == 0:
        try:
            path.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(path / SAFE_WEIGHTS), metadata={"format": "pt"})
            model.config.save_pretrained(str(path))
        except Exception as err:  # every rank must learn of it, or the others wait forever
            failure = f"could not write {str(path)!r} ({type(err).__name__}: {err}); pass a writable path"
    # Collective, and the barrier: every rank returns once rank 0 has finished writing, or raises with it.
    agree(failure, "save_pretrained", error_type=ConfigError)
    return str(path) if rank == 0 else None
