"""``ndparallel.utils``: ``accelerate.utils`` under ndparallel's name, so ``from accelerate.utils import set_seed,
DataLoaderConfiguration`` changes only its package name. A thin package: the code lives in
``ndparallel.accelerator``. A name of Accelerate's that ndparallel does not provide (DeepSpeed, big-model
dispatch, fp8...) still imports, and raises a one-line ConfigError saying what to do instead when called
(``ndparallel.accelerator.refusals``; docs/accelerate-migration.md).
"""

from typing import Any

from ndparallel.accelerator.constants import (
    MODEL_NAME,
    OPTIMIZER_NAME,
    PROFILE_PATTERN_NAME,
    RNG_STATE_NAME,
    SAFE_MODEL_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SAFE_WEIGHTS_PATTERN_NAME,
    SAMPLER_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    TORCH_DISTRIBUTED_OPERATION_TYPES,
    TORCH_LAUNCH_PARAMS,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    WEIGHTS_PATTERN_NAME,
)
from ndparallel.accelerator.enums import (
    ComputeEnvironment,
    CustomDtype,
    DDPCommunicationHookType,
    DistributedType,
    DynamoBackend,
    LoggerType,
    PrecisionType,
    RNGType,
    SageMakerDistributedType,
)
from ndparallel.accelerator.helpers import (
    AVAILABILITY,
    clear_environment,
    compare_versions,
    find_executable_batch_size,
    get_int_from_env,
    is_port_in_use,
    is_torch_version,
    load,
    parse_choice_from_env,
    parse_flag_from_env,
    patch_environment,
    release_memory,
    save,
    str_to_bool,
    tqdm,
    wait_for_everyone,
)
from ndparallel.accelerator.kwargs import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
    ProjectConfiguration,
)
from ndparallel.accelerator.misc import (
    CannotPadNestedTensorWarning,
    TensorInformation,
    check_os_kernel,
    convert_bytes,
    convert_file_size_to_int,
    convert_outputs_to_fp32,
    dtype_byte_size,
    extract_model_from_parallel,
    get_current_device_type,
    get_data_structure,
    get_pretty_name,
    honor_type,
    id_tensor_storage,
    ignorant_find_batch_size,
    initialize_tensors,
    is_compiled_module,
    is_habana_gaudi1,
    is_peft_model,
    is_tensor_information,
    is_torch_tensor,
    listify,
    merge_dicts,
    model_has_dtensor,
    normalize_device,
    recursive_getattr,
    synchronize_rng_state,
    synchronize_rng_states,
)
from ndparallel.accelerator.operations import (
    broadcast,
    broadcast_object_list,
    concatenate,
    convert_to_fp32,
    find_batch_size,
    gather,
    gather_object,
    is_namedtuple,
    pad_across_processes,
    recursively_apply,
    reduce,
    send_to_device,
    slice_tensors,
)
from ndparallel.accelerator.options import FullyShardedDataParallelPlugin
from ndparallel.accelerator.refusals import UTILS as _REFUSED
from ndparallel.accelerator.refusals import refused as _refused
from ndparallel.accelerator.seed import set_seed
from ndparallel.config.parallelism import ParallelismConfig

is_4bit_bnb_available = AVAILABILITY["4bit_bnb"]
is_8bit_bnb_available = AVAILABILITY["8bit_bnb"]
is_aim_available = AVAILABILITY["aim"]
is_amdsmi_available = AVAILABILITY["amdsmi"]
is_bf16_available = AVAILABILITY["bf16"]
is_bitsandbytes_multi_backend_available = AVAILABILITY["bitsandbytes_multi_backend"]
is_bnb_available = AVAILABILITY["bnb"]
is_boto3_available = AVAILABILITY["boto3"]
is_clearml_available = AVAILABILITY["clearml"]
is_comet_ml_available = AVAILABILITY["comet_ml"]
is_cuda_available = AVAILABILITY["cuda"]
is_datasets_available = AVAILABILITY["datasets"]
is_deepspeed_available = AVAILABILITY["deepspeed"]
is_dvclive_available = AVAILABILITY["dvclive"]
is_fp16_available = AVAILABILITY["fp16"]
is_fp8_available = AVAILABILITY["fp8"]
is_hpu_available = AVAILABILITY["hpu"]
is_import_timer_available = AVAILABILITY["import_timer"]
is_lomo_available = AVAILABILITY["lomo"]
is_matplotlib_available = AVAILABILITY["matplotlib"]
is_megatron_lm_available = AVAILABILITY["megatron_lm"]
is_mlflow_available = AVAILABILITY["mlflow"]
is_mlu_available = AVAILABILITY["mlu"]
is_mps_available = AVAILABILITY["mps"]
is_musa_available = AVAILABILITY["musa"]
is_neuron_available = AVAILABILITY["neuron"]
is_npu_available = AVAILABILITY["npu"]
is_pandas_available = AVAILABILITY["pandas"]
is_peft_available = AVAILABILITY["peft"]
is_pynvml_available = AVAILABILITY["pynvml"]
is_pytest_available = AVAILABILITY["pytest"]
is_rich_available = AVAILABILITY["rich"]
is_rocm_available = AVAILABILITY["rocm"]
is_sagemaker_available = AVAILABILITY["sagemaker"]
is_schedulefree_available = AVAILABILITY["schedulefree"]
is_sdaa_available = AVAILABILITY["sdaa"]
is_swanlab_available = AVAILABILITY["swanlab"]
is_tensorboard_available = AVAILABILITY["tensorboard"]
is_timm_available = AVAILABILITY["timm"]
is_torch_xla_available = AVAILABILITY["torch_xla"]
is_torchao_available = AVAILABILITY["torchao"]
is_torchdata_available = AVAILABILITY["torchdata"]
is_torchdata_stateful_dataloader_available = AVAILABILITY["torchdata_stateful_dataloader"]
is_torchvision_available = AVAILABILITY["torchvision"]
is_trackio_available = AVAILABILITY["trackio"]
is_transformer_engine_available = AVAILABILITY["transformer_engine"]
is_transformer_engine_mxfp8_available = AVAILABILITY["transformer_engine_mxfp8"]
is_transformers_available = AVAILABILITY["transformers"]
is_triton_available = AVAILABILITY["triton"]
is_wandb_available = AVAILABILITY["wandb"]
is_xccl_available = AVAILABILITY["xccl"]
is_xpu_available = AVAILABILITY["xpu"]


