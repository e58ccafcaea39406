"""The forward's shared mechanics: per-forward state and the window, micro-batch targets and their
checkpoint recomputes, call arguments, interrupts, proxies, the hooks kept first or last. Names no
option (``features/`` do)."""
