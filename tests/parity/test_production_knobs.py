"""The knobs production Megatron runs set, each side by side with stock mcore (same weights, same batch).

* ``gradient_accumulation_fusion=True`` under mcore's DDP, tied and untied heads, every loss path:
  every parameter's ``main_grad`` as stock's, also when the MTP loss scale changes between forward
  and backward (the schedule sets it after the forward). The fused wgrad kernel is the CPU stand-in
  of ``mtp_hooks.testing.fused_wgrad_kernel_on_cpu``.
* ``defer_embedding_wgrad_compute``: the MTP heads' share reaches ``main_grad`` in backward and the
  main head's deferred share is drained by mcore's own ``drain_embedding_wgrad_compute``.
* ``Float16Module`` in fp16 with a loss scaler at 1, 2^15, 2^16 and 2^32, and with small MTP
  coefficients; bf16 with schedule scales 1/3 and 1/7: the gradients' error against an fp32 twin
  is within stock's.
* Hooks on the output layer (a soft-capping forward hook on ``output_layer``, a global forward
  hook): the MTP losses and gradients as stock's, whose MTP heads call the hooked layer.
* ``output="logprobs"`` under ``Float16Module`` (bf16) and mcore's DDP around it: the model still
  returns ``TokenLogProbs`` (the wrapper's fp32 upcast rebuilds tuples), equal to the logits path's.
* An output layer whose class has its own ``forward`` (soft-capping) or ``_forward_impl``, no hooks:
  the same, through the path that calls it; ``output="logprobs"`` and the draft objectives refuse it.
* ``loss_mask=None`` with ``calculate_per_token_loss``: no tensor built from host data and no host
  sync in the micro-batch (``tests.lifecycle.test_host_syncs`` holds the counters).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Iterator

import pytest
import torch
from torch import Tensor, nn

import mtp_hooks
from benchmarks.counters import HostSyncs, HostToDevice
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from mtp_hooks.testing import Batch, TinyGPT, fused_wgrad_kernel_on_cpu, main_ce_from_logits, make_batch, masked_mean, stock_mtp_losses
from tests.support.parity import assert_same_main_grads, main_grads, mcore_ddp, relative_error
from tests.support.parity import schedule_step as step

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB = 64
PATHS = ("lean", "fused", "recompute", "dense")


# --------------------------------------------------------------------------- shared steps


def stock_loss(model: nn.Module, batch: Batch) -> Tensor:
    MTPLossLoggingHelper.tracker.clear()
    per_token = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
    return masked_mean(per_token, batch.loss_mask)


def hooked_loss(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch) -> Tensor:
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        logits = model(*batch.model_args)
    return masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask)


# --------------------------------------------------------------------------- gradient-accumulation fusion


def ddp_twin(seed: int, tied: bool, **overrides: Any) -> tuple[nn.Module, DistributedDataParallel]:
    spec = TinyGPT(vocab_size=VOCAB, tied=tied, config_overrides={"gradient_accumulation_fusion": True, **overrides})
    model = spec.build(seed=seed)
    return model, mcore_ddp(model)


@pytest.mark.parametrize("scale_in_forward", [0.5, 1.0], ids=["scale changes after forward", "same scale"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("path", PATHS)
def test_gradient_accumulation_fusion_main_grads_equal_stock(path: str, tied: bool, scale_in_forward: float) -> None:
    """Two micro-batches into DDP's ``main_grad``; the MTP share of the output weight included."""
    batches = [make_batch(VOCAB, seed=11), make_batch(VOCAB, seed=12)]
    with fused_wgrad_kernel_on_cpu():
        stock_model, stock = ddp_twin(1, tied)
        hooked_model, hooked = ddp_twin(1, tied)
        hooks = mtp_hooks.attach(hooked, loss_impl=path)
        for batch in batches:
            step(lambda: stock_loss(stock, batch), 0.25, scale_in_forward)
            step(lambda: hooked_loss(hooked, hooks, batch), 0.25, scale_in_forward)
    expected = main_grads(stock_model)
    assert expected["output_layer.weight" if not tied else "embedding.word_embeddings.weight"].abs().sum() > 0
    assert_same_main_grads(main_grads(hooked_model), expected)
    assert all(p.grad is None for p in hooked_model.parameters()), "DDP's hook consumed every .grad"


