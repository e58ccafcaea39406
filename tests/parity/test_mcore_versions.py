"""Features that only some megatron-core releases have, each side by side with that release's stock.

Every test here is skipped, with the missing feature named, on releases without it:

* 0.19: ``process_mtp_loss(input_ids=)`` derives MTP labels from ``input_ids`` when a forward has
  none, so stock trains MTP on every labels-free forward. A labels-free (inference) micro-batch
  under the hooks must not.
* 0.19: ``config.mtp_detach_heads`` (MTP heads on a detached output weight, MTP layers on detached
  embeddings and trunk states) and ``config.mtp_grad_scale_func`` (the schedule's scale for
  ``MTPLossAutoScaler``) give the hooked model stock's gradients.
* 0.17+: a depth without targets adds a finite 0 (token count clamped at 1), as the hooks do;
  ``config.mtp_use_repeated_layer`` (one MTP layer applied at every depth) gives stock's
  gradients; ``config.use_mup`` (MuP-scaled MTP logits) is refused at ``attach``.
* 0.18+: ``output_processor`` replaces the main output-layer call and is refused in a training
  micro-batch.
"""

from __future__ import annotations

import dataclasses
import inspect
import functools
from typing import Any, Iterator

import pytest
import torch
from torch import Tensor, nn

import mtp_hooks
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig
from mtp_hooks import _mcore
from mtp_hooks.testing import Batch, TinyGPT, assert_same_grads, cuda_calls_on_cpu, grads_of, hooked_train_step, main_ce_from_logits
from mtp_hooks.testing import make_batch, masked_mean, stock_main_only_step, stock_train_step

VOCAB = 59  # no other dimension of the tiny model is 59
_CONFIG_FIELDS = {field.name for field in dataclasses.fields(TransformerConfig)}


def needs_config_field(name: str) -> Any:
    return pytest.mark.skipif(name not in _CONFIG_FIELDS, reason=f"TransformerConfig has no {name} in this megatron-core")


def mtp_grads(model: nn.Module) -> dict[str, Any]:
    return {name: grad for name, grad in grads_of(model).items() if name.startswith("mtp.")}


def labels_free_step(model: nn.Module, batch: Batch) -> None:
    """A forward without labels (an RL log-prob pass) and the user's main loss on its logits."""
    logits = model(*batch.model_args)
    masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()


# ------------------------------------------------------------------ 0.19: derived MTP labels


@pytest.mark.skipif(
    not _mcore.DERIVES_LABELS_FROM_INPUT_IDS,
    reason="process_mtp_loss(input_ids=) is missing: this megatron-core does not derive MTP labels from input_ids",
)
def test_stock_trains_mtp_on_a_labels_free_forward_and_the_hooks_do_not() -> None:
    """Stock 0.19 trains MTP on labels derived from ``input_ids``; under the hooks the same forward is an
    inference micro-batch: exactly the main-loss gradients, none for MTP."""
    stock, hooked, reference = (TinyGPT(vocab_size=VOCAB).build(seed=9) for _ in range(3))
    batch = make_batch(VOCAB, seq=8)

    labels_free_step(stock, batch)
    assert any(grad is not None and grad.any() for grad in mtp_grads(stock).values())

    mtp_hooks.attach(hooked)
    labels_free_step(hooked, batch)
    stock_main_only_step(reference, batch)
    assert all(grad is None or not grad.any() for grad in mtp_grads(hooked).values())
    assert_same_grads(hooked, reference)


# ----------------------------------------------------------- 0.17+: clamped MTP token count


@pytest.mark.skipif(
    not _mcore.PER_TOKEN_LOSS_RESCALED,
    reason="this megatron-core has no process_mtp_loss and gives NaN here, not 0 (an unclamped token count; pinned by "
    "test_side_by_side.py::test_depths_without_targets_contribute_nothing_where_stock_gives_nan)",
)
@pytest.mark.parametrize("per_token", [False, True], ids=["mean", "per_token"])
def test_depths_without_targets_match_stock_where_it_clamps(per_token: bool) -> None:
    """Only position 0 unmasked, so no depth has a target: stock 0.17+ adds a finite 0, as the hooks do."""
    shape = TinyGPT(vocab_size=VOCAB, config_overrides={"calculate_per_token_loss": per_token})
    stock, hooked = shape.build(seed=19), shape.build(seed=19)
    batch = make_batch(VOCAB, mask="zeros")
    batch.loss_mask[:, 0] = 1
    stock_train_step(stock, batch)
    hooks = mtp_hooks.attach(hooked)
    hooked_train_step(hooked, hooks, batch)
    assert all(grad is None or torch.isfinite(grad).all() for grad in grads_of(stock).values())
    assert_same_grads(hooked, stock)
    assert hooks.metrics()["mtp_1/tokens"] == 0


# --------------------------------------------------------------------- 0.19: config switches


@needs_config_field("mtp_detach_heads")
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("loss_impl", ["lean", "dense"])
def test_config_mtp_detach_heads_gives_stock_gradients(tied: bool, loss_impl: str) -> None:
    shape = TinyGPT(vocab_size=VOCAB, tied=tied, config_overrides={"mtp_detach_heads": True})
    stock, hooked = shape.build(seed=13), shape.build(seed=13)
    batch = make_batch(VOCAB, seq=9)
    stock_train_step(stock, batch)
    hooked_train_step(hooked, mtp_hooks.attach(hooked, loss_impl=loss_impl), batch)
    assert_same_grads(hooked, stock)


