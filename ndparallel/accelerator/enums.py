"""Accelerate's enums under their names and values (``DistributedType.MULTI_CPU == "MULTI_CPU"``), so a script's
comparisons read the same. Each is a ``str`` enum: a member equals its value and Accelerate's member of that value."""

from __future__ import annotations

import enum

__all__ = [
    "ComputeEnvironment",
    "CustomDtype",
    "DDPCommunicationHookType",
    "DistributedType",
    "DynamoBackend",
    "LoggerType",
    "PrecisionType",
    "RNGType",
    "SageMakerDistributedType",
]


class _Plain(str, enum.Enum):
    """A str enum printed as ``Class.MEMBER`` (as Accelerate's plain ones)."""


class _Enum(str, enum.Enum):
    """A str enum printed as its value; ``list()`` gives the values (as Accelerate's ``BaseEnum``)."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        return [member.value for member in cls]


class ComputeEnvironment(_Plain):
    """Where ``accelerate config`` says the job runs (ndparallel: LOCAL_MACHINE)."""

    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class CustomDtype(_Enum):
    """Accelerate's dtypes without a torch dtype (big-model sizes)."""

    FP8 = "fp8"
    INT4 = "int4"
    INT2 = "int2"


class DDPCommunicationHookType(_Enum):
    """Gradient compression hooks of DDP (ndparallel: NO only)."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


class DistributedType(_Plain):
    """What the processes do together: NO (one), MULTI_CPU / MULTI_GPU (data parallel), FSDP ..."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


class DynamoBackend(_Enum):
    """torch.compile backends (ndparallel compiles with ParallelismConfig(compile=))."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


class LoggerType(_Enum):
    """Experiment trackers ``log_with=`` names."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"


class PrecisionType(_Enum):
    """Mixed-precision names."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class RNGType(_Enum):
    """Random generators a prepared loader can synchronise."""

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"


class SageMakerDistributedType(_Plain):
    """SageMaker launch modes (not run by ndparallel)."""

    NO = "NO"
    DATA_PARALLEL = "DATA_PARALLEL"
    MODEL_PARALLEL = "MODEL_PARALLEL"
