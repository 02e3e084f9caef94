"""Hostile use of the Accelerator (issue 27): a read-only project_dir, an optimizer over another model's
parameters (or only some of them), and a second prepare() of one model. Each is a one-line ConfigError on
every rank, raised before anything changes; all checks run in one spawned group of 2 real gloo ranks."""

from __future__ import annotations

from pathlib import Path

from ndparallel.testing import run_distributed
from tests.train.test_train_checkpoints import _read_only


def _refusal(make) -> str:
    """The ConfigError ``make()`` raises, as text (fails the test if it raises nothing or something else)."""
    from ndparallel.errors import ConfigError

    try:
        make()
    except ConfigError as err:
        return str(err)
    raise AssertionError("no ConfigError raised")


def _hostile(read_only: str, under_a_file: str) -> dict:
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import ndparallel as ndp
    from ndparallel.accelerator import Accelerator
    from ndparallel.models import Transformer, TransformerConfig

    cfg = ndp.ParallelismConfig(dp_shard_size=2)
    out: dict = {}
    for tracker in ("jsonl", "tensorboard"):
        for name, folder in (("read-only", read_only), ("under-a-file", under_a_file)):
            make = lambda: Accelerator(cfg, device_type="cpu", log_with=tracker, project_dir=folder)  # noqa: B023, E731
            out[f"{tracker} {name}"] = _refusal(make)

    acc = Accelerator(cfg, device_type="cpu")

    def tiny():
        torch.manual_seed(0)
        return Transformer(TransformerConfig.from_preset("tiny"))

    model_a, model_b = tiny(), tiny()
    out["foreign"] = _refusal(lambda: acc.prepare(model_a, torch.optim.AdamW(model_b.parameters())))
    mixed = [*model_a.parameters()][:2] + [*model_b.parameters()][:1]
    out["mixed"] = _refusal(lambda: acc.prepare(model_a, torch.optim.AdamW(mixed)))
    out["model_a untouched"] = not any(isinstance(p, DTensor) for p in model_a.parameters())

    with warnings.catch_warnings(record=True) as caught:  # a subset of a model's trainable parameters: a warning
        warnings.simplefilter("always")
        head = torch.optim.AdamW(model_a.output.parameters())
        prepared, head = acc.prepare(model_a, head)
    out["subset warnings"] = [str(w.message) for w in caught if "in no prepared optimizer" in str(w.message)]
    before = {n: p.full_tensor().clone() for n, p in prepared.named_parameters()}
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    ndp.cross_entropy_loss(prepared(ids[:, :-1]), ids[:, 1:]).backward()
    head.step()
    out["changed"] = sorted(n for n, p in prepared.named_parameters() if not torch.equal(p.full_tensor(), before[n]))

    out["again"] = _refusal(lambda: acc.prepare(prepared))
    out["again plain"] = _refusal(lambda: acc.prepare(model_a))  # the same object: parallelize works in place
    model_c = tiny()
    later = acc.prepare(model_c)  # an optimizer built from a model an earlier prepare() returned is accepted
    acc.prepare(torch.optim.AdamW(later.parameters()))
    return out


def test_hostile_accelerator_use_is_refused_by_name_on_every_rank(tmp_path: Path):
    (tmp_path / "a-file").write_text("not a folder")
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    with _read_only(read_only):
        results = run_distributed(_hostile, 2, str(read_only), str(tmp_path / "a-file" / "logs"), timeout=240)
    for out in results:
        for tracker in ("jsonl", "tensorboard"):
            for name in ("read-only", "under-a-file"):
                message = out[f"{tracker} {name}"]
                assert message.startswith("Accelerator(log_with=...) cannot write its logs: rank 0 of 2: project_dir=")
                assert "is not writable" in message and "pick a folder you can write to" in message, message
                assert "\n" not in message
        assert out["foreign"].startswith(
            "the optimizer holds none of the prepared model's parameters; build it from the model you pass to prepare()"
        ), out["foreign"]
        assert out["mixed"].startswith("1 of the optimizer's 3 parameters"), out["mixed"]
        assert out["model_a untouched"]
        [warning] = out["subset warnings"]
        assert warning.startswith("20 trainable parameters of the prepared Transformer are in no prepared optimizer"), (
            warning
        )
        assert out["changed"] == ["output.weight"], out["changed"]
        for key in ("again", "again plain"):
            assert "was already prepared: call prepare once per model" in out[key], out[key]
    assert not any(read_only.iterdir())
