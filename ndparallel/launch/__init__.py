"""Processes: the ``ndparallel`` command (``cli``), torchrun underneath ``ndparallel launch`` (``torchrun``),
the worker guard that ties a rank's life to its launcher (``worker_guard``), the notebook launcher, and the
garbage collections these processes leave out at exit (``exit_collections``)."""