def _defer_twin(seed: int) -> tuple[nn.Module, DistributedDataParallel]:
    """A model whose output layer defers its weight gradient, as on the last pipeline stage.

    mcore accepts ``defer_embedding_wgrad_compute`` only with pipeline parallelism, and with the
    local layer spec every ``ColumnParallelLinear`` of the trunk would defer too (TE's layers do
    not); here only the output layer gets the flag (its own config copy) and GPTModel's buffers.
    """
    model, ddp = ddp_twin(seed, tied=False)
    layer = model.output_layer
    layer.config = copy.copy(layer.config)
    layer.config.defer_embedding_wgrad_compute = True
    model.embedding_activation_buffer, model.grad_output_buffer = [], []
    layer.embedding_activation_buffer, layer.grad_output_buffer = model.embedding_activation_buffer, model.grad_output_buffer
    return model, ddp


def _drain(model: nn.Module) -> None:
    from megatron.core.utils import drain_embedding_wgrad_compute

    layer = model.output_layer
    drain_embedding_wgrad_compute(layer.config, model.embedding_activation_buffer, model.grad_output_buffer, layer.weight, layer.tp_group)


@pytest.mark.parametrize("path", ("lean", "fused", "recompute"))
def test_defer_embedding_wgrad_compute_main_grads_equal_stock_without_deferral(path: str) -> None:
    """Two micro-batches deferred (drained by mcore after the last backward, as its pipeline
    schedules do) equal stock computing the same micro-batches undeferred."""
    batches = [make_batch(VOCAB, seed=14), make_batch(VOCAB, seed=15)]
    with fused_wgrad_kernel_on_cpu():
        stock_model, stock = ddp_twin(2, tied=False)
        hooked_model, hooked = _defer_twin(2)
        hooks = mtp_hooks.attach(hooked, loss_impl=path)
        for batch in batches:
            step(lambda: stock_loss(stock, batch), 0.5)
            step(lambda: hooked_loss(hooked, hooks, batch), 0.5)
        assert len(hooked_model.grad_output_buffer) == len(batches)  # the main head's share waits
        _drain(hooked_model)
    assert_same_main_grads(main_grads(hooked_model), main_grads(stock_model))


# --------------------------------------------------------------------------- mixed precision


def _precision_models(dtype: torch.dtype, factor: float) -> tuple[nn.Module, nn.Module, nn.Module]:
    """fp32 reference, stock and hooked twins in ``dtype`` under ``Float16Module``, same weights."""
    overrides = {"mtp_loss_scaling_factor": factor}
    reference = TinyGPT(vocab_size=VOCAB, hidden_size=16, num_layers=1, config_overrides=overrides).build(seed=3)
    low = dataclasses.replace(
        TinyGPT(vocab_size=VOCAB, hidden_size=16, num_layers=1, params_dtype=dtype),
        config_overrides={**overrides, "fp16": dtype == torch.float16, "bf16": dtype == torch.bfloat16},
    )
    twins = []
    for _ in range(2):
        model = low.build(seed=3)
        model.load_state_dict({k: v.to(dtype) if v is not None and v.is_floating_point() else v for k, v in reference.state_dict().items()}, strict=False)
        twins.append(Float16Module(model.config, model))
    return reference, twins[0], twins[1]


def _grads(model: nn.Module) -> dict[str, Tensor]:
    inner = getattr(model, "module", model)
    return {name: p.grad.double() for name, p in inner.named_parameters() if p.grad is not None and name.startswith(("mtp", "output_layer"))}


def _errors(grads: dict[str, Tensor], reference: dict[str, Tensor], scale: float) -> tuple[float, bool]:
    """Largest error of ``grads / scale`` against the fp32 reference, relative to each parameter's
    largest reference entry; and whether every gradient is finite (a loss scaler skips the step otherwise)."""
    finite = all(bool(torch.isfinite(g).all()) for g in grads.values())
    if not finite:
        return float("inf"), False
    return max(relative_error(grads[n] / scale, ref) for n, ref in reference.items()), True


def _fitted_scale(grads: dict[str, Tensor], reference: dict[str, Tensor], scale: float) -> float:
    """Least-squares factor between the MTP layers' ``grads / scale`` and the reference (gradients
    from the MTP loss alone): 1 unless a scale was rounded."""
    mtp = {n: ref for n, ref in reference.items() if n.startswith("mtp.")}
    num = sum(float((grads[n] / scale * ref).sum()) for n, ref in mtp.items())
    return num / sum(float((ref * ref).sum()) for ref in mtp.values())


