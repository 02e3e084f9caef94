"""The one FQN-pattern meaning (ndparallel.parallel.fqn) and the model-family registry (ndparallel.parallel.family)."""

from __future__ import annotations

import pytest
import torch

from ndparallel.errors import ConfigError
from ndparallel.models import Transformer, TransformerConfig
from ndparallel.parallel.fqn import first_match, fqn_matches, matching_modules


@pytest.mark.parametrize(
    ("fqn", "pattern", "expected"),
    [
        ("layers.0.attention", "layers.*.attention", True),
        ("layers.11.attention", "layers.*.attention", True),
        ("layers.0.block.attention", "layers.*.attention", False),  # `*` never crosses a dot
        ("layers.0", "layers.*.attention", False),
        ("layers.0.attention.core_attention", "*core_attention", False),
        ("layers.3.feed_forward.w1", "layers.*.feed_forward.w[13]", True),
        ("layers.3.feed_forward.w2", "layers.*.feed_forward.w[13]", False),
        ("norm", "norm", True),
        ("Norm", "norm", False),  # case-sensitive
        ("layers.0.attention_norm", "layers.?.attention_norm", True),
        ("", "*", False),  # the root matches no pattern
    ],
)
def test_fqn_pattern_meaning(fqn: str, pattern: str, expected: bool) -> None:
    assert fqn_matches(fqn, pattern) is expected


def test_reference_plan_patterns_match_one_module_per_layer() -> None:
    from ndparallel.models.transformer.family import transformer_tp_plan

    with torch.device("meta"):
        model = Transformer(TransformerConfig.from_preset("tiny", n_layers=3))
    plan = transformer_tp_plan()
    for pattern in plan:
        names = [name for name, _ in matching_modules(model, pattern)]
        expected = [pattern.replace("*", str(i)) for i in range(3)] if "*" in pattern else [pattern]
        assert names == expected, pattern
    assert first_match("layers.2.attention.wq", plan) is plan["layers.*.attention.wq"]
    assert first_match("layers.2.attention.core_attention", plan) is None


# ----------------------------------------------------------------------------------------------- registry


class _DuckHFModel(torch.nn.Module):
    """Looks like a transformers PreTrainedModel to the HF family (config.model_type, base_model_prefix)."""

    base_model_prefix = "model"

    def __init__(self) -> None:
        super().__init__()
        self.config = type("Config", (), {"model_type": "llama"})()


