"""Moved to :mod:`ndparallel.hf.loss` (issue 12: everything Hugging Face in one folder); the names stay importable."""

from ndparallel.hf.loss import install_causal_lm_loss, labels_problem

__all__ = ["install_causal_lm_loss", "labels_problem"]
