"""``output="logprobs"``: main-head log-probs of the labels (and entropy) without ``[b, s, V]`` logits.

Function level: ``lean_logprobs`` against a float64 reference from full logits with plain torch
ops (log-probs, entropy, gradients wrt hidden and weight through both, temperature 1 and not),
chunk by chunk size, and ``gradcheck`` in float64.

Model level: one hooked twin returns ``TokenLogProbs``, another hooked twin returns logits from
which the test takes ``log_softmax`` / gather / entropy. For a training micro-batch (MTP trains
in the same forward) values, MTP metrics and every parameter's gradient are equal; for an
inference micro-batch (``no_grad``, labels given) values are equal and the MTP block does not
run. No op of the logprobs forward or backward produces a ``[b, s, V]``-sized tensor, and a
forward without labels is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import pytest
import torch
from torch import Tensor

import mtp_hooks
from megatron.core.transformer.transformer_config import TransformerConfig
from mtp_hooks.ops.logprobs import lean_logprobs
from mtp_hooks.testing import Batch, TinyGPT, assert_same_grads, make_batch
from tests.support.head_cases import HIDDEN, TOKENS, VOCAB, Leaves
from tests.support.micro_batches import mtp_block_calls
from tests.support.probes import LargestOutput

CHUNK_SIZES = [1, 3, TOKENS, TOKENS + 5]  # one token, not dividing T, exactly T, more than T


# ============================================================================ function level


@dataclasses.dataclass
class Case(Leaves):
    hidden: Tensor
    weight: Tensor
    labels: Tensor
    grad_logprobs: Tensor  # upstream gradients of a user loss (some zero: masked tokens)
    grad_entropy: Tensor


def make_case(seed: int, tokens: int = TOKENS, hidden: int = HIDDEN, vocab: int = VOCAB) -> Case:
    gen = torch.Generator().manual_seed(seed)
    grad_logprobs = torch.randn(tokens, generator=gen, dtype=torch.float64)
    grad_logprobs[::4] = 0.0
    return Case(
        hidden=torch.randn(tokens, hidden, generator=gen, dtype=torch.float64),
        weight=torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.7,
        labels=torch.randint(0, vocab, (tokens,), generator=gen),
        grad_logprobs=grad_logprobs,
        grad_entropy=torch.randn(tokens, generator=gen, dtype=torch.float64),
    )


def reference(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """Full float64 logits / temperature: log_softmax gathered at the labels, and the entropy."""
    log_p = ((hidden.double() @ weight.double().t()) / temperature).log_softmax(-1)
    return log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def user_loss(logprobs: Tensor, entropy: Optional[Tensor], case: Case) -> Tensor:
    """A policy-gradient-like scalar: ``sum(a * logprobs) + sum(b * entropy)``."""
    loss = (case.grad_logprobs.to(logprobs.dtype) * logprobs).sum()
    if entropy is not None:
        loss = loss + (case.grad_entropy.to(entropy.dtype) * entropy).sum()
    return loss


TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float64: dict(atol=1e-12, rtol=1e-10)}


def assert_close(actual: Tensor, expected: Tensor, what: str, atol: float, rtol: float) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("with_entropy", [True, False], ids=["entropy", "no_entropy"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_lean_logprobs_match_float64_reference(chunk_size: int, temperature: float, with_entropy: bool, dtype: torch.dtype) -> None:
    case = make_case(seed=chunk_size)
    tol = TOLERANCES[dtype]
    hidden, weight = case.leaves(dtype)
    out = lean_logprobs(hidden, weight, case.labels, None, chunk_size, temperature, with_entropy)
    assert out.logprobs.shape == (TOKENS,) and out.logprobs.dtype == torch.promote_types(dtype, torch.float32)
    assert (out.entropy is not None) == with_entropy
    user_loss(out.logprobs, out.entropy, case).backward()
    ref_hidden, ref_weight = case.leaves(torch.float64)
    ref_logprobs, ref_entropy = reference(ref_hidden, ref_weight, case.labels, temperature)
    user_loss(ref_logprobs, ref_entropy if with_entropy else None, case).backward()
    assert_close(out.logprobs.detach(), ref_logprobs.detach(), "log-probs", **tol)
    if out.entropy is not None:
        assert_close(out.entropy.detach(), ref_entropy.detach(), "entropy", **tol)
    assert_close(hidden.grad, ref_hidden.grad, "hidden grad", **tol)
    assert_close(weight.grad, ref_weight.grad, "weight grad", **tol)
    assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_alone_gives_the_entropy_gradient(temperature: float) -> None:
    """A loss on the entropy only: the log-probs' upstream gradient is zero."""
    case = make_case(seed=21)
    hidden, weight = case.leaves(torch.float64)
    out = lean_logprobs(hidden, weight, case.labels, None, 4, temperature, True)
    assert out.entropy is not None
    (case.grad_entropy * out.entropy).sum().backward()
    ref_hidden, ref_weight = case.leaves(torch.float64)
    _, ref_entropy = reference(ref_hidden, ref_weight, case.labels, temperature)
    (case.grad_entropy * ref_entropy).sum().backward()
    assert_close(hidden.grad, ref_hidden.grad, "hidden grad", atol=1e-12, rtol=1e-10)
    assert_close(weight.grad, ref_weight.grad, "weight grad", atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("needs", ["hidden only", "weight only"])
def test_only_the_inputs_that_need_grad_get_one(needs: str) -> None:
    case = make_case(seed=22)
    hidden, weight = case.leaves(torch.float64, hidden_grad=needs == "hidden only", weight_grad=needs == "weight only")
    out = lean_logprobs(hidden, weight, case.labels, None, 3, 0.9, True)
    user_loss(out.logprobs, out.entropy, case).backward()
    ref_hidden, ref_weight = case.leaves(torch.float64)
    user_loss(*reference(ref_hidden, ref_weight, case.labels, 0.9), case).backward()
    if needs == "hidden only":
        assert weight.grad is None
        assert_close(hidden.grad, ref_hidden.grad, "hidden grad", atol=1e-12, rtol=1e-10)
    else:
        assert hidden.grad is None
        assert_close(weight.grad, ref_weight.grad, "weight grad", atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("with_entropy", [True, False], ids=["entropy", "no_entropy"])
@pytest.mark.parametrize("temperature", [1.0, 1.3])
@pytest.mark.parametrize("chunk_size", [1, 3, 16])
def test_gradcheck_in_float64(chunk_size: int, temperature: float, with_entropy: bool) -> None:
    case = make_case(seed=23, tokens=6, hidden=3, vocab=7)
    hidden, weight = case.leaves(torch.float64)

    def outputs(h: Tensor, w: Tensor) -> tuple[Tensor, ...]:
        out = lean_logprobs(h, w, case.labels, None, chunk_size, temperature, with_entropy)
        return (out.logprobs,) if out.entropy is None else (out.logprobs, out.entropy)

    assert torch.autograd.gradcheck(outputs, (hidden, weight), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_double_backward_is_refused_or_correct() -> None:
    """``create_graph=True`` through the log-probs must either raise or give true second derivatives
    (a gradient penalty or Hessian-vector product must not silently get wrong numbers)."""
    case = make_case(seed=24, tokens=5, hidden=3, vocab=7)
    hidden, weight = case.leaves(torch.float64)

    def outputs(h: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        out = lean_logprobs(h, w, case.labels, None, 2, 1.3, True)
        assert out.entropy is not None
        return out.logprobs, out.entropy

    try:
        first = torch.autograd.grad(user_loss(*outputs(hidden, weight), case), hidden, create_graph=True)[0]
        if not first.requires_grad:
            return  # no graph for a second derivative: nothing wrong can come of it
        first.sum().backward()
    except RuntimeError:
        return  # refused
    assert torch.autograd.gradgradcheck(outputs, (hidden, weight), eps=1e-6, atol=1e-8, rtol=1e-6, raise_exception=False), (
        "second derivatives through lean_logprobs are wrong (backward is not once_differentiable)"
    )


@pytest.mark.parametrize("with_entropy", [True, False], ids=["entropy", "no_entropy"])
def test_token_logprobs_index_and_unpack_like_the_pair_users_expect(with_entropy: bool) -> None:
    """``out[0]`` is the log-probs, ``out[1]`` the entropy (``None`` unless asked), two entries, as the
    ``(logprobs, entropy)`` tuple RL code indexes; still not a tuple (see the Float16Module test)."""
    case = make_case(seed=25)
    hidden, weight = case.leaves(torch.float32)
    out = lean_logprobs(hidden, weight, case.labels, None, 4, 1.0, with_entropy)
    assert not isinstance(out, tuple)
    assert len(out) == 2
    assert out[0] is out.logprobs and out[-2] is out.logprobs
    assert out[1] is out.entropy and out[-1] is out.entropy and (out[1] is None) == (not with_entropy)
    head, tail = out[:1], out[1:]
    assert len(head) == len(tail) == 1 and head[0] is out.logprobs and tail[0] is out.entropy
    logprobs, entropy = out
    assert logprobs is out.logprobs and entropy is out.entropy
    with pytest.raises(IndexError):
        out[2]


# ============================================================================ model level

MODEL_VOCAB = 97
SHAPE = TinyGPT(vocab_size=MODEL_VOCAB)


def token_logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """What a user does with logits ``[b, s, V]``: log_softmax, gather at the labels, entropy."""
    log_p = (logits.float() / temperature).log_softmax(-1)
    return log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def rl_loss(logprobs: Tensor, entropy: Optional[Tensor], batch: Batch, advantages: Tensor) -> Tensor:
    """A masked policy-gradient loss with an entropy bonus."""
    mask = batch.loss_mask
    loss = -(advantages * logprobs * mask).sum() / mask.sum()
    if entropy is not None:
        loss = loss - 0.05 * (entropy * mask).sum() / mask.sum()
    return loss


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(dict(entropy=True), id="entropy"),
        pytest.param(dict(entropy=False, temperature=0.7), id="temperature"),
        pytest.param(dict(entropy=True, temperature=1.4, chunk_size=3), id="entropy-temperature-chunked"),
        pytest.param(dict(entropy=True, objective="tv"), id="entropy-tv"),
        pytest.param(dict(entropy=True, loss_impl="dense"), id="entropy-dense-mtp"),
    ],
)
def test_training_logprobs_equal_the_logits_path_in_values_metrics_and_every_gradient(options: dict[str, Any]) -> None:
    entropy, temperature = options.get("entropy", False), options.get("temperature", 1.0)
    shared = {k: v for k, v in options.items() if k in ("chunk_size", "objective", "loss_impl")}
    batch = make_batch(MODEL_VOCAB, batch=2, seq=8, seed=31)
    advantages = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    lean, logits_model = SHAPE.build(), SHAPE.build()
    lean_hooks = mtp_hooks.attach(lean, output="logprobs", **options)
    logits_hooks = mtp_hooks.attach(logits_model, **shared)

    with mtp_block_calls(lean) as calls, lean_hooks.micro_batch(batch.labels, batch.loss_mask):
        out = lean(*batch.model_args)
    assert isinstance(out, mtp_hooks.TokenLogProbs) and calls == [1]
    assert out.logprobs.shape == (2, 8) and out.logprobs.dtype == torch.float32
    assert (out.entropy is not None) == entropy
    rl_loss(out.logprobs, out.entropy, batch, advantages).backward()

    with logits_hooks.micro_batch(batch.labels, batch.loss_mask):
        logits = logits_model(*batch.model_args)
    ref_logprobs, ref_entropy = token_logprobs_from_logits(logits, batch.labels, temperature)
    rl_loss(ref_logprobs, ref_entropy if entropy else None, batch, advantages).backward()

    torch.testing.assert_close(out.logprobs.detach(), ref_logprobs.detach(), atol=1e-5, rtol=1e-5)
    if out.entropy is not None:
        torch.testing.assert_close(out.entropy.detach(), ref_entropy.detach(), atol=1e-5, rtol=1e-5)
    lean_metrics, logits_metrics = lean_hooks.metrics(), logits_hooks.metrics()
    assert lean_metrics.keys() == logits_metrics.keys() and "mtp_2/loss" in lean_metrics
    for key, value in logits_metrics.items():
        assert lean_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert_same_grads(lean, logits_model)
    for name, p in lean.named_parameters():
        if name.startswith("mtp.") or name == "output_layer.weight":
            assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}: no gradient"


@pytest.mark.parametrize("call", ["micro_batch", "kwargs"])
def test_inference_logprobs_equal_the_logits_path_and_skip_the_mtp_block(call: str) -> None:
    batch = make_batch(MODEL_VOCAB, batch=2, seq=8, seed=32)
    lean, logits_model = SHAPE.build(), SHAPE.build()
    lean_hooks = mtp_hooks.attach(lean, output="logprobs", entropy=True, temperature=0.8)
    mtp_hooks.attach(logits_model)
    with torch.no_grad(), mtp_block_calls(lean) as calls:
        if call == "micro_batch":
            with lean_hooks.micro_batch(batch.labels, batch.loss_mask):
                out = lean(*batch.model_args)
        else:
            out = lean(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
        logits = logits_model(*batch.model_args)
    assert calls == [], "the MTP block ran in an inference micro-batch"
    assert isinstance(out, mtp_hooks.TokenLogProbs) and out.entropy is not None
    ref_logprobs, ref_entropy = token_logprobs_from_logits(logits, batch.labels, 0.8)
    torch.testing.assert_close(out.logprobs, ref_logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    assert lean_hooks.metrics() == {}
    assert all(p.grad is None for p in lean.parameters())


def test_logprobs_without_labels_are_refused_and_the_model_stays_usable() -> None:
    batch = make_batch(MODEL_VOCAB, batch=2, seq=8, seed=33)
    model = SHAPE.build()
    hooks = mtp_hooks.attach(model, output="logprobs")
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(mtp_hooks.MTPHooksError, match="^labels: "):
            model(*batch.model_args)
        assert type(model.config) is TransformerConfig and model.mtp_process
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        out = model(*batch.model_args)
    assert isinstance(out, mtp_hooks.TokenLogProbs)
    out.logprobs.sum().backward()
    assert set(hooks.metrics()) >= {"mtp_1/loss", "mtp_2/loss"}


def test_remove_after_logprobs_output_restores_stock() -> None:
    """After ``remove()`` the model is stock again: labels in, stock's per-token loss out, same gradients."""
    batch = make_batch(MODEL_VOCAB, batch=2, seq=8, seed=34)
    model, never_hooked = SHAPE.build(), SHAPE.build()
    hooks = mtp_hooks.attach(model, output="logprobs", entropy=True)
    with torch.no_grad():
        model(*batch.model_args, labels=batch.labels)
    hooks.remove()
    losses = [m(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask) for m in (model, never_hooked)]
    assert torch.equal(losses[0], losses[1]) and losses[0].shape == (2, 8)
    for loss in losses:
        (loss * batch.loss_mask).sum().backward()
    assert_same_grads(model, never_hooked, atol=0, rtol=0)


def test_logprobs_training_micro_batch_never_materialises_batch_by_vocabulary_logits() -> None:
    """b * s * V = 16384 is the largest tensor size of the logits path; every other tensor of this
    model (weights, activations, attention scores, chunked logits) is at most half of it."""
    shape = TinyGPT(vocab_size=256, hidden_size=32, max_sequence_length=32)
    batch = make_batch(256, batch=2, seq=32, seed=35)
    logits_size = 2 * 32 * 256
    largest = {}
    for output in ("logprobs", "logits"):
        model = shape.build()
        hooks = mtp_hooks.attach(model, output=output, chunk_size=8)
        probe = LargestOutput()
        with probe, hooks.micro_batch(batch.labels, batch.loss_mask):
            out = model(*batch.model_args)
            logprobs = out.logprobs if output == "logprobs" else token_logprobs_from_logits(out, batch.labels, 1.0)[0]
            (logprobs * batch.loss_mask).sum().backward()
        largest[output] = probe.largest
    assert largest["logits"] >= logits_size  # the guard: the logits path does materialise them
    assert largest["logprobs"] <= logits_size // 2, largest
