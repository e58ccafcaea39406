"""wrapt proxies handed to mcore in place of the real objects, for the length of one forward.

* ``ConfigView`` reads ``mtp_num_layers`` as ``None`` and forwards everything else (reads and
  writes) to the real ``TransformerConfig``. Installed on the language model only: its
  submodules keep their own reference to the real config.
* ``NoRecomputeConfig`` reads ``recompute_granularity`` as ``None``: put on an MTP layer whose
  stock recompute cannot take a packed batch (``_mcore.RECOMPUTE_SAVES_PACKED_SEQ_PARAMS``).
* ``DetachedEmbedding`` calls the real embedding module and detaches what it returns, so the
  MTP layers learn from the next-token embeddings without sending gradient into them.
"""

from __future__ import annotations

from typing import Any

import wrapt
from torch import Tensor

# wrapt >= 2 names the attribute-forwarding proxy ``BaseObjectProxy``; 1.x calls it ``ObjectProxy``.
_ObjectProxy: Any = getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy)


class ConfigView(_ObjectProxy):  # type: ignore[misc]
    """A ``TransformerConfig`` that reports no MTP layers, so mcore's own MTP loss stays off."""

    @property
    def mtp_num_layers(self) -> None:
        return None

    def __reduce_ex__(self, protocol: int) -> Any:
        raise TypeError("ConfigView is a per-forward view of a TransformerConfig; copy the config itself")

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise TypeError("ConfigView is a per-forward view of a TransformerConfig; copy the config itself")


class NoRecomputeConfig(_ObjectProxy):  # type: ignore[misc]
    """A ``TransformerConfig`` that reports no activation recompute; everything else forwarded."""

    @property
    def recompute_granularity(self) -> None:
        return None

    def __reduce_ex__(self, protocol: int) -> Any:
        raise TypeError("NoRecomputeConfig is a per-forward view of a TransformerConfig; copy the config itself")

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise TypeError("NoRecomputeConfig is a per-forward view of a TransformerConfig; copy the config itself")


class DetachedEmbedding(_ObjectProxy):  # type: ignore[misc]
    """An embedding module whose call returns a detached tensor."""

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.__wrapped__(*args, **kwargs).detach()

    def __reduce_ex__(self, protocol: int) -> Any:
        raise TypeError("DetachedEmbedding lives for one forward and is not meant to be copied")

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise TypeError("DetachedEmbedding lives for one forward and is not meant to be copied")
