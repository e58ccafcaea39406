"""Several hooked models in one process: actor and reference, two actors, two threads.

All per-model state (pending labels, the forward in flight, metrics) lives in that model's own
``MTPHooks``, so interleaved ``micro_batch`` contexts and forwards of different models never mix
labels or metrics. Each model is compared with its own stock twin.

The one process-wide piece is mcore's ``MTPLossAutoScaler.main_loss_backward_scale``. Contract,
pinned here: ``mtp_hooks`` never sets or reads it itself; it rides on mcore's ``MTPLossAutoScaler``
exactly like stock, so the value in effect **when backward runs through a model's graph** (not when
its forward ran) multiplies that model's MTP gradient, whichever model it is. mcore's schedules
set it in every ``forward_step``; outside them, call ``MTPLossAutoScaler.set_loss_scale(scale)``
before each backward whose models need a different scale.
"""

from __future__ import annotations

import threading
from typing import Optional

import pytest
import torch
from torch import Tensor, nn

import mtp_hooks
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
from mtp_hooks.testing import Batch, TinyGPT, assert_same_grads, grads_of, main_ce_from_logits, make_batch, masked_mean, output_layer_calls
from mtp_hooks.testing import stock_mtp_losses, stock_train_step

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB = 32


def shape(depth: int) -> TinyGPT:
    return TinyGPT(vocab_size=VOCAB, hidden_size=16, num_layers=1, num_attention_heads=2, mtp_num_layers=depth)


def user_loss(logits: Tensor, batch: Batch) -> Tensor:
    return masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask)


def stock_losses_for(model: nn.Module, batch: Batch) -> list[float]:
    stock_train_step(model, batch)
    return stock_mtp_losses()


def losses(metrics: dict[str, float], depth: int) -> list[float]:
    return [metrics[f"mtp_{k}/loss"] for k in range(1, depth + 1)]


def mtp_tokens(batch: Batch) -> float:
    return batch.loss_mask[:, 1:].sum().item()


def set_scale(value: float) -> None:
    MTPLossAutoScaler.set_loss_scale(torch.tensor(value))


# ------------------------------------------------------------------- interleaved models


@pytest.mark.parametrize("depths", [(2, 2), (1, 3)], ids=["same_depth", "different_depth"])
def test_interleaved_micro_batches_of_two_actors_never_cross(depths: tuple[int, int]) -> None:
    depth_a, depth_b = depths
    actor_a, stock_a = shape(depth_a).build(1), shape(depth_a).build(1)
    actor_b, stock_b = shape(depth_b).build(2), shape(depth_b).build(2)
    hooks_a, hooks_b = mtp_hooks.attach(actor_a), mtp_hooks.attach(actor_b, loss_impl="dense")
    assert mtp_hooks.hooks_of(actor_a) is hooks_a and mtp_hooks.hooks_of(actor_b) is hooks_b
    batch_a, batch_b = make_batch(VOCAB, seed=10), make_batch(VOCAB, batch=3, seed=20)  # different masks and shapes

    # A's context opens, B's opens inside it, B's forward runs first, then A's, then B's context closes
    with hooks_a.micro_batch(batch_a.labels, batch_a.loss_mask):
        with hooks_b.micro_batch(batch_b.labels, batch_b.loss_mask):
            logits_b = actor_b(*batch_b.model_args)
            logits_a = actor_a(*batch_a.model_args)
    (user_loss(logits_a, batch_a) + user_loss(logits_b, batch_b)).backward()
    # drop-in form, also interleaved: B's labels in the call while A's context is open
    second_a, second_b = make_batch(VOCAB, seed=11), make_batch(VOCAB, batch=3, seed=21)
    with hooks_a.micro_batch(second_a.labels, second_a.loss_mask):
        logits_b = actor_b(*second_b.model_args, labels=second_b.labels, loss_mask=second_b.loss_mask)
        logits_a = actor_a(*second_a.model_args)
    user_loss(logits_b, second_b).backward()
    user_loss(logits_a, second_a).backward()

    expected_a = [stock_losses_for(stock_a, b) for b in (batch_a, second_a)]
    expected_b = [stock_losses_for(stock_b, b) for b in (batch_b, second_b)]
    assert_same_grads(actor_a, stock_a)
    assert_same_grads(actor_b, stock_b)
    metrics_a, metrics_b = hooks_a.metrics(), hooks_b.metrics()
    assert metrics_a["mtp_1/tokens"] == mtp_tokens(batch_a) + mtp_tokens(second_a)
    assert metrics_b["mtp_1/tokens"] == mtp_tokens(batch_b) + mtp_tokens(second_b)
    assert metrics_a["mtp_1/tokens"] != metrics_b["mtp_1/tokens"]  # guard: crossing would show
    assert set(metrics_a) == {f"mtp_{k}/{m}" for k in range(1, depth_a + 1) for m in ("loss", "acc", "tokens")}
    assert set(metrics_b) == {f"mtp_{k}/{m}" for k in range(1, depth_b + 1) for m in ("loss", "acc", "tokens")}
    # token-weighted means of the two micro-batches' per-depth losses
    for metrics, expected, batches, depth in (
        (metrics_a, expected_a, (batch_a, second_a), depth_a),
        (metrics_b, expected_b, (batch_b, second_b), depth_b),
    ):
        for k in range(1, depth + 1):
            weights = [b.loss_mask[:, k:].sum().item() for b in batches]
            mean = sum(w * e[k - 1] for w, e in zip(weights, expected)) / sum(weights)
            assert metrics[f"mtp_{k}/loss"] == pytest.approx(mean, rel=1e-5), k


