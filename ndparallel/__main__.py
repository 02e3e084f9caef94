"""``python -m ndparallel`` == the ``ndparallel`` command."""

from ndparallel.launch.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
