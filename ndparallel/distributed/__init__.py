"""Ranks and collectives, knowing no module tree: the named mesh, process start, and the collectives.

``mesh`` (the named :class:`Mesh` and its views), ``process`` (``init_distributed`` / ``destroy_distributed``,
device rules), ``store`` (the job's rendezvous store), the hang watchdog ``init_distributed`` starts (``watchdog``:
its thread; ``heartbeat``: what each rank posts; ``verdict``: who is behind, pure; ``timeouts``: the hang timeout
and its clocks), ``memory`` (will a model fit in this machine's memory), ``agree`` (one rank's failure is every
rank's error), ``reduce`` (per-rank metrics as one process would print them), ``buckets`` (flat gradient buckets),
``ring`` and ``ulysses`` (exact attention over a split sequence), ``distinct`` (collectives over per-rank sets),
``counter`` (bytes moved by real collectives), ``local_ops`` (the dispatch mode over this rank's plain-tensor ops
the counter and the dry run build on) and ``peak`` (a device's peak FLOP/s).
"""
