"""ndparallel's Accelerator against 🤗 Accelerate's documented behaviour, in one process (no Accelerate installed):
constructor keywords and their named refusals, ParallelismConfig's Accelerate properties, accelerate config
YAML keys, mixed precision by autocast where FSDP does not cast, optimizers and schedulers that step only
when gradients sync, prepared loaders (end-of-loader sync, skip_first_batches), trackers, saving."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ndparallel as ndp
from ndparallel.accelerator import Accelerator, FullyShardedDataParallelPlugin
from ndparallel.errors import ConfigError
from ndparallel.utils import (
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
)


@pytest.fixture
def single_process():
    """A one-process group for the Accelerator, torn down after the test."""
    yield
    ndp.destroy_distributed()


# ----------------------------------------------------------------------------------- configuration


def test_parallelism_config_has_accelerates_properties():
    # Accelerate's ParallelismConfig: dims listed when enabled (size > 1), in its order.
    cfg = ndp.ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2)
    assert (cfg.dp_replicate_enabled, cfg.dp_shard_enabled, cfg.tp_enabled, cfg.cp_enabled) == (True, True, True, False)
    assert cfg.dp_dim_names == ["dp_replicate", "dp_shard"] and cfg.non_dp_dim_names == ["tp"]
    assert cfg.dp_cp_dim_names == ["dp_replicate", "dp_shard"] and cfg.dp_shard_cp_dim_names == ["dp_shard"]
    assert cfg.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]
    assert (cfg.total_size, cfg.data_parallel_size, cfg.non_data_parallel_size) == (8, 4, 2)
    cp = ndp.ParallelismConfig(tp_size=2, cp_size=2)
    assert cp.dp_cp_dim_names == ["cp"] and cp.non_dp_dim_names == ["tp", "cp"] and cp.non_data_parallel_size == 4
    assert ndp.ParallelismConfig().dp_cp_dim_names == []  # falsy: the example reduces over the world then
    with pytest.raises(ConfigError, match="resolve"):
        ndp.ParallelismConfig(dp_shard_size=-1).dp_shard_enabled  # noqa: B018


ACCELERATE_CP_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: false
  fsdp_offload_params: false
  fsdp_reshard_after_forward: false
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
parallelism_config:
  parallelism_config_cp_size: 4
  parallelism_config_dp_replicate_size: 1
  parallelism_config_dp_shard_size: 2
  parallelism_config_tp_size: 1
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def test_accelerate_yaml_keys_are_honoured(tmp_path):
    path = tmp_path / "accelerate.yaml"
    path.write_text(ACCELERATE_CP_YAML)
    cfg = ndp.ParallelismConfig.from_yaml(path)
    assert cfg.sizes == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 4, "tp": 1}
    assert (cfg.mixed_precision, cfg.activation_checkpointing) == ("bf16", "full")
    assert (cfg.reshard_after_forward, cfg.cpu_offload) == (False, False)
    offload = ACCELERATE_CP_YAML.replace("fsdp_offload_params: false", "fsdp_offload_params: true")
    assert ndp.ParallelismConfig.from_yaml(_write(tmp_path, offload)).cpu_offload is True


@pytest.mark.parametrize(
    "kind, sizes",
    [
        ("MULTI_CPU", {"dp_replicate": 4, "dp_shard": 1}),
        ("MULTI_GPU", {"dp_replicate": 4, "dp_shard": 1}),
        ("FSDP", {"dp_replicate": 1, "dp_shard": 4}),
    ],
)
def test_an_accelerate_yaml_without_sizes_is_accelerates_default_mesh(tmp_path, kind, sizes):
    # `accelerate config` for plain multi-process training writes no parallelism sizes: Accelerator() is then
    # data parallel (or FSDP) over every process, and num_processes must fit that.
    text = f"compute_environment: LOCAL_MACHINE\ndistributed_type: {kind}\nmixed_precision: 'no'\nnum_processes: 4\n"
    cfg = ndp.ParallelismConfig.from_yaml(_write(tmp_path, text)).resolve(4)
    assert {k: cfg.sizes[k] for k in sizes} == sizes and cfg.mixed_precision == "no"
    single = ndp.ParallelismConfig.from_yaml(_write(tmp_path, text.replace(kind, "'NO'").replace("4", "1")))
    assert single.resolve(1).world_size == 1


def _write(tmp_path, text: str):
    path = tmp_path / "variant.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("fsdp_version: 2", "fsdp_version: 1", "fsdp_version=1 is not supported: ndparallel shards with FSDP2 only"),
        ("distributed_type: FSDP", "distributed_type: DEEPSPEED", "distributed_type='DEEPSPEED'"),
        ("fsdp_state_dict_type: SHARDED_STATE_DICT", "fsdp_state_dict_type: FULL_STATE_DICT", "save_model"),
        ("fsdp_cpu_ram_efficient_loading: false", "fsdp_cpu_ram_efficient_loading: true", "load_pretrained"),
        ("mixed_precision: bf16", "mixed_precision: fp8", "fp8 is not supported"),
        ("debug: false", "debug: false\nmegatron_lm_config: {}", "megatron_lm_config has no ndparallel meaning"),
        ("  fsdp_version: 2", "  fsdp_version: 2\n  fsdp_min_num_params: 100", "fsdp_config.fsdp_min_num_params"),
        ("num_processes: 8", "num_processes: 6", "num_processes=6 does not match"),
        ("fsdp_activation_checkpointing: true", "fsdp_activation_checkpointing: 1", "must be true or false"),
    ],
)
def test_accelerate_yaml_keys_without_meaning_are_refused_by_name(tmp_path, old, new, message):
    assert old in ACCELERATE_CP_YAML
    with pytest.raises(ConfigError, match=message):
        ndp.ParallelismConfig.from_yaml(_write(tmp_path, ACCELERATE_CP_YAML.replace(old, new)))


# --------------------------------------------------------------------------------- constructor


def test_accelerate_keywords(single_process, tmp_path):
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", state_dict_type="SHARDED_STATE_DICT",
        activation_checkpointing=True, reshard_after_forward=False,
    )  # fmt: skip
    acc = Accelerator(
        parallelism_config=ndp.ParallelismConfig(),
        mixed_precision="bf16",
        gradient_accumulation_steps=2,
        log_with=["jsonl"],
        project_dir=tmp_path,
        fsdp_plugin=plugin,
        device_placement=True,  # Accelerate's default: accepted
        split_batches=False,
        cpu=True,
    )
    cfg = acc.parallelism_config
    assert (cfg.activation_checkpointing, cfg.reshard_after_forward, acc.mixed_precision) == ("full", False, "bf16")
    assert acc.gradient_accumulation_steps == 2 and acc.device == torch.device("cpu")
    assert acc.torch_device_mesh["dp_cp"].size() == 1 and acc.num_processes == 1 and acc.is_main_process
    assert acc.logging_dir == str(tmp_path) and acc.is_local_main_process


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"log_with": "nonsense"}, ConfigError, "not a tracker"),
        ({"log_with": "jsonl"}, ConfigError, "project_dir"),
        ({"mixed_precision": "fp8"}, ConfigError, "fp8"),
        ({"mixed_precision": "fp16"}, ConfigError, "loss scaler"),  # no FSDP on one process: autocast fp16
        ({"dynamo_backend": "inductor"}, ConfigError, "compile="),
        ({"dataloader_config": DataLoaderConfiguration(use_stateful_dataloader=True)}, ConfigError, "skip_first"),
        (
            {"dataloader_config": DataLoaderConfiguration(even_batches=False), "even_batches": True},
            ConfigError,
            "disagree",
        ),
        ({"kwargs_handlers": [DistributedDataParallelKwargs(comm_hook="fp16")]}, ConfigError, "comm_hook='fp16'"),
        ({"kwargs_handlers": [InitProcessGroupKwargs(init_method="tcp://x")]}, ConfigError, "init_method"),
        ({"kwargs_handlers": [object()]}, ConfigError, "kwargs_handlers: object is not supported"),
        ({"rng_types": ["xla"]}, ConfigError, "rng_types=\\['xla'\\]"),
        (
            {"gradient_accumulation_plugin": GradientAccumulationPlugin(num_steps=2), "gradient_accumulation_steps": 2},
            ConfigError,
            "not both",
        ),
        ({"deepspeed_plugin": object()}, ConfigError, "DeepSpeed has no ndparallel equivalent"),
        ({"fsdp_plugin": "x", "no_such_keyword": 1}, TypeError, "no_such_keyword"),
        ({"gradient_accumulation_steps": 0}, ConfigError, "gradient_accumulation_steps"),
        (
            {"parallelism_config": ndp.ParallelismConfig(mixed_precision="fp16"), "mixed_precision": "bf16"},
            ConfigError,
            "conflicts",
        ),
    ],
)
def test_accelerate_keywords_refused_by_name(single_process, kwargs, error, message):
    with pytest.raises(error, match=message):
        Accelerator(**kwargs)


def test_data_settings_are_read_from_the_configuration_or_the_keywords(single_process):
    config = DataLoaderConfiguration(split_batches=True, even_batches=False, non_blocking=True)
    acc = Accelerator(dataloader_config=config, use_seedable_sampler=False)
    assert (acc.split_batches, acc.even_batches, acc.non_blocking, acc.use_seedable_sampler) == (
        True,
        False,
        True,
        False,
    )
    assert Accelerator(use_seedable_sampler=True).dataloader_config.use_seedable_sampler


def test_fsdp_plugin_refusals():
    with pytest.raises(ConfigError, match="fsdp_version=1"):
        FullyShardedDataParallelPlugin(fsdp_version=1)
    with pytest.raises(ConfigError, match="size-based"):
        FullyShardedDataParallelPlugin(auto_wrap_policy="size_based_wrap")
    with pytest.raises(ConfigError, match="Accelerator\\(mixed_precision="):
        FullyShardedDataParallelPlugin(mixed_precision_policy={"param_dtype": "bf16"})


# ------------------------------------------------------------------------------- mixed precision


def _tiny():
    torch.manual_seed(0)
    return ndp.models.Transformer(ndp.models.TransformerConfig.from_preset("tiny"))


def test_mixed_precision_autocasts_where_fsdp_does_not_cast(single_process):
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    plain = _tiny()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # what the Accelerator must do: plain PyTorch autocast
        expected = plain(tokens).float()
    acc = Accelerator(mixed_precision="bf16", device_type="cpu")
    model = acc.prepare(_tiny())
    seen = []
    model.layers[0].attention.wq.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    logits = model(tokens)
    assert seen == [torch.bfloat16] and logits.dtype == torch.float32  # bf16 compute, fp32 outputs
    assert torch.equal(logits, expected)
    with acc.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    acc.unwrap_model(model, keep_fp32_wrapper=False)  # in place, as Accelerate does
    model(tokens)
    assert seen[-1] == torch.float32
    plain_acc = Accelerator(device_type="cpu")
    with plain_acc.autocast():
        assert not torch.is_autocast_enabled("cpu")


# ------------------------------------------------------------------------- stepping and loaders


def test_optimizer_and_scheduler_step_only_when_gradients_sync(single_process):
    """Accelerate's pattern (step and zero_grad on every micro-batch) equals plain accumulation."""
    data = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    plain = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for start in (0, 4):  # two optimizer steps of two micro-batches of two samples
        for offset in (0, 2):
            (plain(data[start + offset : start + offset + 2]).pow(2).mean() / 2).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    acc = Accelerator(gradient_accumulation_steps=2, device_type="cpu")
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    sched = acc.prepare(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))  # after prepare too
    syncs = []
    for micro in range(4):
        with acc.accumulate(model):
            acc.backward(model(data[2 * micro : 2 * micro + 2]).pow(2).mean())
            opt.step()
            sched.step()
            opt.zero_grad()
            syncs.append(acc.sync_gradients)
    assert syncs == [False, True, False, True]
    assert torch.equal(model.weight, plain.weight) and torch.equal(model.bias, plain.bias)
    assert sched.get_last_lr() == scheduler.get_last_lr() == [0.025]


