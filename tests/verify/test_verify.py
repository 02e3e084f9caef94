"""ndparallel.verify: layouts, bad input, tolerances, the verdict table, --shrink, and planted faults it must name.

Spawned groups of 2 gloo ranks (plus the --localize re-runs): a correct user model with its TP plan passes in
float64 at 1e-10 and pp is refused by name; the same model with two planted faults (a per-rank mean, a TP plan
entry that leaves partial sums un-reduced) fails, and --localize names each planted module; an attention model
with the other two (a norm left replicated on a tp-sharded activation, a rotary that ignores the positions
under cp) likewise; the 70b preset, refused as too big, runs with --shrink and says so.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ndparallel.errors import ConfigError
from ndparallel.verify import Layout, Row, VerifyTable, auto_layouts, fold, parse_layouts, verify
from ndparallel.verify.api import _float64_tolerance, reshard_divergence
from ndparallel.verify.compare import compare, describe_shrink, float64_tolerance, tolerance_for
from ndparallel.verify.layouts import parse_reshards
from ndparallel.verify.localize import _piece
from ndparallel.verify.model import check_fits_in_memory, model_spec
from ndparallel.verify.run import Settings, Trace, reference

TOY = "tests.verify.toy"


def test_auto_layouts_are_every_dimension_alone_then_pairs_that_fit():
    singles = ["dp_shard=2", "dp_replicate=2", "tp=2", "cp=2", "pp=2"]
    assert [layout.name for layout in auto_layouts(2)] == singles
    four = [layout.name for layout in auto_layouts(4)]
    assert four[:5] == singles and "dp_shard=2,tp=2" in four and all(layout.ranks <= 4 for layout in auto_layouts(4))
    moe = [layout.name for layout in auto_layouts(4, experts=True)]  # a mixture of experts also spreads them
    assert set(moe) - set(four) == {"dp_shard=2,ep=2", "dp_shard=2,tp=2,ep=2", "dp_shard=2,cp=2,ep=2"}
    assert [layout.name for layout in auto_layouts(2, experts=True)] == [*singles, "dp_shard=2,ep=2"]
    assert [layout.name for layout in parse_layouts("dp_shard=2;tp_size=2; tp=2,dp_shard=2", 4)] == [
        "dp_shard=2",
        "tp=2",
        "dp_shard=2,tp=2",
    ]
    assert fold({"dp_shard": 64, "tp": 8, "pp": 4}, 4) == Layout.of({"dp_shard": 2, "tp": 2})
    assert fold({"dp_shard": 8, "ep": 4}, 4) == Layout.of({"dp_shard": 2, "ep": 2})  # ep kept: it adds no rank
    assert fold({"tp": 8, "ep": 4}, 4) == Layout.of({"tp": 2})  # nothing to borrow from
    assert [layout.name for layout in parse_layouts("from:configs/3d.yaml;pp=2", 4)] == ["dp_shard=2,tp=2", "pp=2"]


@pytest.mark.parametrize(
    "text, cause",
    [
        ("tp=8", "needs 8 ranks but --cpu-ranks is 4"),
        ("ep=2", "ep borrows its ranks from dp_shard x cp, which this layout leaves at 1"),
        ("moe=2", "dimension 'moe' is unknown"),
        ("tp", "expected dim=size"),
        ("tp=1", "uses one rank"),
        (";", "names no layout"),
        ("from:no/such.yaml", "does not exist"),
    ],
)
def test_bad_layouts_are_one_line(text, cause):
    with pytest.raises(ConfigError, match=cause) as err:
        parse_layouts(text, 4)
    assert "\n" not in str(err.value)


def test_reshard_pairs_parse_and_bad_ones_are_one_line():
    assert parse_reshards("dp_shard=2>tp=2; tp=2 > dp_shard=2,tp=2", 4) == [
        (Layout.of({"dp_shard": 2}), Layout.of({"tp": 2})),
        (Layout.of({"tp": 2}), Layout.of({"dp_shard": 2, "tp": 2})),
    ]
    for text, cause in [("tp=2", "expected A>B"), ("tp=2>tp=2", "reshards nothing"), ("tp=2>tp=8", "needs 8 ranks")]:
        with pytest.raises(ConfigError, match=cause):
            parse_reshards(text, 4)
    with pytest.raises(ConfigError, match="use --steps >= 2"):
        verify("tiny", "tp=2", steps=1, reshard="tp=2>dp_shard=2", cpu_ranks=2)


@pytest.mark.parametrize(
    "model, cause",
    [
        (f"{TOY}:build_failing", "the factory failed: RuntimeError: weights file missing"),
        (f"{TOY}:build_flat", "has no nn.ModuleList of blocks"),
        (f"{TOY}:nothing", "has no attribute 'nothing'"),
        ("no_such_module_xyz:build", "cannot import 'no_such_module_xyz'"),
        (f"{TOY}:VOCAB", "not a callable"),
        ("gigantic", "no preset"),
    ],
)
def test_bad_models_are_one_line(model, cause):
    with pytest.raises(ConfigError, match=cause) as err:
        model_spec(model).build()
    assert "\n" not in str(err.value)


def test_config_json_without_model_type_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ConfigError, match="has no model_type"):
        model_spec(str(tmp_path))
    with pytest.raises(ConfigError, match="no .*config.json"):
        model_spec(str(tmp_path / "missing.json"))


def test_dropout_left_on_is_refused_naming_the_module():
    """Checked before any rank starts: the reference's forward twice under two RNG states."""
    with pytest.raises(ConfigError, match=r"layers\.1\.drop gives a different output.*dropout p=0"):
        verify(f"{TOY}:build_with_dropout", "dp_shard=2", cpu_ranks=2)