@needs_config_field("mtp_detach_heads")
def test_config_mtp_detach_heads_changes_stock_gradients_so_the_pin_can_fail() -> None:
    detached = TinyGPT(vocab_size=VOCAB, config_overrides={"mtp_detach_heads": True}).build(seed=13)
    attached = TinyGPT(vocab_size=VOCAB).build(seed=13)
    batch = make_batch(VOCAB, seq=9)
    stock_train_step(detached, batch)
    stock_train_step(attached, batch)
    assert not torch.allclose(grads_of(detached)["output_layer.weight"], grads_of(attached)["output_layer.weight"])


def run_schedule(model: nn.Module, batches: list[Batch], forward: Any) -> None:
    """mcore's own micro-batch loop (PP = 1): it sets ``MTPLossAutoScaler``'s scale after every forward."""
    forward_backward = get_forward_backward_func()
    data = iter(batches)

    def step(data_iterator: Iterator[Batch], model: nn.Module) -> Any:
        batch = next(data_iterator)
        output, per_token = forward(model, batch)
        return output, functools.partial(user_loss, batch, per_token)

    with cuda_calls_on_cpu():
        forward_backward(
            forward_step_func=step,
            data_iterator=data,
            model=model,
            num_microbatches=len(batches),
            seq_length=batches[0].input_ids.shape[1],
            micro_batch_size=batches[0].input_ids.shape[0],
            forward_only=False,
        )


def user_loss(batch: Batch, per_token: Any, output: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    loss = masked_mean(per_token(output), batch.loss_mask)
    return loss, {"lm loss": loss.detach()}


def stock_forward(model: nn.Module, batch: Batch) -> tuple[Tensor, Any]:
    return model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask), lambda out: out


def hooked_forward(hooks: mtp_hooks.MTPHooks, model: nn.Module, batch: Batch) -> tuple[Tensor, Any]:
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        logits = model(*batch.model_args)
    return logits, lambda out: main_ce_from_logits(out, batch.labels)


@needs_config_field("mtp_grad_scale_func")
@pytest.mark.parametrize("loss_impl", ["lean", "dense"])
def test_config_mtp_grad_scale_func_scales_the_mtp_loss_like_stock(loss_impl: str) -> None:
    shape = TinyGPT(vocab_size=VOCAB)
    stock, hooked, unscaled = (shape.build(seed=15) for _ in range(3))
    for model in (stock, hooked):
        model.config.mtp_grad_scale_func = lambda: torch.tensor(0.25)
    batches = [make_batch(VOCAB, seq=8, seed=30 + i) for i in range(2)]
    hooks = mtp_hooks.attach(hooked, loss_impl=loss_impl)

    run_schedule(stock, batches, stock_forward)
    run_schedule(hooked, batches, functools.partial(hooked_forward, hooks))
    run_schedule(unscaled, batches, stock_forward)

    assert_same_grads(hooked, stock)
    name = "mtp.layers.0.eh_proj.weight"
    assert not torch.allclose(grads_of(stock)[name], grads_of(unscaled)[name]), "the scale must reach the MTP loss"


# ------------------------------------------------------------------------- 0.17+ config


@needs_config_field("mtp_use_repeated_layer")
@pytest.mark.parametrize("detach_encoder", [False, True])
def test_repeated_mtp_layer_gives_stock_gradients(detach_encoder: bool) -> None:
    """One MTP layer applied at every depth; with ``detach_encoder`` only its depth-0 input is cut."""
    shape = TinyGPT(vocab_size=VOCAB, mtp_num_layers=3, config_overrides={"mtp_use_repeated_layer": True})
    stock, hooked, reference = (shape.build(seed=17) for _ in range(3))
    assert len(hooked.mtp.layers) == 1
    batch = make_batch(VOCAB, seq=10)
    hooks = mtp_hooks.attach(hooked, detach_encoder=detach_encoder)
    hooked_train_step(hooked, hooks, batch)
    assert hooks.metrics()["mtp_3/tokens"] > 0
    if not detach_encoder:
        stock_train_step(stock, batch)
        assert_same_grads(hooked, stock)
        return
    stock_main_only_step(reference, batch)
    expected = grads_of(reference)
    for name, grad in grads_of(hooked).items():
        if name.startswith("embedding.") or name.startswith("decoder."):
            torch.testing.assert_close(grad, expected[name], msg=lambda m: f"{name}: {m}")


@needs_config_field("use_mup")
def test_mup_config_is_refused_at_attach() -> None:
    model = TinyGPT(vocab_size=VOCAB).build(seed=1)
    model.config.use_mup = True
    with pytest.raises(mtp_hooks.MTPHooksError, match="use_mup"):
        mtp_hooks.attach(model)
    assert mtp_hooks.hooks_of(model) is None


@pytest.mark.skipif(
    "output_processor" not in inspect.signature(GPTModel.forward).parameters,
    reason="GPTModel.forward has no output_processor in this megatron-core",
)
def test_output_processor_is_refused_in_a_training_micro_batch_and_leaves_the_model_stock() -> None:
    model = TinyGPT(vocab_size=VOCAB).build(seed=1)
    config = model.config
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB, seq=8)
    with pytest.raises(mtp_hooks.MTPHooksError, match="output_processor"):
        model(*batch.model_args, labels=batch.labels, output_processor=lambda **kwargs: None)
    assert model.config is config and model.mtp_process is True
    assert hooked_train_step(model, hooks, batch).shape == (2, 8, VOCAB)