def test_prepared_loader_syncs_at_its_end_and_skips_batches(single_process):
    acc = Accelerator(gradient_accumulation_steps=3, device_type="cpu")
    dataset = TensorDataset(torch.arange(16))
    loader = acc.prepare(DataLoader(dataset, batch_size=2, shuffle=True))
    syncs = []
    for _ in loader:  # 8 batches: Accelerate syncs every 3rd and on the last one, then starts counting again
        with acc.accumulate():
            syncs.append(acc.sync_gradients)
    assert syncs == [False, False, True, False, False, True, False, True]
    assert not acc.gradient_state.end_of_dataloader and not acc.gradient_state.in_dataloader

    acc = Accelerator(gradient_accumulation_steps=3, device_type="cpu", use_seedable_sampler=True)
    reference = acc.prepare(DataLoader(dataset, batch_size=2, shuffle=True))
    epochs = [[b.tolist() for (b,) in reference] for _ in range(2)]
    fresh = acc.prepare(DataLoader(dataset, batch_size=2, shuffle=True))
    skipped = acc.skip_first_batches(fresh, num_batches=3)
    assert [b.tolist() for (b,) in skipped] == epochs[0][3:]  # the rest of the first epoch
    assert [b.tolist() for (b,) in fresh] == epochs[1]  # then the loader itself goes on with epoch 2
    plain = ndp.accelerator.skip_first_batches(DataLoader(dataset, batch_size=4), 2)
    assert [b.tolist() for (b,) in plain] == [[8, 9, 10, 11], [12, 13, 14, 15]]


