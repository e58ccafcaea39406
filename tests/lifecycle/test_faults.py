"""Faults: an exception in the middle of a hooked forward leaves nothing behind.

Exceptions are raised by plain forward hooks that the test registers on real mcore submodules
(an MTP layer's transformer layer, the output layer, a decoder layer), by bad tensors, and by
user code inside ``micro_batch``. After each fault the model must be exactly "stock with hooks":
the real config object, ``mtp_process`` back, every hook dict as right after ``attach``, no
labels left for the next forward, no metrics from the failed forward. The next micro-batch must
equal a stock twin, and ``remove()`` must still give a model bit-identical to a never-hooked twin.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import pytest
import torch
import wrapt
from torch import Tensor, nn

import mtp_hooks
from megatron.core.transformer.transformer_config import TransformerConfig
from mtp_hooks.testing import Batch, TinyGPT, assert_same_grads, grads_of, hooked_forward, hooked_train_step, make_batch, output_layer_calls
from mtp_hooks.testing import stock_train_step
from tests.support.mcore_cpu import mtp_inner_layer
from tests.support.micro_batches import assert_next_micro_batches_like_stock

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB = 32
SHAPE = TinyGPT(vocab_size=VOCAB, hidden_size=16, num_layers=1, num_attention_heads=2, mtp_num_layers=2)

HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


# wrapt 2 names the attribute-forwarding proxy base ``BaseObjectProxy`` (``ObjectProxy`` derives from it)
PROXY = getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy)


class Fault(RuntimeError):
    """The exception the test injects."""


# ------------------------------------------------------------------------ building blocks


def hook_dicts(model: nn.Module) -> dict[str, dict[str, list[tuple[int, Any]]]]:
    """Every module's hook dicts, by module name: what ``attach`` added and nothing else."""
    return {name: {d: list(getattr(module, d).items()) for d in HOOK_DICTS} for name, module in model.named_modules()}


def attribute_identities(model: nn.Module) -> dict[str, dict[str, int]]:
    """``id`` of every attribute value of every module (a swapped attribute changes its id)."""
    return {
        name: {key: id(value) for key, value in module.__dict__.items() if key not in HOOK_DICTS}
        for name, module in model.named_modules()
    }


def assert_stock_with_hooks(
    model: nn.Module, hooks: mtp_hooks.MTPHooks, config: TransformerConfig, after_attach: dict[str, Any], identities: dict[str, Any]
) -> None:
    """The model is in the state right after a clean micro-batch: nothing swapped, nothing added, nothing pending."""
    assert model.config is config and type(model.config) is TransformerConfig
    assert model.mtp_process is True
    assert hook_dicts(model) == after_attach
    assert attribute_identities(model) == identities
    for name, module in model.named_modules():
        for key, value in module.__dict__.items():
            assert not isinstance(value, PROXY), f"{name}.{key} is still a proxy"
    assert mtp_hooks.hooks_of(model) is hooks
    assert hooks.metrics() == {}, "the failed forward left metrics behind"


@contextlib.contextmanager
def raising_hook(module: nn.Module, pre: bool = False) -> Iterator[None]:
    """A forward hook (or pre-hook) on ``module`` that raises ``Fault``; removed on exit."""

    def fail(*_: Any) -> None:
        raise Fault(f"injected fault in {type(module).__name__}")

    handle = module.register_forward_pre_hook(fail) if pre else module.register_forward_hook(fail)
    try:
        yield
    finally:
        handle.remove()


def zero_grads(model: nn.Module) -> None:
    for param in model.parameters():
        param.grad = None


class Rig:
    """A hooked model, its stock twin and a never-hooked twin, with the snapshots the checks need."""

    def __init__(self, **options: Any) -> None:
        self.model = SHAPE.build(7)
        self.untouched = SHAPE.build(7)
        self.before_attach = hook_dicts(self.model)
        self.before_attach_identities = attribute_identities(self.model)
        self.config = self.model.config
        self.hooks = mtp_hooks.attach(self.model, **options)
        self.after_attach = hook_dicts(self.model)
        assert self.after_attach != self.before_attach
        # one clean micro-batch, so that anything mcore creates lazily on a first forward exists
        hooked_train_step(self.model, self.hooks, make_batch(VOCAB, seed=99))
        self.hooks.metrics()
        zero_grads(self.model)
        self.identities = attribute_identities(self.model)

    def assert_clean(self) -> None:
        assert_stock_with_hooks(self.model, self.hooks, self.config, self.after_attach, self.identities)
        for name, grad in grads_of(self.model).items():
            assert grad is None, f"{name} got a gradient from a failed forward"

    def assert_next_forwards_correct(self) -> None:
        """No stale labels (a plain forward is inference with stock's logits), then a training
        micro-batch equal to stock (or, with detach options, to a hooked twin that never saw a fault)."""
        assert_next_micro_batches_like_stock(self.model, self.hooks, SHAPE, 7, make_batch(VOCAB, seed=1))

    def assert_recovers(self) -> None:
        """After a fault: nothing left behind, the next micro-batches correct, ``remove()`` restores stock."""
        self.assert_clean()
        self.assert_next_forwards_correct()
        self.assert_remove_restores_stock()

    def assert_remove_restores_stock(self) -> None:
        """After ``remove()``: same hook dicts and attributes as before attach, bit-identical to a never-hooked twin."""
        self.hooks.remove()
        assert hook_dicts(self.model) == self.before_attach
        assert attribute_identities(self.model) == self.before_attach_identities or _only_lazy_additions(
            self.before_attach_identities, attribute_identities(self.model)
        )
        assert mtp_hooks.hooks_of(self.model) is None
        zero_grads(self.model)
        batch = make_batch(VOCAB, seed=2)
        with output_layer_calls(self.model) as mine, output_layer_calls(self.untouched) as theirs:
            loss = stock_train_step(self.model, batch).loss
            expected = stock_train_step(self.untouched, batch).loss
        assert torch.equal(loss, expected)
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
        assert_same_grads(self.model, self.untouched, atol=0, rtol=0)


