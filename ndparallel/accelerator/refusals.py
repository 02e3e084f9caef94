"""The names of ``accelerate`` and ``accelerate.utils`` that ndparallel does not provide, each with the reason and
what to do instead. ``from ndparallel.utils import DeepSpeedPlugin`` succeeds (an ``isinstance`` check is
False); calling it raises a one-line ConfigError. tests/accelerator/test_accelerate_names.py checks that every
public name of Accelerate is provided or listed here."""

from __future__ import annotations

from typing import Any

from ndparallel.errors import ConfigError

__all__ = ["TOP_LEVEL", "UTILS", "refused"]

_BIG_MODEL = (
    "big-model inference (device maps, offloading, dispatch) is Accelerate's; ndparallel trains on a mesh: load "
    "with ndparallel.hf.load_pretrained (each rank reads its shards), or use accelerate for inference"
)
_DEEPSPEED = "DeepSpeed has no ndparallel equivalent: shard with ParallelismConfig(dp_shard_size=...)"
_MEGATRON = "Megatron-LM is not driven by ndparallel: use ParallelismConfig(tp_size=..., pp_size=...)"
_FP8 = "fp8 training (TransformerEngine, torchao) is not supported: use mixed_precision='bf16'"
_BNB = "bitsandbytes quantization is not supported by ndparallel: train in bf16 or fp32"
_FSDP = (
    "Accelerate's FSDP internals: prepare() shards with FSDP2; save with accelerator.save_state / save_model / "
    "get_state_dict"
)
_TP = "use ParallelismConfig(tp_size=..., cp_size=...): prepare() applies ndparallel's plans"
_COMPILE = "compile with ParallelismConfig(compile='model') or compile='blocks'"
_LAUNCHER = "Accelerate's launcher internals: launch with ndparallel launch (torchrun underneath)"

_GROUPS: dict[str, tuple[str, ...]] = {
    _BIG_MODEL: (
        "OffloadedWeightsLoader", "PrefixedDataset", "align_module_device", "calculate_maximum_sizes",
        "check_device_map", "check_tied_parameters_in_config", "check_tied_parameters_on_same_device",
        "compute_module_sizes", "copy_tensor_to_devices", "ensure_weights_retied", "extract_submodules_state_dict",
        "find_device", "find_tied_parameters", "get_accelerator_free_memory", "get_balanced_memory", "get_gpu_info",
        "get_max_layer_size", "get_max_memory", "get_module_children_bottom_up", "has_offloaded_params",
        "infer_auto_device_map", "load_checkpoint_in_model", "load_offloaded_weight", "load_offloaded_weights",
        "load_state_dict", "named_module_tensors", "offload_state_dict", "offload_weight", "retie_parameters",
        "save_offload_index", "set_module_tensor_to_device", "clean_state_dict_for_safetensors",
    ),
    _DEEPSPEED: (
        "DeepSpeedPlugin", "DeepSpeedSequenceParallelConfig", "GatheredParameters", "compile_regions_deepspeed",
        "deepspeed_required", "prepare_deepspeed_cmd_env",
    ),
    _MEGATRON: (
        "AbstractTrainStep", "BertTrainStep", "GPTTrainStep", "T5TrainStep", "MegatronLMDummyDataLoader",
        "MegatronLMDummyScheduler", "MegatronLMPlugin", "add_model_config_to_megatron_parser",
        "avg_losses_across_data_parallel_group",
    ),
    _FP8: (
        "AORecipeKwargs", "TERecipeKwargs", "apply_fp8_autowrap", "check_cuda_fp8_capability",
        "contextual_fp8_autocast", "convert_model", "convert_model_to_fp8_ao", "filter_first_and_last_linear_layers",
        "has_ao_layers", "has_transformer_engine_layers", "torchao_required",
    ),
    _BNB: ("BnbQuantizationConfig", "load_and_quantize_model", "has_4bit_bnb_layers"),
    _FSDP: (
        "fsdp2_apply_ac", "fsdp2_canonicalize_names", "fsdp2_load_full_state_dict", "fsdp2_prepare_model",
        "fsdp2_switch_optimizer_parameters", "load_fsdp_model", "load_fsdp_optimizer", "save_fsdp_model",
        "save_fsdp_optimizer", "merge_fsdp_weights", "enable_fsdp_ram_efficient_loading",
        "disable_fsdp_ram_efficient_loading", "get_fsdp2_grad_scaler", "compile_regions_fsdp2",
    ),
    _TP: ("TorchTensorParallelPlugin", "TorchTensorParallelConfig", "TorchContextParallelConfig", "get_model_tp_size"),
    _COMPILE: ("TorchDynamoPlugin", "compile_regions", "has_compiled_regions"),
    _LAUNCHER: (
        "PrepareForLaunch", "prepare_multi_gpu_env", "prepare_sagemager_args_inputs", "prepare_simple_launcher_cmd_env",
        "prepare_tpu", "install_xla", "write_basic_config", "convert_dict_to_env_variables",
        "get_cpu_distributed_information", "set_numa_affinity", "check_cuda_p2p_ib_support", "get_distributed_backend",
        "get_torch_accelerator_backend", "are_libraries_initialized", "purge_accelerate_environment",
    ),
}  # fmt: skip

UTILS: dict[str, str] = {name: why for why, names in _GROUPS.items() for name in names}
UTILS.update(
    {
        "get_grad_scaler": "ndparallel runs no GradScaler: use mixed_precision='bf16' (or fp16 under FSDP)",
        "get_mixed_precision_context_manager": "use accelerator.autocast()",
        "pad_input_tensors": "prepared loaders give every rank full batches (even_batches); pad with "
        "pad_across_processes",
    }
)

# `from accelerate import X` names without an ndparallel twin.
TOP_LEVEL: dict[str, str] = {
    "DeepSpeedPlugin": _DEEPSPEED,
    "cpu_offload": _BIG_MODEL,
    "cpu_offload_with_hook": _BIG_MODEL,
    "disk_offload": _BIG_MODEL,
    "dispatch_model": _BIG_MODEL,
    "infer_auto_device_map": _BIG_MODEL,
    "load_checkpoint_and_dispatch": _BIG_MODEL,
    "load_checkpoint_in_model": _BIG_MODEL,
    "init_empty_weights": "build the model under `with torch.device('meta'):` (prepare() under pp and "
    "ndparallel.hf.load_pretrained take meta models)",
    "init_on_device": "build the model under `with torch.device(...)`",
    "debug_launcher": "use ndparallel.notebook_launcher, or ndparallel.testing.run_distributed for CPU ranks",
    "prepare_pippy": "use ParallelismConfig(pp_size=...): prepare() builds the pipeline (docs/accelerate-migration.md)",
}


class _Refused:
    """A name Accelerate has and ndparallel does not: constructing or calling it raises."""

    _name = ""
    _why = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(f"{cls._name} is not supported by ndparallel: {cls._why}")


def refused(name: str, why: str) -> type:
    """A stand-in for Accelerate's ``name``: importable, never an instance, raises ConfigError when called."""
    return type(name, (_Refused,), {"_name": name, "_why": why, "__doc__": f"Refused: {why}."})
