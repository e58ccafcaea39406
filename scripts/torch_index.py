"""pip's arguments for TORCH_INDEX: ``--extra-index-url URL`` when the index answers, nothing when it is out of reach.

pip retries an unreachable index with back-off for every package it resolves (about a minute for torch and its
dependencies): where the index cannot be reached (an offline mirror, a closed network) torch comes from pip's own
index instead, and this says so on stderr. Usage: ``pip install $(python scripts/torch_index.py) torch==2.13.0``.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

DEFAULT = "https://download.pytorch.org/whl/cpu"
TIMEOUT_S = 10


def reachable(url: str) -> bool:
    """Whether ``url`` answers an HTTP request at all (any status) within ``TIMEOUT_S``."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url.rstrip("/") + "/", method="HEAD"), timeout=TIMEOUT_S):
            return True
    except urllib.error.HTTPError:
        return True  # it answered
    except (OSError, ValueError):
        return False


def main_args(index: str) -> list[str]:
    """pip's arguments for ``index`` (``[]`` where it is empty or out of reach, said on stderr)."""
    if not index:
        return []
    if reachable(index):
        return ["--extra-index-url", index]
    print(f"torch_index: {index} is out of reach; torch comes from pip's own index", file=sys.stderr)
    return []


def main() -> int:
    print(" ".join(main_args(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("TORCH_INDEX", DEFAULT))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
