"""Thin adapters that give a framework's MTP semantics with ``mtp_hooks`` options (no patching).

Each adapter imports nothing of its framework; ``mtp_hooks`` never depends on one.
"""