def test_float64_floor_of_a_model_that_sums_in_fp32_inside():
    """A float64 model whose head computes in fp32 has a floor of ~1e-8: the tolerance follows it (10x); a
    plain float64 model keeps 1e-10; a floor beyond fp32 round-off is a split-dependent model: kept at 1e-10."""
    settings = Settings()
    spec = model_spec(f"{TOY}:build_fp32_inside")
    tol = _float64_tolerance(spec, settings, reference(spec, settings), [], lambda line: None)
    assert 1e-10 < tol.loss < 1e-5 and "10x the model's own float64 floor" in tol.source
    assert float64_tolerance(1e-15).loss == 1e-10 and "model floor 1.0e-15" in float64_tolerance(1e-15).source
    split = float64_tolerance(5e-3)
    assert split.loss == 1e-10 and "depends on how the batch is split" in split.source


def test_fp32_and_bf16_use_only_measured_bounds():
    tp, fsdp = Layout.of({"tp": 2}), Layout.of({"dp_shard": 2})
    fp32 = tolerance_for("float32", tp)
    assert (fp32.loss, fp32.grad_norm, fp32.grad, fp32.param) == (1e-4, 1e-4, 1e-6, None)
    assert "docs/verify.md#tolerances" in fp32.source
    assert tolerance_for("bf16", fsdp).loss == 2e-3 and "dp_shard 4" in tolerance_for("bf16", fsdp).source
    unmeasured = tolerance_for("bf16", tp)
    assert unmeasured.loss is None and "no measured bound" in unmeasured.source
    trace = Trace([1.0], [1.0], {"w": np.zeros(2)}, {"w": np.zeros(2)})
    assert compare(tp, trace, trace, unmeasured).verdict == "unjudged"
    assert compare(tp, trace, trace, fp32).verdict == "pass"


