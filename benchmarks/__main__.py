"""``python -m benchmarks``: the default (CPU) benchmark, same options as ``benchmarks.run``."""

from benchmarks.run import main

if __name__ == "__main__":
    raise SystemExit(main())