def test_reference_model_inside_actor_micro_batch_stays_inference() -> None:
    """Actor trains; the reference (a hooked frozen copy) scores the same tokens inside the actor's micro_batch."""
    actor, stock_actor = shape(2).build(1), shape(2).build(1)
    reference, stock_reference = shape(2).build(5), shape(2).build(5)
    for param in reference.parameters():
        param.requires_grad_(False)
    hooks_actor, hooks_reference = mtp_hooks.attach(actor), mtp_hooks.attach(reference)
    batch = make_batch(VOCAB, seed=3)

    with hooks_actor.micro_batch(batch.labels, batch.loss_mask):
        with torch.no_grad():
            ref_logits = reference(*batch.model_args)  # no labels: must not take the actor's
            with hooks_reference.micro_batch(batch.labels, batch.loss_mask):
                ref_logits_labelled = reference(*batch.model_args)  # labels but no grad: inference
        logits = actor(*batch.model_args)
    log_p = torch.log_softmax(logits.float(), -1)
    kl_like = (log_p.exp() * (log_p - torch.log_softmax(ref_logits, -1))).sum(-1)
    (user_loss(logits, batch) + masked_mean(kl_like, batch.loss_mask)).backward()

    with output_layer_calls(stock_reference) as calls, torch.no_grad():
        stock_reference(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    stock_mtp_losses()
    assert torch.equal(ref_logits, calls[-1].transpose(0, 1))
    assert torch.equal(ref_logits_labelled, ref_logits)
    assert hooks_reference.metrics() == {}
    assert all(param.grad is None for param in reference.parameters())

    # the actor's step equals stock with the same user loss (the reference logits are constants)
    _stock_actor_step_with_kl(stock_actor, batch, ref_logits)
    assert_same_grads(actor, stock_actor)
    assert hooks_actor.metrics()["mtp_1/tokens"] == mtp_tokens(batch)


def _stock_actor_step_with_kl(model: nn.Module, batch: Batch, ref_logits: Tensor) -> None:
    """Stock actor step with the same extra term: the main logits are taken live (with grad) from
    the stock output layer by a forward hook, the loss is stock's per-token loss plus that term.
    The hook keeps a clone: mcore's cross-entropy later works in place on the logits it got."""
    live: list[Tensor] = []
    handle = model.output_layer.register_forward_hook(lambda m, a, out: live.append(out[0].clone()))
    try:
        per_token = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    finally:
        handle.remove()
    logits = live[-1].transpose(0, 1)
    log_p = torch.log_softmax(logits.float(), -1)
    kl_like = (log_p.exp() * (log_p - torch.log_softmax(ref_logits, -1))).sum(-1)
    (masked_mean(per_token, batch.loss_mask) + masked_mean(kl_like, batch.loss_mask)).backward()
    stock_mtp_losses()


def test_removing_one_models_hooks_leaves_the_other_working() -> None:
    actor_a, actor_b, stock_b, untouched_a = shape(2).build(1), shape(2).build(2), shape(2).build(2), shape(2).build(1)
    hooks_a, hooks_b = mtp_hooks.attach(actor_a), mtp_hooks.attach(actor_b)
    batch = make_batch(VOCAB, seed=4)
    hooks_a.remove()
    assert mtp_hooks.hooks_of(actor_a) is None and mtp_hooks.hooks_of(actor_b) is hooks_b
    assert torch.equal(stock_train_step(actor_a, batch).loss, stock_train_step(untouched_a, batch).loss)
    assert_same_grads(actor_a, untouched_a, atol=0, rtol=0)
    with hooks_b.micro_batch(batch.labels, batch.loss_mask):
        logits = actor_b(*batch.model_args)
    user_loss(logits, batch).backward()
    stock_train_step(stock_b, batch)
    assert_same_grads(actor_b, stock_b)


def test_two_models_in_two_threads_at_once_each_equal_their_stock_twin() -> None:
    """Different models may run concurrently: nothing is shared between their hooks."""
    models = [shape(2).build(seed) for seed in (1, 2)]
    twins = [shape(2).build(seed) for seed in (1, 2)]
    hooks = [mtp_hooks.attach(model) for model in models]
    batches = [[make_batch(VOCAB, seed=10 * i + j) for j in range(4)] for i in range(2)]
    start = threading.Barrier(2)
    errors: list[Optional[BaseException]] = [None, None]

    def work(i: int) -> None:
        try:
            start.wait()
            for batch in batches[i]:
                with hooks[i].micro_batch(batch.labels, batch.loss_mask):
                    logits = models[i](*batch.model_args)
                user_loss(logits, batch).backward()
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors[i] = error

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [None, None]
    for i in range(2):
        for batch in batches[i]:
            stock_train_step(twins[i], batch)
        stock_mtp_losses()
        assert_same_grads(models[i], twins[i])
        assert hooks[i].metrics()["mtp_1/tokens"] == sum(mtp_tokens(b) for b in batches[i])


# ------------------------------------------------------------- the process-wide backward scale


def mtp_layer_grads(model: nn.Module) -> dict[str, Tensor]:
    """Gradients of the MTP layers: they come from the MTP loss alone, so they scale with it."""
    return {name: grad for name, grad in grads_of(model).items() if name.startswith("mtp.layers.") and grad is not None}


def test_scale_in_effect_at_backward_time_multiplies_the_mtp_gradient() -> None:
    hooked, stock, unit = shape(2).build(1), shape(2).build(1), shape(2).build(1)
    hooks, unit_hooks = mtp_hooks.attach(hooked), mtp_hooks.attach(unit)
    batch = make_batch(VOCAB, seed=5)

    set_scale(1.0)
    with unit_hooks.micro_batch(batch.labels, batch.loss_mask):
        unit_logits = unit(*batch.model_args)
    user_loss(unit_logits, batch).backward()

    set_scale(4.0)  # in effect at forward ...
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        logits = hooked(*batch.model_args)
    per_token = stock(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    set_scale(0.25)  # ... but this one is in effect at backward
    user_loss(logits, batch).backward()
    masked_mean(per_token, batch.loss_mask).backward()
    stock_mtp_losses()

    assert_same_grads(hooked, stock)  # like stock: same scale, same moment
    unit_grads, grads = mtp_layer_grads(unit), mtp_layer_grads(hooked)
    assert unit_grads.keys() == grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, 0.25 * unit_grads[name], msg=lambda m: f"{name}: {m}")
    hooks.metrics()
    # the hooks themselves never set the scale: attach, a micro-batch, backward and remove keep the object
    set_scale(1.0)
    value = MTPLossAutoScaler.main_loss_backward_scale
    mtp_hooks.attach(shape(1).build(3)).remove()
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        user_loss(hooked(*batch.model_args), batch).backward()
    hooks.remove()
    assert MTPLossAutoScaler.main_loss_backward_scale is value and float(value) == 1.0


@pytest.mark.parametrize("one_backward", [True, False], ids=["one_backward_for_both", "one_backward_each"])
def test_each_models_mtp_gradient_takes_the_scale_of_its_own_backward(one_backward: bool) -> None:
    models = {name: shape(2).build(seed) for name, seed in (("a", 1), ("b", 2))}
    stocks = {name: shape(2).build(seed) for name, seed in (("a", 1), ("b", 2))}
    hooks = {name: mtp_hooks.attach(model) for name, model in models.items()}
    batches = {"a": make_batch(VOCAB, seed=6), "b": make_batch(VOCAB, seed=7)}
    scales = {"a": 0.5, "b": 0.5} if one_backward else {"a": 0.5, "b": 3.0}

    set_scale(10.0)  # whatever is set at forward time does not matter
    ours: dict[str, Tensor] = {}
    theirs: dict[str, Tensor] = {}
    for name in ("a", "b"):
        batch = batches[name]
        with hooks[name].micro_batch(batch.labels, batch.loss_mask):
            ours[name] = user_loss(models[name](*batch.model_args), batch)
        theirs[name] = masked_mean(stocks[name](*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask), batch.loss_mask)
    stock_mtp_losses()
    if one_backward:
        set_scale(scales["a"])
        torch.autograd.backward([ours["a"], ours["b"], theirs["a"], theirs["b"]])
    else:
        for name in ("b", "a"):
            set_scale(scales[name])
            ours[name].backward()
            theirs[name].backward()
    for name in ("a", "b"):
        assert_same_grads(models[name], stocks[name])

    # and the scales really differ in effect: against a scale-1 run of the same model
    for name in ("a", "b"):
        unit = shape(2).build(1 if name == "a" else 2)
        unit_hooks = mtp_hooks.attach(unit)
        set_scale(1.0)
        batch = batches[name]
        with unit_hooks.micro_batch(batch.labels, batch.loss_mask):
            user_loss(unit(*batch.model_args), batch).backward()
        for param_name, grad in mtp_layer_grads(models[name]).items():
            torch.testing.assert_close(grad, scales[name] * mtp_layer_grads(unit)[param_name], msg=lambda m: f"{name}.{param_name}: {m}")