def test_table_verdicts_and_json(tmp_path):
    refused = Row("tp=2", 2, "refused", message="tp_size=2 does not divide n_heads=3")
    table = VerifyTable("m", "float64", 3, [refused])
    assert not table.ok and "refused: tp_size=2 does not divide n_heads=3" in table.format()
    assert "verdict: FAIL (every layout was refused)" in table.format()
    table.rows.append(Row("dp_shard=2", 2, "pass", dict.fromkeys(("loss", "grad_norm", "grad", "param"), 0.0)))
    assert table.ok
    table.rows.append(Row("cp=2", 2, "FAIL", dict.fromkeys(("loss", "grad_norm", "grad", "param"), float("inf"))))
    assert not table.ok
    table.write_json(tmp_path / "v.json")
    data = json.loads((tmp_path / "v.json").read_text())
    assert [r["verdict"] for r in data["rows"]] == ["refused", "pass", "FAIL"] and data["ok"] is False


def test_a_rank_piece_maps_onto_the_reference_under_dp_cp_and_tp():
    """--localize compares each rank's output with its piece of the reference: dp rows, cp head-tail positions."""
    from ndparallel.parallel.context_parallel import shard_sequence

    settings = Settings(batch=4, seq=16)
    layout = Layout.of({"dp_shard": 2, "cp": 2, "tp": 2})
    ref = np.random.default_rng(0).standard_normal((4, 16, 8))
    coord = {"dp": 1, "cp": 1, "tp": 1}
    rows = torch.from_numpy(ref[2:4])
    local = shard_sequence(rows, 1, 2, 1, True)[..., 4:8].numpy()  # dp rank 1, cp rank 1, tp rank 1's columns
    np.testing.assert_array_equal(_piece(ref, local.shape, layout, coord, settings), local)
    assert _piece(ref, (3, 16, 8), layout, coord, settings) is None  # not a shard of anything: not compared


def test_correct_user_model_passes_and_pp_is_refused():
    """Also --reshard: tp=2 saves a DCP checkpoint after step 1 (in its own group), dp_replicate=2 loads it and
    trains steps 2-3 (one more group): equal to the uninterrupted reference; a pair onto a refused layout is
    refused, not failed."""
    table = verify(
        f"{TOY}:build",
        "dp_replicate=2;tp=2;pp=2",
        tp_plan=f"{TOY}:PLAN",
        cpu_ranks=2,
        reshard="tp=2>dp_replicate=2;dp_replicate=2>pp=2",
    )
    verdicts = {row.layout: row for row in table.rows}
    assert verdicts["dp_replicate=2"].verdict == "pass" and verdicts["tp=2"].verdict == "pass"
    assert max(verdicts["tp=2"].errors.values()) < 1e-12
    assert verdicts["pp=2"].verdict == "refused" and "pipeline" in verdicts["pp=2"].message
    resumed = verdicts["tp=2>dp_replicate=2"]
    assert resumed.verdict == "pass" and max(resumed.errors.values()) < 1e-12 and resumed.errors["param"] > 0
    assert verdicts["dp_replicate=2>pp=2"].verdict == "refused"
    assert table.ok


def test_planted_faults_fail_and_localize_names_the_module():
    """Fault 1: block 1 subtracts the mean of its rank's batch (per-rank instead of global): wrong under dp,
    right under tp. Fault 2: the TP plan leaves block 1's down projection with partial sums. The tp=2>dp_shard=2
    row (saved on tp, resumed on dp_shard) fails too and is localised on A, reusing A's localisation."""
    table = verify(
        f"{TOY}:build_centered",
        "dp_shard=2;tp=2",
        tp_plan=f"{TOY}:WRONG_PLAN",
        cpu_ranks=2,
        localize_failures=True,
        reshard="tp=2>dp_shard=2",
    )
    rows = {row.layout: row for row in table.rows}
    assert not table.ok and rows["dp_shard=2"].verdict == rows["tp=2"].verdict == "FAIL"
    assert rows["dp_shard=2"].localized["module"] == "layers.1.center"
    assert rows["dp_shard=2"].localized["mesh_dims"] == "dp_shard=2"
    assert rows["tp=2"].localized["module"] == "layers.1.down"
    assert rows["tp=2"].localized["tensor"] == "forward output" and rows["tp=2"].localized["relative_error"] > 1e-3
    pair = rows["tp=2>dp_shard=2"]
    assert pair.verdict == "FAIL" and (pair.localized["module"], pair.localized["layout"]) == ("layers.1.down", "tp=2")
    assert pair.localized["summary"].startswith("on tp=2: layers.1.down: forward output")


