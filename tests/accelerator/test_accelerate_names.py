"""Every public name of 🤗 Accelerate (installed with the trainer extra) is served by ndparallel or refused by
name: the top-level names of ``accelerate``, every name of ``accelerate.utils``, and every name of an
``Accelerator`` instance. "Refused" is a one-line ConfigError at the call saying what to do instead, never an
AttributeError. The walk reads Accelerate's own ``dir()``, so a name a new Accelerate release adds fails here
until ndparallel serves or refuses it. Names whose value is a plain setting are compared with Accelerate's
in one process."""

from __future__ import annotations

import types

import pytest
import torch

import ndparallel as ndp
import ndparallel.utils
from ndparallel.accelerator.names import REFUSED_METHODS, REFUSED_PROPERTIES
from ndparallel.accelerator.refusals import _Refused
from ndparallel.errors import ConfigError

accelerate = pytest.importorskip("accelerate")

# Accelerate's modules and where their names live here (those not listed have no import path of their own).
MIRRORED_MODULES = {
    "utils": "ndparallel.utils",
    "state": "ndparallel.state",
    "logging": "ndparallel.logging",
    "local_sgd": "ndparallel.local_sgd",
    "parallelism_config": "ndparallel.parallelism_config",
    "tracking": "ndparallel.tracking",
}


def _public(module: types.ModuleType) -> list[str]:
    return [n for n in dir(module) if not n.startswith("_") and not isinstance(getattr(module, n), types.ModuleType)]


def _served_or_refused(ours: object, name: str) -> str:
    value = getattr(ours, name)  # an AttributeError here is the bug this test exists for
    if isinstance(value, type) and issubclass(value, _Refused):
        with pytest.raises(ConfigError, match=f"^{name} is not supported by ndparallel: .+") as caught:
            value()
        assert "\n" not in str(caught.value)
        return "refused"
    return "served"


def test_every_top_level_name_of_accelerate_is_served_or_refused():
    kinds = [_served_or_refused(ndp, name) for name in _public(accelerate)]
    assert kinds.count("served") >= 15 and "refused" in kinds
    for name in MIRRORED_MODULES.values():
        __import__(name)
    assert ndp.DistributedType.MULTI_CPU == accelerate.DistributedType.MULTI_CPU  # both str enums: the same value


def test_every_name_of_accelerate_utils_is_served_or_refused():
    import accelerate.utils

    kinds = {name: _served_or_refused(ndparallel.utils, name) for name in _public(accelerate.utils)}
    assert list(kinds.values()).count("served") > 100, kinds
    with pytest.raises(AttributeError):
        ndparallel.utils.no_such_name  # noqa: B018 - a name Accelerate does not have is an ordinary AttributeError
    for name in ("MODEL_NAME", "SAFE_WEIGHTS_NAME", "OPTIMIZER_NAME", "RNG_STATE_NAME", "SCHEDULER_NAME"):
        assert getattr(ndparallel.utils, name) == getattr(accelerate.utils, name)
    # the submodules scripts import from, each with its everyday names
    from ndparallel.utils.constants import SAFE_WEIGHTS_NAME  # noqa: F401
    from ndparallel.utils.dataclasses import DataLoaderConfiguration, DeepSpeedPlugin  # noqa: F401
    from ndparallel.utils.imports import is_cuda_available, is_torch_distributed_available  # noqa: F401
    from ndparallel.utils.memory import find_executable_batch_size, should_reduce_batch_size  # noqa: F401
    from ndparallel.utils.operations import gather, pad_across_processes  # noqa: F401
    from ndparallel.utils.random import set_seed, synchronize_rng_states  # noqa: F401

    assert issubclass(DeepSpeedPlugin, _Refused)


@pytest.fixture
def both():
    """Accelerate's and ndparallel's Accelerator in this one process (Accelerate starts no process group here)."""
    from accelerate.state import AcceleratorState

    theirs = accelerate.Accelerator(cpu=True)
    ours = ndp.Accelerator(cpu=True)
    yield ours, theirs
    AcceleratorState._reset_state(reset_partial_state=True)
    ndp.destroy_distributed()


# Settings both report in one process, compared value for value.
SAME_VALUE = (
    "device", "distributed_type", "num_processes", "process_index", "local_process_index", "is_main_process",
    "is_local_main_process", "is_last_process", "use_distributed", "multi_device", "mixed_precision",
    "gradient_accumulation_steps", "sync_gradients", "split_batches", "even_batches", "dispatch_batches",
    "use_seedable_sampler", "non_blocking", "use_stateful_dataloader", "device_placement", "scaler",
    "step_scheduler_with_optimizer", "optimizer_step_was_skipped", "deepspeed_plugin", "fp8_backend",
    "project_dir", "logging_dir", "save_iteration", "trackers", "step", "is_fsdp2", "rng_types", "flag_tensor",
    "has_lomo_optimizer", "delayed_fp8_autocast", "ao_recipe_handler", "te_recipe_handler", "ddp_handler",
    "init_handler", "scaler_handler", "autocast_handler", "profile_handler", "should_save_model",
)  # fmt: skip