class Trunk(torch.nn.Module):
    """A model of a user's own: blocks in an nn.Sequential, its own attention-free MLP blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.trunk = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        self.head = torch.nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(self.embed(tokens)))


def _recording_family():
    from ndparallel.parallel.family import ModelFamily

    class Recording(ModelFamily):
        name = "recording"

        def __init__(self) -> None:
            self.asked: list[str] = []

        def matches(self, model):
            return isinstance(model, Trunk)

        def blocks(self, model):
            self.asked.append("blocks")
            return list(model.trunk)

        def check(self, model, cfg, mesh):
            self.asked.append(f"check tp={mesh.size('tp')}")

        def fsdp_groups(self, model):
            self.asked.append("fsdp_groups")
            return [["embed"]]

        def apply_attention(self, model, mesh, cfg):
            self.asked.append("apply_attention")
            return model

    return Recording()


def test_family_for_picks_registered_then_hugging_face_then_the_reference_default() -> None:
    from ndparallel.parallel.protocol import _REGISTERED, family_for, register_family

    with torch.device("meta"):
        reference = Transformer(TransformerConfig.from_preset("tiny"))
    assert family_for(reference).name == "transformer"
    assert family_for(_DuckHFModel()).name == "huggingface"
    assert family_for(Trunk()).name == "transformer", "a model no family claims gets the default"
    family = register_family(_recording_family())
    try:
        assert family_for(Trunk()) is family and family_for(reference).name == "transformer"
    finally:
        _REGISTERED.remove(family)
    assert family_for(Trunk()).name == "transformer"


def test_the_built_in_families_load_at_the_first_lookup_however_the_models_were_imported() -> None:
    """``import ndparallel.models`` no longer registers them (it stays free of DTensor), nor does importing the
    reference model's module; the lookup loads them first, in a fresh interpreter."""
    import subprocess
    import sys

    from tests.command import REPO, clean_env

    script = (
        "import sys\nimport ndparallel.models\n"
        "assert 'ndparallel.models.builtin' not in sys.modules, 'the package'\n"
        "from ndparallel.models.transformer.model import Transformer\n"
        "assert 'ndparallel.models.builtin' not in sys.modules, 'the model module'\n"
        "from ndparallel.models.transformer.presets import TransformerConfig\n"
        "from ndparallel.parallel.protocol import family_for, registered_families\n"
        "print([f.name for f in registered_families()])\n"
        "print(family_for(Transformer(TransformerConfig.from_preset('tiny'))).name)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, env=clean_env(), timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[:2] == ["['huggingface', 'transformer']", "transformer"]


def _parallelize_with_a_registered_family() -> dict:
    import ndparallel as ndp
    from ndparallel.parallel.protocol import _REGISTERED, register_family

    family = register_family(_recording_family())
    try:
        cfg = ndp.ParallelismConfig(activation_checkpointing="full")
        model = ndp.parallelize(Trunk(), cfg, ndp.init_distributed(cfg))
        explicit = ndp.parallelize(Trunk(), cfg, ndp.init_distributed(cfg), blocks=["trunk.1"])
    finally:
        _REGISTERED.remove(family)
    checkpointed = [[getattr(m, "_ndp_checkpointed", False) for m in x.trunk] for x in (model, explicit)]
    return {"asked": family.asked, "checkpointed": checkpointed}


def test_parallelize_asks_the_registered_family_and_explicit_arguments_override_it() -> None:
    import torch.distributed as dist

    from ndparallel.distributed.process import destroy_distributed

    assert not dist.is_initialized()
    try:  # one process (world size 1, in this process: no spawn), torn down after
        out = _parallelize_with_a_registered_family()
    finally:
        destroy_distributed()
    assert out["asked"] == ["blocks", "check tp=1", "fsdp_groups", "apply_attention"] + [
        "check tp=1",
        "fsdp_groups",
        "apply_attention",
    ]  # blocks= given the second time: the family is not asked for them
    assert out["checkpointed"] == [[True, True], [False, True]]


# ------------------------------------------------------------------------------------ what the jobs ask


def test_the_jobs_ask_the_family_for_router_statistics_the_fused_loss_and_prepare() -> None:
    """TrainStep and the Accelerator ask family_for(model) (docs/parallelize.md#model-families): the reference
    family walks its Routers, Hugging Face's routers keep no counts and its prepared models get save_pretrained."""
    from ndparallel.parallel.protocol import FamilyProtocol, family_for

    torch.manual_seed(0)
    model = Transformer(TransformerConfig.from_preset("tiny-moe", router="sigmoid", dtype="float64"))
    family = family_for(model)
    model(torch.randint(0, 256, (2, 8)))
    loads = family.router_loads(model)
    assert len(loads) == model.config.n_layers and all(float(load.sum()) == 2 * 8 * 2 for load in loads)
    assert family.nonfinite_routers(model) == [] and family.loss_in_forward(model) is False
    family.update_router_biases(model, 0.1)
    router = model.layers[0].feed_forward.router
    torch.testing.assert_close(router.expert_bias, 0.1 * torch.sign(loads[0].mean() - loads[0]))
    assert all(float(load.sum()) == 0 for load in family.router_loads(model)), "the counts are reset"

    hf = family_for(_DuckHFModel())
    assert hf.router_loads(model) == [] and hf.nonfinite_routers(model) == []
    duck = _DuckHFModel()
    hf.on_prepared(duck)
    assert callable(duck.save_pretrained), "a prepared Hugging Face model saves through ndparallel.hf.save_pretrained"
    generic = FamilyProtocol()
    generic.on_prepared(model)
    assert not hasattr(model, "save_pretrained") and generic.unreadable_weights("/nonexistent") is None
    with pytest.raises(ConfigError, match="no pretrained folder format"):
        generic.save_pretrained(model, "/nonexistent")
