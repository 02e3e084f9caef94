"""File names and lists of ``accelerate.utils.constants``, with Accelerate's values (the names of the files in an
Accelerate checkpoint folder, which ndparallel reads and writes where it can: docs/accelerate-migration.md)."""

__all__ = [
    "MODEL_NAME",
    "OPTIMIZER_NAME",
    "PROFILE_PATTERN_NAME",
    "RNG_STATE_NAME",
    "SAFE_MODEL_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SAFE_WEIGHTS_PATTERN_NAME",
    "SAMPLER_NAME",
    "SCALER_NAME",
    "SCHEDULER_NAME",
    "TORCH_DISTRIBUTED_OPERATION_TYPES",
    "TORCH_LAUNCH_PARAMS",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "WEIGHTS_PATTERN_NAME",
]

MODEL_NAME = "pytorch_model"
OPTIMIZER_NAME = "optimizer"
PROFILE_PATTERN_NAME = "profile_{suffix}.json"
RNG_STATE_NAME = "random_states"
SAFE_MODEL_NAME = "model"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_PATTERN_NAME = "model{suffix}.safetensors"
SAMPLER_NAME = "sampler"
SCALER_NAME = "scaler.pt"
SCHEDULER_NAME = "scheduler"
TORCH_DISTRIBUTED_OPERATION_TYPES = [
    "DEEPSPEED",
    "MULTI_GPU",
    "FSDP",
    "MEGATRON_LM",
    "TP",
    "MULTI_NPU",
    "MULTI_MLU",
    "MULTI_SDAA",
    "MULTI_MUSA",
    "MULTI_XPU",
    "MULTI_CPU",
    "MULTI_HPU",
    "MULTI_NEURON",
]
TORCH_LAUNCH_PARAMS = [
    "nnodes",
    "nproc_per_node",
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_id",
    "rdzv_conf",
    "standalone",
    "max_restarts",
    "monitor_interval",
    "start_method",
    "role",
    "module",
    "m",
    "no_python",
    "run_path",
    "log_dir",
    "r",
    "redirects",
    "t",
    "tee",
    "node_rank",
    "master_addr",
    "master_port",
]
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_PATTERN_NAME = "pytorch_model{suffix}.bin"
