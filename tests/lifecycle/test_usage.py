"""How a new user meets the API: ``micro_batch`` without ``with``, a removed handle, ``repr``,
errors that say what was wrong, and the ``validate`` modes."""

from __future__ import annotations

import pytest
import torch

import mtp_hooks
from mtp_hooks.testing import TinyGPT, hooked_train_step, make_batch

VOCAB = 64
SHAPE = TinyGPT(vocab_size=VOCAB)


def test_micro_batch_without_with_trains_nothing_and_the_next_forward_says_so() -> None:
    """A plain call would let targets outlive a failed step and train a later batch: it trains nothing."""
    model = SHAPE.build()
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB, seed=2)
    hooks.micro_batch(batch.labels, batch.loss_mask)  # the step fails here, before its forward
    with pytest.raises(mtp_hooks.MTPHooksStateError, match="without `with`"):
        model(*batch.model_args)
    model(*make_batch(VOCAB, seed=5).model_args).sum().backward()  # a later batch: inference
    assert hooks.metrics() == {}
    assert all(p.grad is None or not p.grad.any() for name, p in model.named_parameters() if name.startswith("mtp."))


def test_micro_batch_without_with_then_another_micro_batch_is_refused() -> None:
    model = SHAPE.build()
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB, seed=3)
    hooks.micro_batch(batch.labels, batch.loss_mask)
    with pytest.raises(mtp_hooks.MTPHooksStateError, match="without `with`"):
        hooks.micro_batch(batch.labels, batch.loss_mask)
    hooked_train_step(model, hooks, batch)  # the refusal left nothing behind
    assert hooks.metrics()["mtp_1/tokens"] > 0


def test_with_form_drops_unused_targets_on_exit() -> None:
    model = SHAPE.build()
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB, seed=4)
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        pass
    model(*batch.model_args).sum().backward()
    assert hooks.metrics() == {}


def test_every_method_of_removed_hooks_raises_except_remove() -> None:
    model = SHAPE.build()
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB, seed=5)
    hooks.remove()
    for call in (lambda: hooks.micro_batch(batch.labels, batch.loss_mask), hooks.metrics, lambda: hooks.model):
        with pytest.raises(mtp_hooks.MTPHooksStateError, match="these hooks were removed"):
            call()
    hooks.remove()  # harmless twice
    assert "removed" in repr(hooks)


def test_repr_names_model_depth_and_options() -> None:
    model = SHAPE.build()
    hooks = mtp_hooks.attach(model, detach_encoder=True, chunk_size=16)
    text = repr(hooks)
    assert text.startswith("MTPHooks(GPTModel, depth=2") and "detach_encoder=True" in text and "chunk_size=16" in text
    assert "detach_head" not in text  # defaults are not repeated
    hooks.remove()


def test_labels_outside_vocabulary_error_locates_them_and_says_how_to_mask() -> None:
    model = SHAPE.build()
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB, seed=6)
    labels = batch.labels.clone()
    labels[0, 3] = -100
    labels[1, 5] = VOCAB + 7
    with pytest.raises(mtp_hooks.MTPHooksError) as error, hooks.micro_batch(labels):
        model(*batch.model_args)
    message = str(error.value)
    assert "2 ids outside the vocabulary" in message and "-100 at [0, 3]" in message and f"{VOCAB + 7} at [1, 5]" in message
    assert "loss_mask=None every position counts" in message and "loss_mask=(labels >= 0)" in message
    # Masked out, the same labels train.
    with hooks.micro_batch(labels, (labels >= 0) & (labels < VOCAB)):
        model(*batch.model_args).sum().backward()
    assert hooks.metrics()["mtp_1/tokens"] > 0


@pytest.mark.parametrize("validate", ["device", "host"])
def test_both_validate_modes_refuse_bad_values_with_the_same_error(validate: str) -> None:
    model = SHAPE.build()
    hooks = mtp_hooks.attach(model, validate=validate)
    batch = make_batch(VOCAB, seed=7)
    with pytest.raises(mtp_hooks.MTPHooksError, match=r"loss_mask: bad value[\s\S]*values in \{0, 1\}"):
        hooks.micro_batch(batch.labels, torch.full_like(batch.labels, 2.0, dtype=torch.float32))
    labels = batch.labels.clone()
    labels[0, 0] = VOCAB
    with pytest.raises(mtp_hooks.MTPHooksError, match=r"1 ids outside the vocabulary: 64 at \[0, 0\]"):
        model(*batch.model_args, labels=labels)
    hooked_train_step(model, hooks, batch)  # the refusals left nothing behind
    assert hooks.metrics()["mtp_1/tokens"] > 0


def test_validate_off_checks_no_values() -> None:
    model = SHAPE.build()
    hooks = mtp_hooks.attach(model, validate="off")
    batch = make_batch(VOCAB, seed=8)
    with hooks.micro_batch(batch.labels, torch.full(batch.labels.shape, 2.0)):  # accepted unchecked
        model(*batch.model_args).sum().backward()
    assert hooks.metrics()["mtp_1/tokens"] > 0


def test_targets_on_another_device_than_inputs_are_refused_naming_both() -> None:
    model = SHAPE.build()
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB, seed=9)
    with pytest.raises(mtp_hooks.MTPHooksError, match=r"labels: bad value[\s\S]*device of input_ids \(cpu\)[\s\S]*on meta"):
        model(*batch.model_args, labels=batch.labels.to("meta"))
    with pytest.raises(mtp_hooks.MTPHooksError, match=r"labels: bad value[\s\S]*device of input_ids \(cpu\)[\s\S]*on meta"):
        model(*batch.model_args, labels=batch.labels.to("meta"), loss_mask=batch.loss_mask)  # labels named, not the mask
    with pytest.raises(mtp_hooks.MTPHooksError, match=r"loss_mask: bad value[\s\S]*device of labels \(cpu\)[\s\S]*on meta"):
        hooks.micro_batch(batch.labels, batch.loss_mask.to("meta"))
    hooked_train_step(model, hooks, batch)  # nothing left behind
    assert hooks.metrics()["mtp_1/tokens"] > 0
