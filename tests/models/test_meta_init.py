"""A reference Transformer built on the meta device, parallelised, then ``to_empty`` + ``init_weights()`` holds
exactly the values one process's ``init_weights()`` gives: each DTensor parameter draws its full tensor from its
per-name generator and keeps its own region. DTensor's own random ops drew other values (0.12 off on FSDP 2,
silently), so the check can fail. One spawned group of 2 ranks: FSDP 2, TP 2, and the MoE under ep 2 and under TP 2.
"""

from __future__ import annotations

import torch

from ndparallel.testing import run_distributed

LAYOUTS = {
    "fsdp2": ("tiny", {"dp_shard_size": 2}),
    "tp2": ("tiny", {"tp_size": 2}),
    "ep2": ("tiny-moe", {"dp_shard_size": 2, "ep_size": 2}),
    "moe tp2": ("tiny-moe", {"tp_size": 2}),  # experts' hidden width and shared experts split over tp
}


def _worst_difference() -> dict[str, float]:
    import ndparallel as ndp
    from ndparallel.models import Transformer, TransformerConfig

    worst = {}
    for label, (preset, sizes) in LAYOUTS.items():
        cfg = TransformerConfig.from_preset(preset)
        reference = Transformer(cfg)
        reference.init_weights()
        mesh = ndp.init_distributed(ndp.ParallelismConfig(**sizes))
        with torch.device("meta"):
            model = Transformer(cfg)
        model = ndp.parallelize(model, mesh.config, mesh)
        model.to_empty(device="cpu")
        model.init_weights()
        expected = dict(reference.named_parameters())
        diffs = [float((p.full_tensor() - expected[n]).abs().max()) for n, p in model.named_parameters()]
        worst[label] = max(diffs)
    return worst


def test_meta_models_initialise_to_one_process_values_on_every_layout():
    for rank, worst in enumerate(run_distributed(_worst_difference, 2, timeout=300)):
        assert worst == dict.fromkeys(LAYOUTS, 0.0), (rank, worst)