def test_a_reshard_row_whose_layouts_both_match_blames_the_checkpoint():
    a, b = Layout.of({"tp": 2}), Layout.of({"dp_shard": 2})
    clean = {"module": None, "summary": "no module beyond 1e-10 in one step (9 tensors compared, 0 not comparable)"}
    found = reshard_divergence(a, clean, b, {"module": "layers.0.up", "summary": "layers.0.up: gradient off"})
    assert (found["module"], found["layout"], found["summary"]) == (
        "layers.0.up",
        "dp_shard=2",
        "on dp_shard=2: layers.0.up: gradient off",
    )
    blamed = reshard_divergence(a, clean, b, clean)
    assert blamed["module"] is None and blamed["layout"] == "tp=2>dp_shard=2"
    assert "enters at the checkpoint, saved on tp=2 or loaded on dp_shard=2" in blamed["summary"]
    pp = Layout.of({"pp": 2})
    refused = {"module": None, "error": "pipeline layouts are not localised", "summary": "not localized: pipeline"}
    unproved = reshard_divergence(pp, refused, b, clean)
    assert unproved["module"] is None and unproved["summary"] == "pp=2: not localized: pipeline"


def test_planted_norm_and_positions_faults_fail_and_localize_names_the_module():
    """Fault 3 (tp): block 1's norm computes on its rank's tp shard of the sequence with a plain replicated
    weight: the forward is right, the weight's gradient misses the all-reduce over tp, so it is named through
    the gradient comparison. Fault 4 (cp): block 1's rotary numbers its own tokens 0..seq-1 instead of taking
    the global positions it is given. Each fault is inactive on the other layout, and everything before the
    named module (block 0's attention, ring attention included) matched: the control."""
    table = verify(
        f"{TOY}:build_attn_local_positions",
        "tp=2;cp=2",
        tp_plan=f"{TOY}:NORM_FAULT_PLAN",
        steps=2,
        cpu_ranks=2,
        localize_failures=True,
    )
    rows = {row.layout: row for row in table.rows}
    assert not table.ok and rows["tp=2"].verdict == rows["cp=2"].verdict == "FAIL"
    tp, cp = rows["tp=2"].localized, rows["cp=2"].localized
    assert (tp["module"], tp["tensor"], tp["mesh_dims"]) == ("layers.1.norm.weight", "gradient", "tp=2")
    assert (cp["module"], cp["tensor"], cp["mesh_dims"]) == ("layers.1.attention.rotary", "forward output", "cp=2")
    assert tp["relative_error"] > 1e-3 and cp["relative_error"] > 1e-3 and min(tp["compared"], cp["compared"]) > 10


def test_a_model_too_big_for_this_machine_is_refused_then_runs_shrunk():
    with pytest.raises(
        ConfigError, match=r"70b: 70554M parameters need .* GiB here .*verify a shrunk config.*--shrink"
    ):
        verify("70b", "tp=2", cpu_ranks=2)
    with pytest.raises(ConfigError, match="more than this machine's 0 GiB"):
        check_fits_in_memory(model_spec("tiny"), 2, memory=1000)
    lines: list[str] = []
    table = verify("70b", "tp=2", cpu_ranks=2, steps=2, shrink=True, reshard="pp=2>tp=2", progress=lines.append)
    assert table.ok and table.shrunk["n_layers"] == [80, 2] and table.shrunk["dim"] == [8192, 64]
    assert [row.layout for row in table.rows] == ["tp=2", "pp=2", "pp=2>tp=2"]  # A joins the layouts
    assert max(table.rows[2].errors.values()) < 1e-12  # saved from pipeline stages, loaded under tp
    assert "rope_theta" not in table.shrunk  # the architecture's other fields are kept
    assert any(line.startswith("verify: --shrink: the same architecture at tiny sizes: ") for line in lines)
    assert "shrunk (--shrink; the architecture kept, not the job's sizes): vocab_size 128256 -> 256" in table.format()
    assert table.to_dict()["shrunk"]["n_heads"] == [64, 8]


