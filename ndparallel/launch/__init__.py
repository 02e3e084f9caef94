"""Processes: the ``ndparallel`` command (``cli``), torchrun underneath ``ndparallel launch`` (``torchrun``),
the worker guard that ties a rank's life to its launcher (``worker_guard``) and the notebook launcher."""
