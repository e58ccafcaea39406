"""The acceptance benchmark: a frozen MTP draft against drafts trained inside RL (``python -m benchmarks.acceptance``)."""