def __getattr__(name: str) -> Any:
    """Accelerate's names ndparallel refuses: importable, raising a ConfigError when used."""
    if name in _REFUSED:
        return _refused(name, _REFUSED[name])
    raise AttributeError(f"module 'ndparallel.utils' has no attribute {name!r}")


__all__ = [
    "AutocastKwargs",
    "CannotPadNestedTensorWarning",
    "ComputeEnvironment",
    "CustomDtype",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DynamoBackend",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "MODEL_NAME",
    "OPTIMIZER_NAME",
    "PROFILE_PATTERN_NAME",
    "ParallelismConfig",
    "PrecisionType",
    "ProfileKwargs",
    "ProjectConfiguration",
    "RNGType",
    "RNG_STATE_NAME",
    "SAFE_MODEL_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SAFE_WEIGHTS_PATTERN_NAME",
    "SAMPLER_NAME",
    "SCALER_NAME",
    "SCHEDULER_NAME",
    "SageMakerDistributedType",
    "TORCH_DISTRIBUTED_OPERATION_TYPES",
    "TORCH_LAUNCH_PARAMS",
    "TensorInformation",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "WEIGHTS_PATTERN_NAME",
    "broadcast",
    "broadcast_object_list",
    "check_os_kernel",
    "clear_environment",
    "compare_versions",
    "concatenate",
    "convert_bytes",
    "convert_file_size_to_int",
    "convert_outputs_to_fp32",
    "convert_to_fp32",
    "dtype_byte_size",
    "extract_model_from_parallel",
    "find_batch_size",
    "find_executable_batch_size",
    "gather",
    "gather_object",
    "get_current_device_type",
    "get_data_structure",
    "get_int_from_env",
    "get_pretty_name",
    "honor_type",
    "id_tensor_storage",
    "ignorant_find_batch_size",
    "initialize_tensors",
    "is_4bit_bnb_available",
    "is_8bit_bnb_available",
    "is_aim_available",
    "is_amdsmi_available",
    "is_bf16_available",
    "is_bitsandbytes_multi_backend_available",
    "is_bnb_available",
    "is_boto3_available",
    "is_clearml_available",
    "is_comet_ml_available",
    "is_compiled_module",
    "is_cuda_available",
    "is_datasets_available",
    "is_deepspeed_available",
    "is_dvclive_available",
    "is_fp16_available",
    "is_fp8_available",
    "is_habana_gaudi1",
    "is_hpu_available",
    "is_import_timer_available",
    "is_lomo_available",
    "is_matplotlib_available",
    "is_megatron_lm_available",
    "is_mlflow_available",
    "is_mlu_available",
    "is_mps_available",
    "is_musa_available",
    "is_namedtuple",
    "is_neuron_available",
    "is_npu_available",
    "is_pandas_available",
    "is_peft_available",
    "is_peft_model",
    "is_port_in_use",
    "is_pynvml_available",
    "is_pytest_available",
    "is_rich_available",
    "is_rocm_available",
    "is_sagemaker_available",
    "is_schedulefree_available",
    "is_sdaa_available",
    "is_swanlab_available",
    "is_tensor_information",
    "is_tensorboard_available",
    "is_timm_available",
    "is_torch_tensor",
    "is_torch_version",
    "is_torch_xla_available",
    "is_torchao_available",
    "is_torchdata_available",
    "is_torchdata_stateful_dataloader_available",
    "is_torchvision_available",
    "is_trackio_available",
    "is_transformer_engine_available",
    "is_transformer_engine_mxfp8_available",
    "is_transformers_available",
    "is_triton_available",
    "is_wandb_available",
    "is_xccl_available",
    "is_xpu_available",
    "listify",
    "load",
    "merge_dicts",
    "model_has_dtensor",
    "normalize_device",
    "pad_across_processes",
    "parse_choice_from_env",
    "parse_flag_from_env",
    "patch_environment",
    "recursive_getattr",
    "recursively_apply",
    "reduce",
    "release_memory",
    "save",
    "send_to_device",
    "set_seed",
    "slice_tensors",
    "str_to_bool",
    "synchronize_rng_state",
    "synchronize_rng_states",
    "tqdm",
    "wait_for_everyone",
]
