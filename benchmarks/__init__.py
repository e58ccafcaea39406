"""Benchmarks of ``mtp_hooks``, two of them.

The cost benchmark (this package's modules) against stock Megatron-Core and an instance-patching
baseline: ``python -m benchmarks`` runs the default CPU benchmark, ``python -m benchmarks.run --config
gpu`` the realistic head-dominant one, ``python -m benchmarks.demo`` a short readable demo.
The acceptance benchmark (``benchmarks.acceptance``, ``python -m benchmarks.acceptance``): frozen against
trained MTP drafts through an RL run. It builds its models with the cost benchmark's ``models`` and
``configs``; the cost benchmark never imports it. Method and results: BENCHMARKS.md.
"""
