"""The compiled loss head (final norm + output projection + cross-entropy in one graph) against eager.

One process, CPU: inductor compiles the head once per dtype (a few minutes on a loaded 2-core machine, so
``slow``). Measured: float64 loss and gradients equal to 1e-15; fp32 within 1e-7 (inductor's fused kernels
round differently from eager; only float64 is run here, each dtype is an inductor build).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ndparallel.parallel.compile import compiled_loss_head, loss_head
from ndparallel.testing import run_distributed


@pytest.mark.slow
def test_compiled_head_matches_eager(dtype=torch.float64, tol=1e-12):
    # float64 only: each dtype is one more inductor build (tens of seconds); fp32's bound is in docs/planning.md.
    torch.manual_seed(0)
    norm, output = nn.RMSNorm(32, dtype=dtype), nn.Linear(32, 50, bias=False, dtype=dtype)
    h = torch.randn(2, 8, 32, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 50, (2, 8))
    leaves = [h, output.weight, norm.weight]
    ref = loss_head(norm, output)(h, labels)
    got = compiled_loss_head(norm, output)(h, labels)
    assert got.dtype == dtype and abs(got.item() - ref.item()) <= tol
    for a, b in zip(torch.autograd.grad(ref, leaves), torch.autograd.grad(got, leaves), strict=True):
        assert (a - b).abs().max().item() <= tol


def _refuses_tensor_parallel_output() -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ndparallel.errors import ConfigError

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    norm, output = nn.RMSNorm(8), nn.Linear(8, 6, bias=False)
    output.weight = nn.Parameter(distribute_tensor(output.weight.detach(), mesh, [Shard(0)]))
    try:
        compiled_loss_head(norm, output)
    except ConfigError as err:
        return str(err)
    return ""


def test_compiled_head_refuses_tensor_parallel_output():
    for message in run_distributed(_refuses_tensor_parallel_output, 2):
        assert message.startswith("compiled_loss_head: the output projection is tensor-parallel")