def test_every_name_of_an_accelerator_is_served_or_refused(both):
    ours, theirs = both
    names = sorted({n for n in dir(theirs) if not n.startswith("_")} | {n for n in dir(type(theirs)) if n[0] != "_"})
    for name in names:
        if name in REFUSED_METHODS:
            with pytest.raises(ConfigError, match=f"^accelerator.{name}\\(\\) is not supported by ndparallel: .+"):
                getattr(ours, name)()
        elif name in REFUSED_PROPERTIES:
            with pytest.raises(ConfigError, match=f"^accelerator.{name} is not supported by ndparallel: .+"):
                getattr(ours, name)
        else:
            getattr(ours, name)
    different = {
        n: (getattr(ours, n), getattr(theirs, n)) for n in SAME_VALUE if getattr(ours, n) != getattr(theirs, n)
    }
    assert not different, different
    assert str(ours.distributed_type) == str(theirs.distributed_type) == "DistributedType.NO"
    assert ours.state.num_processes == theirs.state.num_processes == 1
    assert ours.gradient_state.end_of_dataloader == theirs.gradient_state.end_of_dataloader
    assert ours.dataloader_config == ndp.DataLoaderConfiguration()
    for rank in ("data_parallel_rank", "data_parallel_shard_rank", "tensor_parallel_rank"):
        assert getattr(ours, rank) == 0
    with pytest.raises(AttributeError):
        ours.no_such_name  # noqa: B018


def test_one_process_helpers_behave_as_accelerates(both, tmp_path):
    import accelerate.utils as theirs

    ours, _ = both
    nested = {"a": (torch.arange(3), [torch.ones(2, 2)]), "b": torch.tensor(5.0)}
    for name in ("gather", "pad_across_processes", "send_to_device", "convert_to_fp32", "listify"):
        mine, reference = getattr(ndparallel.utils, name), getattr(theirs, name)
        args = (nested, "cpu") if name == "send_to_device" else (nested,)
        assert str(mine(*args)) == str(reference(*args)), name
    assert ndparallel.utils.gather_object([1, "x"]) == theirs.gather_object([1, "x"])
    assert ndparallel.utils.find_batch_size(nested) == theirs.find_batch_size(nested) == 3
    assert ndparallel.utils.merge_dicts({"a": {"b": 1}}, {"a": {"c": 2}}) == {"a": {"b": 1, "c": 2}}
    assert ndparallel.utils.convert_file_size_to_int("5GB") == theirs.convert_file_size_to_int("5GB")
    assert ndparallel.utils.str_to_bool("yes") == theirs.str_to_bool("yes") == 1
    with ndparallel.utils.patch_environment(ndp_probe="1"):
        assert ndparallel.utils.parse_flag_from_env("NDP_PROBE") is True

    sizes = []

    @ndparallel.utils.find_executable_batch_size(starting_batch_size=64)
    def train(batch_size):
        sizes.append(batch_size)
        if batch_size > 16:
            raise RuntimeError("CUDA out of memory.")
        return batch_size

    assert train() == 16 and sizes == [64, 32, 16]
    with ours.split_between_processes([1, 2, 3]) as share:
        assert share == [1, 2, 3]
    ours.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    assert torch.equal(torch.load(tmp_path / "w.pt")["w"], torch.ones(2))
    assert not ours.check_trigger()
    ours.set_trigger()
    assert ours.check_trigger() and not ours.check_trigger()
    assert ours.free_memory(object(), object()) == [None, None]
    assert ours.on_process(lambda: 7, process_index=0)() == 7


def test_a_custom_tracker_subclasses_general_tracker(tmp_path):
    from ndparallel.tracking import GeneralTracker

    class Recorder(GeneralTracker):
        name, requires_logging_directory = "recorder", False

        def __init__(self):
            super().__init__()
            self.calls = []

        @property
        def tracker(self):
            return self.calls

        def start(self):
            self.calls.append("start")

        def store_init_configuration(self, values):
            self.calls.append(("config", values))

        def log(self, values, step=None, **kwargs):
            self.calls.append(("log", values, step))

    class Incomplete(GeneralTracker):
        pass

    with pytest.raises(ConfigError, match="Incomplete is missing name, requires_logging_directory, tracker"):
        Incomplete()
    recorder = Recorder()
    try:
        acc = ndp.Accelerator(cpu=True, log_with=[recorder])
        acc.init_trackers("run", config={"lr": 0.1})
        acc.log({"loss": 1.0}, step=3)
        assert acc.get_tracker("recorder", unwrap=True) is recorder.calls
    finally:
        ndp.destroy_distributed()
    assert recorder.calls == ["start", ("config", {"lr": 0.1}), ("log", {"loss": 1.0}, 3)]