def _mixed_precision_errors(dtype: torch.dtype, scale: float, factor: float, seq: int = 32) -> dict[str, Any]:
    batch = make_batch(VOCAB, batch=2, seq=seq, seed=21)
    reference, stock, hooked = _precision_models(dtype, factor)
    step(lambda: stock_loss(reference, batch), 1.0)
    expected = _grads(reference)
    step(lambda: stock_loss(stock, batch), scale, scale)
    hooks = mtp_hooks.attach(hooked)
    step(lambda: hooked_loss(hooked, hooks, batch), scale, scale)
    stock_grads, hooked_grads = _grads(stock), _grads(hooked)
    assert stock_grads.keys() == hooked_grads.keys() == expected.keys()
    return {
        "stock": _errors(stock_grads, expected, scale),
        "lean": _errors(hooked_grads, expected, scale),
        "stock_scale": _fitted_scale(stock_grads, expected, scale) if _errors(stock_grads, expected, scale)[1] else None,
        "lean_scale": _fitted_scale(hooked_grads, expected, scale) if _errors(hooked_grads, expected, scale)[1] else None,
    }


@pytest.mark.parametrize("scale", [1.0, 2.0**15, 2.0**16, 2.0**32], ids=["1", "2^15", "2^16", "2^32"])
@pytest.mark.parametrize("factor", [0.3, 1e-3], ids=["factor 0.3", "factor 1e-3"])
def test_fp16_loss_scaler_gradients_within_stock_error(scale: float, factor: float) -> None:
    """fp16 under ``Float16Module`` with the main loss and the MTP scale multiplied by a loss
    scaler's value: where stock's gradients are finite, lean's are too and no further from an fp32
    twin (at most 1.5x stock's error, plus 1e-3); where stock overflows, lean reports the overflow
    as well, so the scaler skips the same steps."""
    out = _mixed_precision_errors(torch.float16, scale, factor)
    (stock_error, stock_finite), (lean_error, lean_finite) = out["stock"], out["lean"]
    assert lean_finite == stock_finite, out
    if stock_finite:
        assert lean_error <= 1.5 * stock_error + 1e-3, out


@pytest.mark.parametrize("scale", [1 / 3, 1 / 7], ids=["1/3", "1/7"])
def test_bf16_schedule_scale_is_applied_in_fp32(scale: float) -> None:
    """bf16 with the schedule's 1/3 or 1/7: lean's gradients carry the exact scale (stock's fitted
    factor against the fp32 twin, within 1e-3) and stock's error."""
    out = _mixed_precision_errors(torch.bfloat16, scale, 0.3)
    assert abs(out["lean_scale"] - 1) <= max(abs(out["stock_scale"] - 1), 1e-3) + 5e-4, out
    assert out["lean"][0] <= 1.5 * out["stock"][0] + 1e-3, out


# --------------------------------------------------------------------------- log-prob output under mcore's wrappers


@pytest.mark.parametrize("wrapper", ["Float16Module", "DDP(Float16Module)"])
def test_logprobs_output_survives_mcores_wrappers(wrapper: str) -> None:
    """``Float16Module`` upcasts the last stage's outputs with ``float16_to_fp32``, which rebuilds
    every tuple (a NamedTuple too) as a plain one; ``TokenLogProbs`` must come through it, and
    through mcore's DDP around it, as it is."""
    spec = TinyGPT(vocab_size=VOCAB, params_dtype=torch.bfloat16)
    lean, reference = (Float16Module(model.config, model) for model in (spec.build(seed=7), spec.build(seed=7)))
    if wrapper == "DDP(Float16Module)":
        lean = DistributedDataParallel(lean.config, DistributedDataParallelConfig(overlap_grad_reduce=False), lean)
    hooks = mtp_hooks.attach(lean, output="logprobs", entropy=True)
    reference_hooks = mtp_hooks.attach(reference)
    batch = make_batch(VOCAB, seed=38)
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        out = lean(*batch.model_args)
    assert isinstance(out, mtp_hooks.TokenLogProbs), type(out)
    logprobs, entropy = out  # unpacks as (logprobs, entropy)
    assert logprobs is out.logprobs and entropy is out.entropy and out.logprobs.dtype == torch.float32
    assert len(out) == 2 and out[0] is out.logprobs and out[1] is out.entropy  # indexes as one too
    (out.logprobs * batch.loss_mask).sum().backward()
    with reference_hooks.micro_batch(batch.labels, batch.loss_mask):
        logits = reference(*batch.model_args)
    log_p = logits.float().log_softmax(-1)
    torch.testing.assert_close(out.logprobs.detach(), log_p.gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.entropy.detach(), -(log_p.exp() * log_p).sum(-1), atol=1e-5, rtol=1e-5)
    assert set(hooks.metrics()) >= {"mtp_1/loss", "mtp_2/loss"}


# --------------------------------------------------------------------------- hooks on the output layer