# --------------------------------------------------------------------------------------- trackers


def test_jsonl_and_tensorboard_trackers(single_process, tmp_path):
    acc = Accelerator(log_with=["jsonl", "tensorboard"], project_dir=tmp_path, device_type="cpu")
    acc.init_trackers("run", config={"lr": 0.1})
    acc.log({"loss": torch.tensor(1.5), "note": "ok"}, step=3)
    acc.log({"loss": 0.5})
    assert acc.get_tracker("jsonl").name == "jsonl"
    with pytest.raises(ConfigError, match="must be an int, float, str"):
        acc.log({"loss": [1, 2]})
    acc.end_training()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 3, "loss": 1.5, "note": "ok"}, {"loss": 0.5}]
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"lr": 0.1}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")][0] == (3, 1.5)


def test_trackers_without_ndparallel_integration_are_skipped_with_a_warning(single_process):
    # Accelerate skips a tracker whose package is absent; ndparallel has no wandb/mlflow/... tracker at all.
    tracker = _ListTracker()
    with pytest.warns(UserWarning, match="this tracker is skipped") as caught:
        acc = Accelerator(log_with=["wandb", tracker, "MLflow"], device_type="cpu")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and "log_with='wandb'): ndparallel has no wandb tracker" in messages[0]
    assert "no mlflow tracker" in messages[1]
    acc.init_trackers("run")
    acc.log({"x": 1.0})
    assert acc.trackers == [tracker] and tracker.records == [(None, {"x": 1.0})]


