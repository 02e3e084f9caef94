"""``ndparallel.local_sgd``: ``accelerate.local_sgd`` under ndparallel's name (``LocalSGD``)."""

from ndparallel.accelerator.local_sgd import LocalSGD

__all__ = ["LocalSGD"]
