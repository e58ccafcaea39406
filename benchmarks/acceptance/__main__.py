"""``python -m benchmarks.acceptance``: the acceptance benchmark (``make acceptance``)."""

from benchmarks.acceptance.run import main

if __name__ == "__main__":
    raise SystemExit(main())