def _only_lazy_additions(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> bool:
    """Attributes present before attach kept their objects; only keys mcore adds on a first forward are new."""
    return all(after[name][key] == value for name, keys in before.items() for key, value in keys.items())


# ------------------------------------------------------------------------------- faults


SITES: dict[str, Callable[[nn.Module], tuple[nn.Module, bool]]] = {
    # inside the second MTP layer, after depth 1 ran
    "mtp_layer": lambda m: (mtp_inner_layer(m.mtp.layers[1]), False),
    # in the output layer: after the hooks' pre-hook attached the MTP losses (lean) or inside
    # the hooks' own head call (dense)
    "output_layer": lambda m: (m.output_layer, False),
    # a pre-hook on the output layer registered after attach: runs right after the hooks' pre-hook
    "output_layer_pre_hook": lambda m: (m.output_layer, True),
    # in the decoder, before the MTP block
    "decoder": lambda m: (m.decoder.layers[0], False),
}


@pytest.mark.parametrize("path", ["context", "kwargs"])
@pytest.mark.parametrize("loss_impl", ["lean", "dense"])
@pytest.mark.parametrize("site", list(SITES))
def test_fault_inside_forward_leaves_stock_with_hooks(site: str, loss_impl: str, path: str) -> None:
    rig = Rig(loss_impl=loss_impl)
    module, pre = SITES[site](rig.model)
    batch = make_batch(VOCAB, seed=0)
    with raising_hook(module, pre), pytest.raises(Fault, match="injected fault"):
        hooked_forward(rig.model, rig.hooks, batch, path)
    rig.assert_recovers()


@pytest.mark.parametrize("site", ["mtp_layer", "output_layer"])
def test_fault_with_detached_encoder_leaves_stock_with_hooks(site: str) -> None:
    """``detach_encoder`` adds a pre-hook on every MTP layer that swaps the embedding for a proxy."""
    rig = Rig(detach_encoder=True)
    module, pre = SITES[site](rig.model)
    with raising_hook(module, pre), pytest.raises(Fault):
        hooked_forward(rig.model, rig.hooks, make_batch(VOCAB, seed=0), "context")
    rig.assert_recovers()


@pytest.mark.parametrize("when", ["before_forward", "after_forward"])
def test_user_exception_inside_micro_batch_drops_labels(when: str) -> None:
    """Raised before the forward, or after it completed (its losses ride on the logits the user
    dropped): the labels do not outlive the block."""
    rig = Rig()
    batch = make_batch(VOCAB, seed=0)
    with pytest.raises(Fault):
        with rig.hooks.micro_batch(batch.labels, batch.loss_mask):
            if when == "after_forward":
                rig.model(*batch.model_args)
            raise Fault(f"user code failed {when.replace('_', ' the ')}")
    rig.hooks.metrics()  # a forward that completed left metrics; they are not what this test pins
    rig.assert_recovers()


@pytest.mark.parametrize(
    "bad, error, match",
    [
        pytest.param(
            lambda b: (b.input_ids[:, :-1], b.position_ids[:, :-1]), mtp_hooks.MTPHooksError, "labels: bad value",
            id="input_ids_shorter_than_labels",
        ),
        pytest.param(lambda b: (b.input_ids.float(), b.position_ids), mtp_hooks.MTPHooksError, "dtype of input_ids", id="float_input_ids"),
        pytest.param(lambda b: (b.input_ids + VOCAB * 1000, b.position_ids), IndexError, "out of range", id="token_ids_out_of_range"),
    ],
)
def test_bad_tensors_in_forward_leave_stock_with_hooks(
    bad: Callable[[Batch], tuple[Tensor, Tensor]], error: type[Exception], match: str
) -> None:
    """Bad tensors refused by the hooks' pre-hook, or failing inside mcore's embedding."""
    rig = Rig()
    batch = make_batch(VOCAB, seed=0)
    input_ids, position_ids = bad(batch)
    with pytest.raises(error, match=match):
        with rig.hooks.micro_batch(batch.labels, batch.loss_mask):
            rig.model(input_ids, position_ids, None)
    rig.assert_recovers()


@pytest.mark.parametrize(
    "labels, loss_mask, match",
    [
        pytest.param(lambda b: b.labels.float(), lambda b: b.loss_mask, "labels", id="float_labels"),
        pytest.param(lambda b: b.labels[0], lambda b: None, "labels", id="1d_labels"),
        pytest.param(lambda b: b.labels, lambda b: b.loss_mask * 2, "loss_mask", id="mask_not_0_1"),
        pytest.param(lambda b: b.labels, lambda b: b.loss_mask[:, :-1], "loss_mask", id="mask_wrong_shape"),
    ],
)
def test_bad_targets_are_refused_before_anything_changes(
    labels: Callable[[Batch], Any], loss_mask: Callable[[Batch], Any], match: str
) -> None:
    rig = Rig()
    batch = make_batch(VOCAB, seed=0)
    with pytest.raises(mtp_hooks.MTPHooksError, match=match):
        with rig.hooks.micro_batch(labels(batch), loss_mask(batch)):
            pytest.fail("micro_batch accepted bad targets")
    with pytest.raises(mtp_hooks.MTPHooksError, match=match):
        rig.model(*batch.model_args, labels=labels(batch), loss_mask=loss_mask(batch))
    rig.assert_recovers()


def test_refused_second_attach_registers_nothing() -> None:
    rig = Rig()
    with pytest.raises(mtp_hooks.MTPHooksError, match="mtp_hooks already attached"):
        mtp_hooks.attach(rig.model, detach_encoder=True)
    rig.assert_recovers()


@pytest.mark.parametrize(
    "options, match",
    [
        pytest.param({"loss_impl": "flash"}, "loss_impl", id="loss_impl"),
        pytest.param({"chunk_size": 0}, "chunk_size", id="chunk_size"),
        pytest.param({"detach_encoder": "yes"}, "detach_encoder", id="detach_encoder"),
        pytest.param({"loss_scale": -1.0}, "loss_scale", id="loss_scale"),
    ],
)
def test_refused_attach_registers_nothing(options: dict[str, Any], match: str) -> None:
    model, untouched = SHAPE.build(7), SHAPE.build(7)
    before, identities = hook_dicts(model), attribute_identities(model)
    with pytest.raises(mtp_hooks.MTPHooksError, match=match):
        mtp_hooks.attach(model, **options)
    assert hook_dicts(model) == before
    assert attribute_identities(model) == identities
    assert mtp_hooks.hooks_of(model) is None
    batch = make_batch(VOCAB)
    assert torch.equal(stock_train_step(model, batch).loss, stock_train_step(untouched, batch).loss)
    assert_same_grads(model, untouched, atol=0, rtol=0)


def test_raising_pre_hook_registered_before_attach_keeps_nesting_guard() -> None:
    """A user pre-hook that runs before the hooks' own pre-hook raises: the hooks' ``always_call``
    post-hook still runs for that call. It must not undo a forward it never started: afterwards a
    nested forward is still refused, and the model keeps its real config."""
    model = SHAPE.build(7)
    failing = {"on": True}

    def user_pre_hook(*_: Any) -> None:
        if failing["on"]:
            raise Fault("user pre-hook")

    model.register_forward_pre_hook(user_pre_hook)
    hooks = mtp_hooks.attach(model)
    config = model.config
    batch = make_batch(VOCAB, seed=0)
    for path in ("context", "kwargs"):
        with pytest.raises(Fault):
            hooked_forward(model, hooks, batch, path)
    assert model.config is config and model.mtp_process is True
    failing["on"] = False

    def nested(*_: Any) -> None:
        model(*batch.model_args)

    handle = model.decoder.register_forward_hook(nested)
    with pytest.raises(mtp_hooks.MTPHooksStateError, match="nested"):
        model(*batch.model_args)  # an inference forward whose decoder runs the model again
    handle.remove()
    assert model.config is config and type(model.config) is TransformerConfig
    assert model.mtp_process is True
    assert_next_micro_batches_like_stock(model, hooks, SHAPE, 7, batch)


@pytest.mark.parametrize("loss_impl", ["lean", "dense"])
def test_unmasked_label_outside_vocabulary_is_refused(loss_impl: str) -> None:
    model = SHAPE.build(7)
    hooks = mtp_hooks.attach(model, loss_impl=loss_impl)
    batch = make_batch(VOCAB, mask="ones")
    batch.labels[:, 3] = VOCAB + 5
    try:
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            model(*batch.model_args)
    except mtp_hooks.MTPHooksError as error:
        assert "labels" in str(error)
    else:
        raise AssertionError("a label outside the vocabulary at an unmasked position was accepted")