def test_shrink_keeps_an_hf_architecture_at_the_tiny_config_sizes(tmp_path):
    """A Llama-70B-shaped config.json: refused as too big (naming --shrink); shrunk by tiny_config's rule, its
    other fields (rope scaling, untied head) kept, the heads still divisible by tp=2."""
    transformers = pytest.importorskip("transformers")
    from ndparallel.hf import tiny_config

    rope = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192, "rope_theta": 5e5}
    rope |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    sizes = dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8)
    transformers.LlamaConfig(**sizes, intermediate_size=28672, vocab_size=128256, rope_parameters=rope).to_json_file(
        tmp_path / "config.json"
    )
    with pytest.raises(ConfigError, match="add --shrink"):
        check_fits_in_memory(model_spec(str(tmp_path)), 2)
    spec = model_spec(str(tmp_path), shrink=True)
    check_fits_in_memory(spec, 4)
    changes = spec.shrunk()
    assert changes["num_hidden_layers"] == (80, 2) and changes["hidden_size"] == (8192, 32)
    model = spec.build()
    config, tiny = model.config, tiny_config("llama")
    assert len(model.model.layers) == 2 and config.rope_parameters["rope_type"] == "llama3"
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert getattr(config, name) == getattr(tiny, name) and getattr(config, name) % 2 == 0
    assert "num_hidden_layers 80 -> 2" in describe_shrink(changes)
    with pytest.raises(ConfigError, match="--shrink applies to a preset or a Hugging Face config"):
        model_spec(f"{TOY}:build", shrink=True)


def test_a_layout_that_crashes_stops_its_group_without_a_hang():
    """A raw error (here a shape error from a broken plan) may leave a collective half done: the group stops,
    the next layout is reported as not run, and the run fails."""
    table = verify(f"{TOY}:build", "tp=2;dp_shard=2", tp_plan=f"{TOY}:BROKEN_PLAN", cpu_ranks=2)
    rows = {row.layout: row for row in table.rows}
    assert rows["tp=2"].verdict == "error" and "RuntimeError" in rows["tp=2"].message
    assert rows["dp_shard=2"].verdict == "error" and rows["dp_shard=2"].message.startswith("not run: tp=2 failed")
    assert not table.ok


def test_an_moe_is_verified_with_its_router_losses_and_ep_is_a_layout():
    """The loss verify trains on is what training adds: cross entropy + the MoE's aux losses (a per-rank aux
    loss would then fail verify). ``ep=2`` borrows its ranks from dp_shard (the layout still takes 2), with tp too."""
    from ndparallel.models import Transformer
    from ndparallel.parallel.loss import auxiliary_loss, cross_entropy_loss
    from ndparallel.verify.run import _plain_step

    spec = model_spec("tiny-moe")
    model = spec.build()
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = _plain_step(spec, model, None, 1, None)(tokens[:, :-1], tokens[:, 1:])
    assert isinstance(model, Transformer)
    expected = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]) + auxiliary_loss(model)
    assert abs(loss.item() - expected.item()) < 1e-12 and float(auxiliary_loss(model) or 0) == 0  # collected
    layout = parse_layouts("dp_shard=2,ep=2", 2)[0]
    assert layout.ranks == 2 and layout.parallelism() == {"dp_shard_size": 2, "ep_size": 2}
    table = verify("tiny-moe", "dp_shard=2,ep=2;dp_shard=2,tp=2,ep=2", cpu_ranks=4)  # experts over (ep, tp) too
    assert table.ok and all(max(row.errors.values()) < 1e-12 for row in table.rows), table.rows
