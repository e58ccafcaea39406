"""A forward interrupted by a ``BaseException`` that is not an ``Exception`` must not brick the model.

torch skips ``always_call`` hooks for ``KeyboardInterrupt``, ``SystemExit`` and
``asyncio.CancelledError``; the next call into the hooks must notice that the forward is gone,
restore what it swapped and go on, while a genuinely nested forward stays refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, Callable, Iterator

import pytest
import torch
from torch import nn

import mtp_hooks
from megatron.core.transformer.transformer_config import TransformerConfig
from mtp_hooks.testing import hooked_forward, make_batch
from tests.lifecycle.test_faults import SITES, VOCAB, Rig

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

INTERRUPTS = {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit, "CancelledError": asyncio.CancelledError}


@contextlib.contextmanager
def interrupting_hook(module: nn.Module, pre: bool, interrupt: type[BaseException]) -> Iterator[None]:
    def fire(*_: Any) -> None:
        raise interrupt()

    handle = module.register_forward_pre_hook(fire) if pre else module.register_forward_hook(fire)
    try:
        yield
    finally:
        handle.remove()


def interrupt_forward(rig: Rig, site: str, interrupt: type[BaseException]) -> None:
    module, pre = SITES[site](rig.model)
    with interrupting_hook(module, pre, interrupt), pytest.raises(interrupt):
        hooked_forward(rig.model, rig.hooks, make_batch(VOCAB, seed=0), "context")
    # torch skipped the post-hook, yet the model is stock already: no user hook runs inside the window
    assert type(rig.model.config) is TransformerConfig and rig.model.config is rig.config and rig.model.mtp_process is True


# The next call into the hooks after the interrupt: each one must recover.
NEXT_CALLS: dict[str, Callable[[Rig], Any]] = {
    "metrics": lambda rig: rig.hooks.metrics(),
    "micro_batch": lambda rig: rig.hooks.micro_batch(make_batch(VOCAB).labels).__exit__(None, None, None),
    "inference_forward": lambda rig: rig.model(*make_batch(VOCAB, seed=3).model_args),
}


@pytest.mark.parametrize("interrupt", list(INTERRUPTS))
@pytest.mark.parametrize("site", list(SITES))
def test_interrupted_forward_is_cleaned_up_by_the_next_metrics_read(site: str, interrupt: str) -> None:
    rig = Rig()
    interrupt_forward(rig, site, INTERRUPTS[interrupt])
    rig.hooks.metrics()
    rig.assert_recovers()


@pytest.mark.parametrize("next_call", list(NEXT_CALLS))
def test_any_next_call_recovers_from_an_interrupted_forward(next_call: str) -> None:
    rig = Rig()
    interrupt_forward(rig, "mtp_layer", KeyboardInterrupt)
    NEXT_CALLS[next_call](rig)
    assert type(rig.model.config) is TransformerConfig and rig.model.mtp_process is True
    rig.assert_next_forwards_correct()


def test_remove_after_an_interrupted_forward_restores_stock() -> None:
    rig = Rig()
    interrupt_forward(rig, "decoder", KeyboardInterrupt)
    rig.assert_remove_restores_stock()


def test_interrupted_forward_with_detached_encoder_recovers() -> None:
    options = {"detach_encoder": True}
    rig = Rig(**options)
    interrupt_forward(rig, "mtp_layer", asyncio.CancelledError)
    rig.hooks.metrics()
    rig.assert_clean()
    rig.assert_next_forwards_correct()


def test_nested_forward_is_still_refused_after_recovery() -> None:
    rig = Rig()
    interrupt_forward(rig, "output_layer", SystemExit)
    batch = make_batch(VOCAB, seed=4)

    def nested(*_: Any) -> None:
        rig.model(*batch.model_args)

    handle = rig.model.decoder.register_forward_pre_hook(nested)
    try:
        with pytest.raises(mtp_hooks.MTPHooksStateError, match="nested forwards are not supported"):
            rig.model(*batch.model_args)
    finally:
        handle.remove()
    rig.hooks.metrics()
    rig.assert_clean()
    rig.assert_next_forwards_correct()


def test_forward_of_a_thread_that_died_mid_forward_is_recovered_from_another_thread() -> None:
    rig = Rig()
    module, pre = SITES["mtp_layer"](rig.model)
    batch = make_batch(VOCAB, seed=5)

    def run() -> None:
        with contextlib.suppress(SystemExit), interrupting_hook(module, pre, SystemExit):
            hooked_forward(rig.model, rig.hooks, batch, "context")

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    rig.assert_next_forwards_correct()


def test_forward_running_in_another_thread_is_not_mistaken_for_an_interrupted_one() -> None:
    rig = Rig()
    inside, release = threading.Event(), threading.Event()
    batch = make_batch(VOCAB, seed=6)

    def wait(*_: Any) -> None:
        inside.set()
        release.wait(timeout=60)

    handle = rig.model.decoder.register_forward_pre_hook(wait)
    thread = threading.Thread(target=lambda: rig.model(*batch.model_args))
    thread.start()
    try:
        assert inside.wait(timeout=60)
        with pytest.raises(mtp_hooks.MTPHooksStateError, match="one thread at a time"):
            rig.model(*batch.model_args)
    finally:
        release.set()
        thread.join()
        handle.remove()
    with torch.no_grad():
        rig.model(*batch.model_args)
    rig.assert_next_forwards_correct()
