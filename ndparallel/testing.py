"""Test your own code the way ndparallel tests its own: real gloo ranks on one machine, and the proof that a
model trains the same on any mesh as in one process.

``run_distributed(fn, world_size, *args)`` runs ``fn`` on N real gloo ranks and returns what each rank
returned (its harness lives in :mod:`ndparallel.distributed.spawn`); ``verify(model, layouts, ...)`` is
``ndparallel verify`` as a function (:mod:`ndparallel.verify`, docs/verify.md). This module is the public
face of both, on the top floor (docs/architecture.md).
"""

from ndparallel.distributed.spawn import (
    DistributedError,
    DistributedTimeout,
    defined_interactively,
    pickled_call,
    run_distributed,
    run_ranks,
)
from ndparallel.verify import verify

__all__ = [
    "DistributedError",
    "DistributedTimeout",
    "defined_interactively",
    "pickled_call",
    "run_distributed",
    "run_ranks",
    "verify",
]
