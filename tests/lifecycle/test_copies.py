"""Copies of a hooked model (``copy.deepcopy``, ``pickle`` / ``torch.save``) are hooked on their own.

RL frameworks deep-copy the actor to make a reference model. The copy gets its own hooks, bound to
the copy: its forwards never touch the original, ``remove()`` on one leaves the other hooked, and
the copy outlives the original. Both train exactly like a stock twin.
"""

from __future__ import annotations

import copy
import gc
import io
import pickle
from typing import Any, Callable

import pytest
import torch
from torch import nn

import mtp_hooks
from megatron.core.transformer.transformer_config import TransformerConfig
from mtp_hooks.testing import TinyGPT, assert_same_grads, assert_same_mtp_losses, hooked_train_step, make_batch, stock_train_step

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB = 64
SHAPE = TinyGPT(vocab_size=VOCAB)


def process_groups(model: nn.Module) -> list[Any]:
    """The ``ProcessGroup`` objects reachable from a model (not copyable, in stock mcore too: copies
    share them), found by walking attributes, dicts and sequences (tensors are not entered)."""
    groups: dict[int, Any] = {}
    seen: set[int] = set()
    stack: list[Any] = [model]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (torch.Tensor, str, bytes, int, float, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.distributed.ProcessGroup):
            groups[id(obj)] = obj
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        stack.extend(getattr(obj, "__dict__", {}).values())
    return list(groups.values())


def deep_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model, {id(group): group for group in process_groups(model)})


def pickle_round_trip(model: nn.Module) -> nn.Module:
    groups = process_groups(model)
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer)
    pickler.persistent_id = lambda obj: next((i for i, g in enumerate(groups) if g is obj), None)  # type: ignore[method-assign]
    pickler.dump(model)
    buffer.seek(0)
    unpickler = pickle.Unpickler(buffer)
    unpickler.persistent_load = lambda i: groups[i]  # type: ignore[method-assign]
    return unpickler.load()


COPIERS: dict[str, Callable[[nn.Module], nn.Module]] = {"deepcopy": deep_copy}


def assert_trains_like_stock(model: nn.Module, hooks: mtp_hooks.MTPHooks, seed: int) -> None:
    stock = SHAPE.build(7)
    model.zero_grad(set_to_none=True)
    batch = make_batch(VOCAB, seed=seed)
    stock_train_step(stock, batch)
    from mtp_hooks.testing import stock_mtp_losses

    expected = stock_mtp_losses()
    hooked_train_step(model, hooks, batch)
    assert_same_mtp_losses(hooks.metrics(), expected)
    assert_same_grads(model, stock)


def assert_stock(model: nn.Module) -> None:
    assert mtp_hooks.hooks_of(model) is None
    assert type(model.config) is TransformerConfig and model.mtp_process is True
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks


@pytest.mark.parametrize("copier", list(COPIERS))
def test_copy_of_a_hooked_model_has_its_own_hooks_and_never_touches_the_original(copier: str) -> None:
    original = SHAPE.build(7)
    hooks = mtp_hooks.attach(original, loss_impl="dense")
    hooked_train_step(original, hooks, make_batch(VOCAB, seed=1))
    hooks.metrics()
    original.zero_grad(set_to_none=True)
    twin = COPIERS[copier](original)
    twin_hooks = mtp_hooks.hooks_of(twin)
    assert twin_hooks is not None and twin_hooks is not hooks and twin_hooks.model is twin and hooks.model is original
    assert twin_hooks.options == hooks.options

    config = original.config
    seen: list[Any] = []
    calls: list[str] = []
    spies = [m.register_forward_pre_hook(lambda *_: calls.append("original")) for m in (original, original.decoder, original.output_layer)]
    # Inside the copy's forward (every site a window could reach), the original stays stock.
    probe = lambda *_: seen.append((original.__dict__["config"] is config, original.mtp_process))  # noqa: E731
    probes = [m.register_forward_pre_hook(probe) for m in (twin.decoder, twin.output_layer)]
    probes.append(torch.nn.modules.module.register_module_forward_pre_hook(probe))
    try:
        assert_trains_like_stock(twin, twin_hooks, seed=2)
        with torch.no_grad():
            twin(*make_batch(VOCAB, seed=3).model_args)
    finally:
        for handle in spies + probes:
            handle.remove()
    assert calls == [] and seen and all(s == (True, True) for s in seen)
    assert original.config is config and original.mtp_process is True
    assert_trains_like_stock(original, hooks, seed=4)


