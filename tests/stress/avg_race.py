"""The gloo ``all_reduce(op=AVG)`` segfault, reduced to torch alone: a data race inside torch 2.13.

gloo has no AVG: ``ProcessGroupGloo`` sums, then divides the tensor in place in its worker thread
(``tensors[0] /= size``), which on a tensor that requires grad records autograd history from that thread
(``rebase_history``). Meanwhile the calling thread, right after the ``c10d::allreduce_`` kernel has queued the work,
runs autograd's fallback for an op without an autograd kernel ("warn" mode), which registers a hook on the same
tensor (``VariableHooks::_register_hook``). Neither is locked: when the worker wins (a loaded machine preempts the
caller), the caller faults. Core dump of the crash (the Accelerate example's loss average under ``make stress``):
``#4 torch::autograd::VariableHooks::_register_hook`` <- ``basicAutogradNotImplementedFallbackImpl`` <-
``c10d::ProcessGroup::allreduce``, every gloo worker idle (its division done).

The workaround: all-reduce a tensor without autograd history (``loss.detach()``, the same storage: the value is
averaged in place all the same), or SUM and divide. ``python tests/stress/avg_race.py ITERATIONS`` runs 2 gloo ranks
all-reducing a loss that requires grad with AVG; ``--detach`` the workaround. docs/troubleshooting.md.
"""

import sys

import torch
import torch.distributed as dist

from ndparallel.testing import run_distributed


def race(iterations: int, detach: bool) -> int:
    weight = torch.ones(4, requires_grad=True)
    for _ in range(iterations):
        loss = (weight * 2).sum()  # a loss with autograd history, as a training step's
        dist.all_reduce(loss.detach() if detach else loss, op=dist.ReduceOp.AVG)
    return iterations


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    print(run_distributed(race, 2, count, "--detach" in sys.argv, timeout=3600))
