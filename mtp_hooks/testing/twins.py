"""Twin builds for side-by-side checks: a stock model and a hooked model with the same weights.

Example (on CPU, after ``init_parallel()`` and inside ``cuda_current_device_is_cpu()``)::

    twins = build_twins(TinyQwen(), seed=0)
    batch = make_batch(vocab_size=64, seq=16)
    stock_train_step(twins.stock, batch)
    hooked_train_step(twins.hooked, twins.hooks, batch)
    assert_same_grads(twins.hooked, twins.stock)
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from torch import nn

import mtp_hooks

__all__ = ["ModelShape", "TwinModels", "build_twins"]


class ModelShape(Protocol):
    """What ``build_twins`` needs of a shape (``TinyGPT``, ``TinyQwen``, ``TinyDeepSeek``, ...)."""

    def build(self, seed: int = ..., **model_kwargs: Any) -> nn.Module: ...


class TwinModels(NamedTuple):
    """Two builds of one shape and seed: ``stock`` stays stock mcore, ``hooked`` carries ``hooks``."""

    stock: nn.Module
    hooked: nn.Module
    hooks: mtp_hooks.MTPHooks


def build_twins(shape: ModelShape, seed: int = 1234, **options: Any) -> TwinModels:
    """Build ``shape`` twice with ``seed`` and attach ``mtp_hooks`` (``options``) to the second build.

    Raises:
        AssertionError: the two builds differ in a parameter's name, shape or value (the
            shape's build is not deterministic, so no side-by-side check could be trusted).
    """
    stock, hooked = shape.build(seed=seed), shape.build(seed=seed)
    theirs = dict(hooked.named_parameters())
    for name, parameter in stock.named_parameters():
        twin = theirs.pop(name, None)
        if twin is None or twin.shape != parameter.shape or not bool((twin == parameter).all()):
            raise AssertionError(f"build_twins: the two builds of {type(shape).__name__} differ at parameter {name!r}")
    if theirs:
        raise AssertionError(f"build_twins: the second build of {type(shape).__name__} has extra parameters {sorted(theirs)}")
    return TwinModels(stock, hooked, mtp_hooks.attach(hooked, **options))
