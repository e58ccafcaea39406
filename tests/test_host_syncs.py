"""No host sync in a micro-batch by default, like stock mcore: every forward is a hot path."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mtp_hooks
from tests.mcore_cpu import TinyGPT, hooked_train_step, make_batch

VOCAB = 64
SHAPE = TinyGPT(vocab_size=VOCAB)
_SYNC_OPS = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero", "aten::item"}


class HostSyncs(TorchDispatchMode):
    """Counts the ops that copy a tensor value to the host (a device sync on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None) -> Any:
        if func._schema.name in _SYNC_OPS:
            self.seen.append(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("options", [{}, {"loss_impl": "dense"}, {"detach_encoder": True, "detach_head": True}], ids=["lean", "dense", "detached"])
def test_training_micro_batch_makes_no_host_sync_by_default(options: dict[str, Any]) -> None:
    """Stock makes none either on 0.14 - 0.16 and 0.18+ (0.17.1 tests ``num_tokens > 0`` on the host)."""
    hooked = SHAPE.build()
    batch = make_batch(VOCAB, seed=1)
    hooks = mtp_hooks.attach(hooked, **options)
    with HostSyncs() as syncs:
        hooked_train_step(hooked, hooks, batch)
    assert syncs.seen == []
    assert hooks.metrics()["mtp_1/tokens"] > 0  # it did train


def test_inference_micro_batch_makes_no_host_sync() -> None:
    model = SHAPE.build()
    mtp_hooks.attach(model)
    batch = make_batch(VOCAB, seed=2)
    with HostSyncs() as syncs, torch.no_grad():
        model(*batch.model_args)
    assert syncs.seen == []


def test_host_validation_is_the_one_that_syncs() -> None:
    """The counter sees syncs when there are some: ``validate="host"`` makes two (mask, labels)."""
    model = SHAPE.build()
    hooks = mtp_hooks.attach(model, validate="host")
    batch = make_batch(VOCAB, seed=3)
    with HostSyncs() as syncs:
        hooked_train_step(model, hooks, batch)
    assert len(syncs.seen) == 2, syncs.seen


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.set_sync_debug_mode)")
def test_training_micro_batch_on_cuda_passes_sync_debug_mode_error() -> None:  # pragma: no cover - GPU only
    model = SHAPE.build().cuda()
    hooks = mtp_hooks.attach(model)
    batch = make_batch(VOCAB, seed=4)
    cuda = lambda t: None if t is None else t.cuda()  # noqa: E731
    labels, mask = cuda(batch.labels), cuda(batch.loss_mask)
    ids, positions = cuda(batch.input_ids), cuda(batch.position_ids)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with hooks.micro_batch(labels, mask):
            logits = model(ids, positions, None)
        logits.float().logsumexp(-1).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert hooks.metrics()["mtp_1/tokens"] > 0