def soft_cap(module: nn.Module, args: Any, output: Any) -> Any:
    logits, bias = output
    return torch.tanh(logits / 0.5) * 0.5, bias


@contextlib.contextmanager
def global_soft_cap(layers: list[nn.Module]) -> Iterator[None]:
    """A global forward hook (``register_module_forward_hook``) soft-capping the given layers' outputs."""
    ids = {id(layer) for layer in layers}

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        return soft_cap(module, args, output) if id(module) in ids else None

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@pytest.mark.parametrize("where", ["module", "global"])
@pytest.mark.parametrize("path", PATHS)
def test_output_layer_hooks_apply_to_the_mtp_heads_as_in_stock(path: str, where: str) -> None:
    spec = TinyGPT(vocab_size=VOCAB)
    stock, hooked = spec.build(seed=5), spec.build(seed=5)
    batch = make_batch(VOCAB, seed=31)
    hooks = mtp_hooks.attach(hooked, loss_impl=path)
    handles = []
    if where == "module":
        handles = [m.output_layer.register_forward_hook(soft_cap) for m in (stock, hooked)]
    context = global_soft_cap([stock.output_layer, hooked.output_layer]) if where == "global" else contextlib.nullcontext()
    with context:
        step(lambda: stock_loss(stock, batch), 1.0)
        expected_losses = stock_mtp_losses()
        step(lambda: hooked_loss(hooked, hooks, batch), 1.0)
    for handle in handles:
        handle.remove()
    metrics = hooks.metrics()
    for k, loss in enumerate(expected_losses, start=1):
        assert metrics[f"mtp_{k}/loss"] == pytest.approx(loss, rel=1e-5)
    assert hooks.loss_path == "dense"  # hooks on the output layer take the path that calls it
    for (name, p), ref in zip(hooked.named_parameters(), stock.parameters()):
        torch.testing.assert_close(p.grad, ref.grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_without_foreign_hooks_the_lean_path_stays() -> None:
    """Only hooks that may change the call switch the path: mtp_hooks' own and torch's module
    trackers (``FlopCounterMode``) do not."""
    model = TinyGPT(vocab_size=VOCAB).build(seed=5)
    hooks = mtp_hooks.attach(model)
    with torch.utils.flop_counter.FlopCounterMode(display=False):
        step(lambda: hooked_loss(model, hooks, make_batch(VOCAB, seed=32)), 1.0)
    assert hooks.loss_path in ("fused", "recompute")


def test_logprobs_output_with_hooks_on_the_output_layer_is_refused() -> None:
    """``output="logprobs"`` scores the labels without calling the output layer; its hooks would
    not apply, so the forward says so."""
    model = TinyGPT(vocab_size=VOCAB).build(seed=5)
    hooks = mtp_hooks.attach(model, output="logprobs")
    model.output_layer.register_forward_hook(soft_cap)
    batch = make_batch(VOCAB, seed=33)
    with pytest.raises(mtp_hooks.MTPHooksError, match="output='logprobs'.*hooks"):
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            model(*batch.model_args)


# --------------------------------------------------------------------------- output layers with their own forward


class SoftCappedHead(ColumnParallelLinear):
    """An output layer that soft-caps its logits in its own ``forward`` (no hooks)."""

    def forward(self, input_: Tensor, weight: Optional[Tensor] = None, runtime_gather_output: Optional[bool] = None) -> Any:
        logits, bias = super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        return torch.tanh(logits / 0.5) * 0.5, bias


class ScaledImplHead(ColumnParallelLinear):
    """An output layer whose own ``_forward_impl`` scales mcore's matmul."""

    def _forward_impl(self, input: Tensor, weight: Tensor, *args: Any, **kwargs: Any) -> Tensor:  # noqa: A002
        return super()._forward_impl(input, weight, *args, **kwargs) * 1.7


class TaggedHead(ColumnParallelLinear):
    """A subclass that only adds an attribute: its call is mcore's own."""

    tag = "lm_head"


def with_output_layer(model: nn.Module, head: type) -> nn.Module:
    """``model`` with its output layer rebuilt as a ``head`` (same arguments, same weights)."""
    old = model.output_layer
    new = head(
        old.input_size,
        old.output_size,
        config=model.config,
        init_method=model.config.init_method,
        bias=False,
        gather_output=old.gather_output,
        skip_weight_param_allocation=old.weight is None,
    )
    new.load_state_dict(old.state_dict())
    model.output_layer = new
    return model


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("head", [SoftCappedHead, ScaledImplHead], ids=["own forward", "own _forward_impl"])
@pytest.mark.parametrize("path", PATHS)
def test_an_output_layer_with_its_own_forward_applies_to_the_mtp_heads_as_in_stock(path: str, head: type, tied: bool) -> None:
    spec = TinyGPT(vocab_size=VOCAB, tied=tied)
    stock, hooked = (with_output_layer(spec.build(seed=5), head) for _ in range(2))
    batch = make_batch(VOCAB, seed=34)
    hooks = mtp_hooks.attach(hooked, loss_impl=path)
    step(lambda: stock_loss(stock, batch), 1.0)
    expected_losses = stock_mtp_losses()
    step(lambda: hooked_loss(hooked, hooks, batch), 1.0)
    metrics = hooks.metrics()
    assert len(expected_losses) == 2
    for k, loss in enumerate(expected_losses, start=1):
        assert metrics[f"mtp_{k}/loss"] == pytest.approx(loss, rel=1e-5)
    assert hooks.loss_path == "dense"  # only a call of the layer runs its own forward
    for (name, p), ref in zip(hooked.named_parameters(), stock.parameters()):
        torch.testing.assert_close(p.grad, ref.grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_a_subclass_that_keeps_mcores_forward_stays_lean() -> None:
    spec = TinyGPT(vocab_size=VOCAB)
    stock, hooked = (with_output_layer(spec.build(seed=5), TaggedHead) for _ in range(2))
    batch = make_batch(VOCAB, seed=35)
    hooks = mtp_hooks.attach(hooked)
    step(lambda: stock_loss(stock, batch), 1.0)
    expected_losses = stock_mtp_losses()
    step(lambda: hooked_loss(hooked, hooks, batch), 1.0)
    assert hooks.loss_path in ("fused", "recompute")
    metrics = hooks.metrics()
    for k, loss in enumerate(expected_losses, start=1):
        assert metrics[f"mtp_{k}/loss"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.parametrize("head", [SoftCappedHead, ScaledImplHead], ids=["own forward", "own _forward_impl"])
def test_logprobs_output_with_an_output_layer_of_its_own_forward_is_refused(head: type) -> None:
    model = with_output_layer(TinyGPT(vocab_size=VOCAB).build(seed=5), head)
    hooks = mtp_hooks.attach(model, output="logprobs")
    batch = make_batch(VOCAB, seed=36)
    with pytest.raises(mtp_hooks.MTPHooksError, match=f"output='logprobs'.*forward.*\n.*\n.*{head.__name__}.*output='logits'"):
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            model(*batch.model_args)


@pytest.mark.parametrize("options", [{"objective": "tv"}, {"agreement_metrics": True}], ids=["tv", "agreement_metrics"])
def test_draft_objectives_with_an_output_layer_of_its_own_forward_are_refused(options: dict[str, Any]) -> None:
    """They run lean only; the dense path that would call the layer keeps stock's CE."""
    model = with_output_layer(TinyGPT(vocab_size=VOCAB).build(seed=5), SoftCappedHead)
    hooks = mtp_hooks.attach(model, **options)
    batch = make_batch(VOCAB, seed=37)
    with pytest.raises(mtp_hooks.MTPHooksError, match="objective.*\n.*\n.*SoftCappedHead.*objective='ce'"):
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            model(*batch.model_args)


# --------------------------------------------------------------------------- no host data on the hot path


@pytest.mark.parametrize("per_token", [False, True], ids=["token mean", "calculate_per_token_loss"])
@pytest.mark.parametrize("path", PATHS)
def test_loss_mask_none_micro_batch_builds_no_tensor_from_host_data(path: str, per_token: bool) -> None:
    """Stock-equal gradients, and not one tensor made from a host value or read back to the host."""
    spec = TinyGPT(vocab_size=VOCAB, config_overrides={"calculate_per_token_loss": per_token})
    stock, hooked = spec.build(seed=6), spec.build(seed=6)
    batch = make_batch(VOCAB, mask="none", seed=41)
    hooks = mtp_hooks.attach(hooked, loss_impl=path)
    step(lambda: stock_loss(stock, batch), 1.0)
    with HostToDevice() as host_data, HostSyncs() as syncs:
        with hooks.micro_batch(batch.labels, None):
            logits = hooked(*batch.model_args)
        masked_mean(main_ce_from_logits(logits, batch.labels), None).backward()
    assert syncs.count == 0, dict(syncs.by_op)
    if path != "dense":  # dense runs mcore's own CE per depth, as stock (see tests.lifecycle.test_host_syncs)
        assert host_data.count == 0, dict(host_data.by_op)
    for (name, p), ref in zip(hooked.named_parameters(), stock.parameters()):
        torch.testing.assert_close(p.grad, ref.grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
