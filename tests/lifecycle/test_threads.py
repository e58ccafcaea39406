"""One hooked model, several threads: one forward at a time, and never a model left non-stock.

The model pre-hook takes a lock without blocking (another thread's forward raises
``MTPHooksStateError``), the post-hook restores the attach-time attributes before it releases it,
and ``remove()`` refuses while another thread's forward runs.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Optional

import pytest
import torch

import mtp_hooks
from megatron.core.transformer.transformer_config import TransformerConfig
from mtp_hooks.testing import TinyGPT, assert_same_grads, hooked_train_step, make_batch, stock_train_step

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB = 64
SHAPE = TinyGPT(vocab_size=VOCAB, hidden_size=16, num_layers=1)
THREAD_MESSAGE = "one thread at a time on these hooks"


@pytest.fixture
def fast_thread_switches() -> Any:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows: races show in seconds
    yield
    sys.setswitchinterval(interval)


def test_two_threads_hammering_one_model_never_leave_it_non_stock(fast_thread_switches: Any) -> None:
    model = SHAPE.build(3)
    config = model.config
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB, seq=8, seed=1)
    with torch.no_grad():
        expected = model(*batch.model_args)
    deadline = time.monotonic() + 5.0
    outcomes: dict[str, int] = {"ran": 0, "refused": 0}
    failures: list[BaseException] = []
    lock = threading.Lock()

    def hammer() -> None:
        while time.monotonic() < deadline and not failures:
            try:
                with torch.no_grad():
                    logits = model(*batch.model_args)
                assert torch.equal(logits, expected), "a forward ran with the wrong config"
                kind = "ran"
            except mtp_hooks.MTPHooksStateError as error:
                if THREAD_MESSAGE not in str(error):
                    failures.append(error)
                kind = "refused"
            except BaseException as error:  # noqa: BLE001 - a crash in stock code is the failure
                failures.append(error)
                return
            with lock:
                outcomes[kind] += 1

    threads = [threading.Thread(target=hammer) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[:3]
    assert outcomes["ran"] > 0
    assert model.config is config and type(model.config) is TransformerConfig and model.mtp_process is True
    hooks.remove()
    assert model.config is config and config.mtp_num_layers == 2 and model.mtp_process is True


def test_remove_from_another_thread_while_a_forward_runs_is_refused() -> None:
    model, stock = SHAPE.build(3), SHAPE.build(3)
    hooks = mtp_hooks.attach(model)
    inside, release = threading.Event(), threading.Event()
    batch = make_batch(VOCAB, seq=8, seed=2)
    error: list[Optional[BaseException]] = [None]

    def wait(*_: Any) -> None:
        inside.set()
        release.wait(timeout=60)

    def train() -> None:
        try:
            hooked_train_step(model, hooks, batch)
        except BaseException as e:  # noqa: BLE001
            error[0] = e

    handle = model.decoder.register_forward_pre_hook(wait)
    thread = threading.Thread(target=train)
    thread.start()
    try:
        assert inside.wait(timeout=60)
        with pytest.raises(mtp_hooks.MTPHooksStateError, match="remove: refused[\\s\\S]*while a forward of the model is running"):
            hooks.remove()
        assert mtp_hooks.hooks_of(model) is hooks
    finally:
        release.set()
        thread.join()
        handle.remove()
    assert error[0] is None, error[0]
    stock_train_step(stock, batch)
    assert_same_grads(model, stock)  # the forward the refused remove() met trained like stock
    hooks.remove()
    assert mtp_hooks.hooks_of(model) is None and type(model.config) is TransformerConfig