def test_remove_on_the_copy_leaves_the_original_hooked_and_the_copy_stock_and_attachable() -> None:
    original = SHAPE.build(7)
    hooks = mtp_hooks.attach(original)
    twin = deep_copy(original)
    mtp_hooks.hooks_of(twin).remove()
    assert_stock(twin)
    assert mtp_hooks.hooks_of(original) is hooks
    assert_trains_like_stock(original, hooks, seed=1)
    again = mtp_hooks.attach(twin)
    assert_trains_like_stock(twin, again, seed=2)
    hooks.remove()
    assert_stock(original)
    assert mtp_hooks.hooks_of(twin) is again


def test_copy_survives_the_original() -> None:
    original = SHAPE.build(7)
    mtp_hooks.attach(original)
    twin = deep_copy(original)
    del original
    gc.collect()
    assert_trains_like_stock(twin, mtp_hooks.hooks_of(twin), seed=5)


def test_copying_inside_a_forward_is_refused_and_leaves_nothing_behind() -> None:
    model = SHAPE.build(7)
    hooks = mtp_hooks.attach(model)
    errors: list[BaseException] = []

    def copy_inside(*_: Any) -> None:
        for copier in (deep_copy,):
            try:
                copier(model)
            except mtp_hooks.MTPHooksStateError as error:
                errors.append(error)

    handle = model.decoder.register_forward_hook(copy_inside)
    hooked_train_step(model, hooks, make_batch(VOCAB, seed=1))
    handle.remove()
    assert len(errors) == 1 and all("inside a forward" in str(e) for e in errors), errors
    hooks.metrics()
    assert_trains_like_stock(model, hooks, seed=2)


def test_copying_the_hooks_without_their_model_is_refused() -> None:
    model = SHAPE.build(7)
    hooks = mtp_hooks.attach(model)
    with pytest.raises(mtp_hooks.MTPHooksStateError, match="deep copy of the hooked model"):
        copy.deepcopy(hooks)


def test_pickling_a_hooked_model_behaves_as_pickling_its_stock_twin() -> None:
    """mcore's own modules hold local lambdas, so stock GPTModels do not pickle; the hooks add no
    other failure (they pickle with their model, rebound on load)."""
    stock, model = SHAPE.build(7), SHAPE.build(7)
    mtp_hooks.attach(model)

    def error_of(m: nn.Module) -> str:
        try:
            pickle_round_trip(m)
        except Exception as error:  # noqa: BLE001 - compared, not handled
            return f"{type(error).__name__}: {error}"
        return "no error"

    assert error_of(model) == error_of(stock)


def test_pickled_hooks_are_rebound_to_the_unpickled_model() -> None:
    """The hooks' own pickling, on a model that pickles: a holder of the hooks' state and model."""
    model = SHAPE.build(7)
    hooks = mtp_hooks.attach(model)
    binding = hooks._hooks.binding
    state = binding.__getstate__()
    assert state["copy_of"][0] is model and list(state) == ["copy_of"]
    clone = object.__new__(type(binding))
    clone.__setstate__(dict(state))
    assert clone.alive_model is model and clone.flight.current is None and clone.micro_batches.pending is None
    assert clone.flight._lock is not binding.flight._lock and not clone.flight._lock.locked()


def test_deepcopy_without_a_memo_fails_exactly_as_for_a_stock_twin() -> None:
    """mcore's modules hold ``ProcessGroup``s (directly and in ``pg_collection``s), which do not
    copy: a plain ``copy.deepcopy`` of a stock model raises, and of a hooked one the same. The
    recipe in docs/contract.md, a memo sharing every group (``deep_copy``), copies both; the failed copy
    leaves the original hooked and training like stock."""
    stock, model = SHAPE.build(7), SHAPE.build(7)
    hooks = mtp_hooks.attach(model)

    def error_of(m: nn.Module) -> str:
        try:
            copy.deepcopy(m)
        except Exception as error:  # noqa: BLE001 - compared, not handled
            return f"{type(error).__name__}: {error}"
        return "no error"

    assert error_of(model) == error_of(stock) and "ProcessGroup" in error_of(stock)
    assert mtp_hooks.hooks_of(model) is hooks and hooks._hooks.binding.flight.current is None
    assert mtp_hooks.hooks_of(deep_copy(stock)) is None and mtp_hooks.hooks_of(deep_copy(model)) is not None
    assert_trains_like_stock(model, hooks, seed=6)
