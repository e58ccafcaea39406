"""A real micro-batch loop through mcore's ``get_forward_backward_func()`` (PP = 1), mixing
training and inference micro-batches; accumulated gradients must equal stock mcore's.

Four micro-batches, in this order:

1. training, labels passed to the model (``model(..., labels=, loss_mask=)``);
2. inference with gradients on: no labels, the user's main loss on the logits still trains the
   trunk and head;
3. training through ``hooks.micro_batch``;
4. inference under ``torch.no_grad()`` (labels given, ignored for MTP): contributes no gradient.

Stock reference, the same schedule on a twin: 1 and 3 are stock training forwards; 2 is a stock
forward whose MTP loss weighs 0 for that micro-batch (``config.mtp_loss_scaling_factor = 0``
during its forward), i.e. main-loss gradients only, computed by stock mcore and not by the hooks;
4 is a stock forward under ``torch.no_grad()``. The user loss is the same in both runs: the
masked sum of the main CE with the token count, so mcore divides by tokens and micro-batches.
The schedule sets ``MTPLossAutoScaler``'s scale (1 / num_microbatches, or 1 with per-token loss,
times ``grad_scale_func(1)``) after every forward in both runs.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

import mtp_hooks
from megatron.core.pipeline_parallel import get_forward_backward_func
from mtp_hooks.testing import Batch, TinyGPT, assert_same_grads, main_ce_from_logits, make_batch, stock_mtp_losses

VOCAB = 64
SEQ = 10
MICRO_BATCH = 2
KINDS = ("train_kwargs", "infer_grad", "train_context", "infer_no_grad")
TRAINING = ("train_kwargs", "train_context")


class _CudaFactoriesOnCpu(TorchFunctionMode):
    """Send tensors that mcore's schedule creates with ``device="cuda"`` to the CPU.

    ``forward_backward_no_pipelining`` allocates its token counter on ``"cuda"``; this is the same
    kind of CPU accommodation as ``cuda_current_device_is_cpu`` and changes no computation.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def micro_batches() -> list[tuple[str, Batch]]:
    return [(kind, make_batch(VOCAB, batch=MICRO_BATCH, seq=SEQ, mask="random", seed=10 + i)) for i, kind in enumerate(KINDS)]


