"""A ``micro_batch`` block whose targets trained nothing says so, once per hooks object.

The usual cause is a training forward run by mistake under ``torch.no_grad``: the forward is then
inference and the MTP layers silently get no gradient. A grad-disabled forward inside a block is
also a legitimate inference pass (one forward function for training and scoring), so the block is
not refused: it warns (``UserWarning``) once per attached model. With ``output="logprobs"`` a
grad-disabled forward scores the block's labels, which is their use: no warning.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import mtp_hooks
from mtp_hooks.testing import TinyGPT, hooked_train_step, make_batch

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB = 64
SHAPE = TinyGPT(vocab_size=VOCAB)
UNUSED = "micro_batch block ended and its targets trained nothing"


def ours(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if UNUSED in str(w.message)]


def test_block_whose_only_forward_ran_under_no_grad_warns_once_per_hooks_object() -> None:
    model, other = SHAPE.build(7), SHAPE.build(7)
    hooks, other_hooks = mtp_hooks.attach(model), mtp_hooks.attach(other)
    batch = make_batch(VOCAB, seed=1)
    with pytest.warns(UserWarning, match=UNUSED) as caught:
        with hooks.micro_batch(batch.labels, batch.loss_mask), torch.no_grad():
            model(*batch.model_args)
    (warning,) = [w for w in caught if UNUSED in str(w.message)]
    assert "gradients disabled" in str(warning.message) and "inside the `with` block" in str(warning.message)
    assert warning.filename == __file__  # attributed to the user's `with`, not to mtp_hooks
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        with hooks.micro_batch(batch.labels, batch.loss_mask), torch.inference_mode():
            model(*batch.model_args)
    assert ours(again) == []  # once per hooks object
    with pytest.warns(UserWarning, match=UNUSED):
        with other_hooks.micro_batch(batch.labels, batch.loss_mask), torch.no_grad():
            other(*batch.model_args)
    assert hooks.metrics() == {}


def test_block_without_any_forward_of_the_model_warns() -> None:
    model = SHAPE.build(7)
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB, seed=2)
    with pytest.warns(UserWarning, match=UNUSED) as caught:
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            pass
    assert "no forward of the model ran inside it" in ours(list(caught))[0]


def test_blocks_that_train_score_or_raise_do_not_warn() -> None:
    """A training forward (after a grad-disabled one in the same block), a log-prob scoring pass
    under ``no_grad``, and a block left by an exception (which says enough) stay silent."""
    model, scorer = SHAPE.build(7), SHAPE.build(7)
    hooks, scoring = mtp_hooks.attach(model), mtp_hooks.attach(scorer, output="logprobs")
    batch = make_batch(VOCAB, seed=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            with torch.no_grad():
                model(*batch.model_args)
            model(*batch.model_args).sum().backward()
        hooked_train_step(model, hooks, batch)
        with scoring.micro_batch(batch.labels, batch.loss_mask), torch.no_grad():
            scorer(*batch.model_args)
        with pytest.raises(RuntimeError, match="user code"):
            with hooks.micro_batch(batch.labels, batch.loss_mask):
                raise RuntimeError("user code failed before the forward")
    assert ours(caught) == []
    assert hooks.metrics()["mtp_1/tokens"] > 0
