"""Benchmarks of ``mtp_hooks`` against stock Megatron-Core and an instance-patching baseline.

``python -m benchmarks`` runs the default CPU benchmark; ``python -m benchmarks.run --config gpu``
the realistic head-dominant one; ``python -m benchmarks.demo`` a short readable demo.
Method and results: BENCHMARKS.md.
"""