class _ListTracker:
    name = "list"

    def __init__(self):
        self.records, self.finished = [], False

    def store_init_configuration(self, values):
        self.records.append(("config", values))

    def log(self, values, step=None, **kwargs):
        self.records.append((step, values))

    def finish(self):
        self.finished = True


def test_custom_tracker_object(single_process):
    tracker = _ListTracker()
    acc = Accelerator(log_with=tracker, device_type="cpu")
    acc.init_trackers("run", config={"a": 1})
    acc.log({"x": 1}, step=2)
    acc.end_training()
    assert tracker.records == [("config", {"a": 1}), (2, {"x": 1})] and tracker.finished


# ----------------------------------------------------------------------------------------- saving


def test_save_model_shards_and_hf_save_pretrained(single_process, tmp_path):
    acc = Accelerator(device_type="cpu")
    model = acc.prepare(_tiny())
    acc.save_model(model, tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    files = sorted({f for f in index["weight_map"].values()})
    assert len(files) > 1 and all((tmp_path / "sharded" / f).is_file() for f in files)
    from safetensors.torch import load_file

    loaded = {k: v for f in files for k, v in load_file(tmp_path / "sharded" / f).items()}
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ConfigError, match="max_shard_size"):
        acc.save_model(model, tmp_path / "x", max_shard_size="lots")

    transformers = pytest.importorskip("transformers", reason="the HF half needs the hf extra")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=64
    )
    hf = acc.prepare(transformers.AutoModelForCausalLM.from_config(config))
    hf.save_pretrained(tmp_path / "hf")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert all(torch.equal(again.state_dict()[k], v) for k, v in hf.state_dict().items())
    with pytest.raises(ConfigError, match="ndparallel.hf.save_pretrained"):
        hf.save_pretrained(tmp_path / "hf2", state_dict={})


def test_accelerate_import_paths():
    # `from accelerate.utils import ...` / `from accelerate.parallelism_config import ...` change their package only.
    from ndparallel.parallelism_config import ParallelismConfig
    from ndparallel.utils import FullyShardedDataParallelPlugin as Plugin
    from ndparallel.utils import set_seed

    assert ParallelismConfig is ndp.ParallelismConfig and set_seed is ndp.set_seed
    assert Plugin is FullyShardedDataParallelPlugin


def test_from_pretrained_tp_keywords_for_an_ndparallel_mesh_are_served_or_refused_by_name(single_process):
    # from_pretrained(tp_plan="auto", tp_size=, device_mesh=accelerator.torch_device_mesh): prepare() applies the plan
    from ndparallel.accelerator.hf_load import strip_tp_kwargs

    acc = Accelerator(device_type="cpu")
    mesh = acc.torch_device_mesh
    kept = strip_tp_kwargs({"tp_plan": "auto", "tp_size": 1, "device_mesh": mesh, "use_cache": False})
    assert kept == {"use_cache": False}
    for kwargs, message in (
        ({"tp_plan": {"x": "colwise"}}, "prepare\\(\\) applies ndparallel's plan"),
        ({"tp_plan": "auto", "tp_size": 2}, "tp_size=2.*mesh has tp_size=1"),
        ({"distributed_config": object()}, "drop distributed_config"),
    ):
        with pytest.raises(ConfigError, match=message):
            strip_tp_kwargs({**kwargs, "device_mesh": mesh})
