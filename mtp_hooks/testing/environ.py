"""The process environment, given back after building a model.

Building an mcore language model writes ``os.environ``: ``LanguageModule._set_attention_backend``
sets ``NVTE_FLASH_ATTN``, ``NVTE_FUSED_ATTN`` and ``NVTE_UNFUSED_ATTN`` from
``config.attention_backend`` (all ``1`` for ``auto``), and refuses a later model of another backend
in the same process when they disagree with it. The builders of this package run inside
``environ_kept()``, so a tiny CPU model (whose attention reads none of them) leaves the process as
it found it, and a later model of any backend can still be built.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

__all__ = ["environ_kept"]


@contextlib.contextmanager
def environ_kept() -> Iterator[None]:
    """Restore ``os.environ`` exactly on exit, also when the body raises.

    Variables the body added are removed, and those it changed or removed get their old values
    back; the environment is compared by value, so nothing is rewritten that the body left alone.
    """
    saved = dict(os.environ)
    try:
        yield
    finally:
        for name in [name for name in os.environ if name not in saved]:
            del os.environ[name]
        for name, value in saved.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
