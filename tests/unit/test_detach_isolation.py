"""``detach_encoder`` / ``detach_head``: which parameters the MTP loss may reach.

Two stock references per case, both twins of the hooked model (same seed, same batch, same
user loss = masked mean of the main-head CE):

* ``mtp_on``: stock mcore with its MTP loss at the configured weight -- the gradient every
  parameter gets when the MTP loss flows everywhere;
* ``mtp_off``: stock mcore with its MTP loss weighted 0 (``stock_main_only_step``) -- the gradient
  from the main loss alone. Weight 0 makes every MTP contribution an exact zero, so non-MTP
  gradients are those of "MTP off" while the model and its forward stay stock.

A parameter the MTP loss must not reach equals ``mtp_off`` (and, to show the check can fail,
differs from ``mtp_on``); a parameter it must reach equals ``mtp_on`` when only the MTP loss's
path to it is untouched, or differs from both when the flag cuts one of two paths (tied head).
MTP parameters always train exactly as in stock: detaching happens outside them.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch import Tensor, nn

import mtp_hooks
from mtp_hooks.testing import TinyGPT, grads_of, hooked_train_step, main_ce_from_logits, make_batch, masked_mean, stock_main_only_step

VOCAB = 64
ON, OFF, NEITHER = "mtp_on", "mtp_off", "neither"


def group_of(name: str) -> str:
    """Parameter group: mtp, decoder, word (embedding, which is also the head when tied), position, head."""
    if name.startswith("mtp."):
        return "mtp"
    if name.startswith("decoder."):
        return "decoder"
    if name == "embedding.word_embeddings.weight":
        return "word"
    if name == "embedding.position_embeddings.weight":
        return "position"
    if name == "output_layer.weight":
        return "head"
    raise AssertionError(f"unexpected parameter {name}")


# Which reference each group must match, per (detach_encoder, detach_head, tied).
# The word embedding of a tied model is both the MTP layers' input embedding (cut by
# detach_encoder) and their output head (cut by detach_head): with one flag it gets one of its
# two MTP gradients, so it matches neither reference.
EXPECTED: dict[tuple[bool, bool, bool], dict[str, str]] = {
    (False, False, False): {"decoder": ON, "word": ON, "position": ON, "head": ON},
    (True, False, False): {"decoder": OFF, "word": OFF, "position": OFF, "head": ON},
    (False, True, False): {"decoder": ON, "word": ON, "position": ON, "head": OFF},
    (True, True, False): {"decoder": OFF, "word": OFF, "position": OFF, "head": OFF},
    (False, False, True): {"decoder": ON, "word": ON, "position": ON},
    (True, False, True): {"decoder": OFF, "word": NEITHER, "position": OFF},
    (False, True, True): {"decoder": ON, "word": NEITHER, "position": ON},
    (True, True, True): {"decoder": OFF, "word": OFF, "position": OFF},
}


def close(a: Optional[Tensor], b: Optional[Tensor]) -> bool:
    if a is None or b is None:
        return (a is None or not a.any()) and (b is None or not b.any())
    return torch.allclose(a, b, atol=1e-6, rtol=1e-5)


def hooked_grads(model: nn.Module, **options: bool) -> dict[str, Optional[Tensor]]:
    batch = make_batch(VOCAB, seq=12, seed=21)
    with mtp_hooks.attached(model, **options) as hooks:
        hooked_train_step(model, hooks, batch)
        assert hooks.metrics()["mtp_1/tokens"] > 0
    return grads_of(model)


def stock_grads(model: nn.Module, mtp: bool) -> dict[str, Optional[Tensor]]:
    batch = make_batch(VOCAB, seq=12, seed=21)
    if mtp:
        per_token = model(*batch.model_args, labels=batch.labels)  # all-ones MTP mask, as the hooked run
        masked_mean(per_token, batch.loss_mask).backward()
    else:
        stock_main_only_step(model, batch)
    return grads_of(model)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(
    "detach_encoder,detach_head", [(False, False), (True, False), (False, True), (True, True)], ids=["none", "encoder", "head", "both"]
)
@pytest.mark.parametrize("impl", ["lean", "dense"])
def test_detach_flags_cut_exactly_their_gradient_paths(detach_encoder: bool, detach_head: bool, tied: bool, impl: str) -> None:
    spec = TinyGPT(mtp_num_layers=2, tied=tied)
    mtp_on = stock_grads(spec.build(seed=8), mtp=True)
    mtp_off = stock_grads(spec.build(seed=8), mtp=False)
    # The hooked run must use the same MTP mask as the stock references: all ones.
    hooked = spec.build(seed=8)
    batch = make_batch(VOCAB, seq=12, seed=21)
    with mtp_hooks.attached(
        hooked, detach_encoder=detach_encoder, detach_head=detach_head, loss_impl=impl, chunk_size=5
    ) as hooks:
        logits = hooked(*batch.model_args, labels=batch.labels)
        masked_mean(main_ce_from_logits(logits, batch.labels), batch.loss_mask).backward()
        assert hooks.metrics()["mtp_1/tokens"] > 0
    ours = grads_of(hooked)

    expected = EXPECTED[(detach_encoder, detach_head, tied)]
    failures = []
    for name, grad in ours.items():
        group = group_of(name)
        if group == "mtp":
            if grad is None or not grad.any():
                failures.append(f"{name}: MTP parameter got no gradient")
            elif not close(grad, mtp_on[name]):
                failures.append(f"{name}: MTP parameter gradient differs from stock")
            continue
        want = expected[group]
        on, off = close(grad, mtp_on[name]), close(grad, mtp_off[name])
        if want == ON and not on:
            failures.append(f"{name}: expected stock's gradient with MTP")
        if want == OFF and not off:
            failures.append(f"{name}: expected the gradient without MTP")
        if want != ON and on:
            failures.append(f"{name}: still receives the full MTP gradient")
        if want != OFF and off:
            failures.append(f"{name}: receives no MTP gradient")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_both_flags_leave_every_non_mtp_gradient_as_without_mtp(tied: bool) -> None:
    """The headline guarantee, with a random loss mask and the ``micro_batch`` path."""
    spec = TinyGPT(mtp_num_layers=3, tied=tied)
    batch = make_batch(VOCAB, seq=12, seed=21)
    reference = spec.build(seed=2)
    stock_main_only_step(reference, batch)
    ours = hooked_grads(spec.build(seed=2), detach_encoder=True, detach_head=True)
    for name, ref in grads_of(reference).items():
        if name.startswith("mtp."):
            assert ours[name] is not None and ours[name].any(), name
        else:
            assert ours[name] is not None, name
            torch.testing.assert_close(ours[name], ref, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