def user_loss(batch: Batch, per_token_fn: Callable[[Tensor], Tensor], output: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """mcore's 3-tuple loss: masked sum, token count, and the masked mean for logging."""
    assert batch.loss_mask is not None
    per_token = per_token_fn(output)
    total = (per_token * batch.loss_mask).sum()
    tokens = batch.loss_mask.sum().to(torch.int)
    return total, tokens, {"lm loss": (total / tokens).detach()}


def run_schedule(model: nn.Module, step: Callable[[Any, nn.Module], Any]) -> list[dict[str, Tensor]]:
    forward_backward = get_forward_backward_func()
    assert forward_backward.__name__ == "forward_backward_no_pipelining"
    with _CudaFactoriesOnCpu():
        return forward_backward(
            forward_step_func=step,
            data_iterator=iter(micro_batches()),
            model=model,
            num_microbatches=len(KINDS),
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            decoder_seq_length=SEQ,
            forward_only=False,
        )


def hooked_step(hooks: mtp_hooks.MTPHooks, data: Iterator[tuple[str, Batch]], model: nn.Module) -> Any:
    kind, batch = next(data)
    args = batch.model_args
    if kind == "train_kwargs":
        logits = model(*args, labels=batch.labels, loss_mask=batch.loss_mask)
    elif kind == "infer_grad":
        logits = model(*args)
    elif kind == "train_context":
        with hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
            logits = model(*args)
    else:
        with torch.no_grad(), hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
            logits = model(*args)
    return logits, functools.partial(user_loss, batch, lambda out: main_ce_from_logits(out, batch.labels))


def stock_step(recorded: dict[str, list[float]], data: Iterator[tuple[str, Batch]], model: nn.Module) -> Any:
    kind, batch = next(data)
    args = batch.model_args
    if kind in TRAINING:
        per_token = model(*args, labels=batch.labels, loss_mask=batch.loss_mask)
    elif kind == "infer_grad":
        factor = model.config.mtp_loss_scaling_factor
        model.config.mtp_loss_scaling_factor = 0.0
        try:
            per_token = model(*args, labels=batch.labels)
        finally:
            model.config.mtp_loss_scaling_factor = factor
    else:
        with torch.no_grad():
            per_token = model(*args, labels=batch.labels, loss_mask=batch.loss_mask)
    recorded[kind] = stock_mtp_losses()
    return per_token, functools.partial(user_loss, batch, lambda out: out)


@pytest.mark.parametrize("grad_scale", [None, 8.0], ids=["no_grad_scale", "grad_scale_8"])
@pytest.mark.parametrize("per_token", [False, True], ids=["mean", "per_token"])
@pytest.mark.parametrize("impl", ["lean", "dense"])
def test_schedule_with_mixed_micro_batches_accumulates_stock_gradients(impl: str, per_token: bool, grad_scale: Optional[float]) -> None:
    spec = TinyGPT(mtp_num_layers=2, config_overrides={"calculate_per_token_loss": per_token})
    stock, hooked = spec.build(seed=12), spec.build(seed=12)
    for model in (stock, hooked):
        model.config.grad_scale_func = None if grad_scale is None else (lambda t, s=grad_scale: t * s)
    hooks = mtp_hooks.attach(hooked, loss_impl=impl, chunk_size=6)
    mtp_runs: list[int] = []
    probe = hooked.mtp.register_forward_pre_hook(lambda m, a: mtp_runs.append(1))

    recorded: dict[str, list[float]] = {}
    stock_store = run_schedule(stock, functools.partial(stock_step, recorded))
    hooked_store = run_schedule(hooked, functools.partial(hooked_step, hooks))
    probe.remove()

    assert len(mtp_runs) == len(TRAINING), "the MTP block must run on training micro-batches only"
    # Per-token losses are sums over ~SEQ * MICRO_BATCH tokens and grad_scale multiplies them:
    # float rounding grows by the same factor, so the absolute tolerance does too.
    magnitude = (grad_scale or 1.0) * (SEQ * MICRO_BATCH if per_token else 1)
    assert_same_grads(hooked, stock, atol=1e-6 * magnitude)
    assert any(p.grad is not None and p.grad.any() for n, p in hooked.named_parameters() if n.startswith("mtp."))
    assert [d["lm loss"].item() for d in hooked_store] == pytest.approx([d["lm loss"].item() for d in stock_store], rel=1e-5)

    metrics = hooks.metrics()
    batches = dict(micro_batches())
    for k in (1, 2):
        tokens = {kind: batches[kind].loss_mask[:, k:].sum().item() for kind in TRAINING}
        assert metrics[f"mtp_{k}/tokens"] == sum(tokens.values()), "inference micro-batches must not count"
        expected = sum(recorded[kind][k - 1] * tokens[kind] for kind in TRAINING) / sum(tokens.values())
        assert metrics[f"mtp_{k}/loss"] == pytest.approx(expected, rel=1e-5)


def test_schedule_reference_sees_the_mtp_loss_so_the_comparison_can_fail() -> None:
    """Control: with the MTP loss of the hooked run scaled differently, gradients differ from stock."""
    spec = TinyGPT(mtp_num_layers=2)
    stock, hooked = spec.build(seed=12), spec.build(seed=12)
    hooks = mtp_hooks.attach(hooked, loss_scale=0.6)  # stock uses 0.3
    run_schedule(stock, functools.partial(stock_step, {}))
    run_schedule(hooked, functools.partial(hooked_step, hooks))
    with pytest.raises(AssertionError):
        assert_same_grads(hooked, stock)
