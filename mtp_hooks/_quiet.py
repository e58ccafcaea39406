"""megatron-core's import-time notices, silenced while the package imports it.

megatron-core warns at import that Transformer Engine, Apex or absl are not installed and that it falls
back to its own kernels, as ``mtp_hooks`` does on purpose. ``megatron_notices_silenced()`` ignores those
notices (``UserWarning`` raised from ``megatron.*``, by message) for the length of a ``with`` block: the
package's faces import megatron-core inside one (``mtp_hooks.attach`` and its siblings on first use,
``_mcore``, ``predict``, ``testing``). Every other warning, and any raised after the block, is left alone.
Imports only the standard library, so the megatron-free faces (``mtp_hooks``, ``mtp_hooks.engine``) can
import it.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

NOTICES = r"(Transformer Engine and Apex are|Apex is|absl\.logging is) not installed"


@contextlib.contextmanager
def megatron_notices_silenced() -> Iterator[None]:
    """Inside the block, megatron-core's "... not installed" notices are ignored; the filters are restored on
    exit, also by exception (``warnings.catch_warnings``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NOTICES, category=UserWarning, module=r"megatron\.")
        yield
