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


# Tensors made from host data: ``torch.tensor`` / ``as_tensor`` / ``new_tensor`` of Python values
# lift a fresh host tensor (on a GPU it is then copied to the device, a blocking copy); and copies
# whose source is on the host while the destination is not.
_HOST_DATA_OPS = {"aten::lift_fresh", "aten::lift_fresh_copy"}
_COPY_OPS = {"aten::_to_copy", "aten::copy_", "aten::to"}


class HostData(TorchDispatchMode):
    """Counts the tensors built from host data (a host-to-device copy on a GPU).

    CPU runs see the lifts of Python data (``torch.tensor(x)``, ``t.new_tensor(x)``,
    ``torch.as_tensor(x)``); on a device also every host-to-device copy. Scalars passed to ops
    (``t * 0.5``, ``torch.full``, ``clamp(min=1)``) travel as kernel arguments and are not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name in _HOST_DATA_OPS:
            self.seen.append(name)
        elif name in _COPY_OPS and args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor):
            source = args[1] if name == "aten::copy_" and len(args) > 1 else args[0]
            if isinstance(source, torch.Tensor) and source.device.type == "cpu" and out.device.type != "cpu":
                self.seen.append(f"{name} host->{out.device.type}")
        return out


def test_host_data_counter_sees_tensors_made_from_python_values() -> None:
    labels = torch.ones(3, dtype=torch.long)
    with HostData() as counter:
        labels.new_tensor(labels.numel())
        torch.as_tensor(0.5, dtype=torch.float32)
        labels * 2, torch.full((), 3.0), labels.clamp(min=1)  # scalars as kernel arguments: not counted
    assert counter.seen == ["aten::lift_fresh", "aten::lift_fresh"]


@pytest.mark.parametrize("per_token", [False, True], ids=["token mean", "calculate_per_token_loss"])
@pytest.mark.parametrize("mask", ["none", "random"])
@pytest.mark.parametrize("options", [{}, {"loss_impl": "dense"}, {"output": "logprobs"}], ids=["lean", "dense", "logprobs"])
def test_micro_batches_build_no_tensor_from_host_data(options: dict[str, Any], mask: str, per_token: bool) -> None:
    """Training and inference micro-batches, ``loss_mask=None`` and per-token loss included. The
    dense path runs mcore's own CE per depth, which lifts one host scalar per call
    (``masked_target[target_mask] = 0``): no more than stock's micro-batch, which runs it too."""
    spec = TinyGPT(vocab_size=VOCAB, config_overrides={"calculate_per_token_loss": per_token})
    model = spec.build()
    hooks = mtp_hooks.attach(model, **options)
    batch = make_batch(VOCAB, mask=mask, seed=5)
    with HostData() as host_data, HostSyncs() as syncs:
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            out = model(*batch.model_args)
        logits = out.logprobs if options.get("output") == "logprobs" else out
        logits.float().sum().backward()
        with torch.no_grad():
            if options.get("output") == "logprobs":
                model(*batch.model_args, labels=batch.labels)
            else:
                model(*batch.model_args)
    assert syncs.seen == [], syncs.seen
    if options.get("loss_impl") != "dense":
        assert host_data.seen == [], host_data.seen
        return
    stock = spec.build()
    with HostData() as stock_host_data:
        stock(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask).sum().backward()
    assert 0 < len(host_data.seen) <= len(stock_host_data.seen), (host_data.seen, stock_host_data.seen)


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
        with HostData() as host_data:
            with hooks.micro_batch(labels, mask):
                logits = model(ids, positions, None)
            logits.float().logsumexp(-1).sum().backward()
            with hooks.micro_batch(labels, None):  # loss_mask=None
                logits = model(ids, positions, None)
            logits.float().logsumexp(-1).sum().backward()
            with torch.no_grad():
                model(ids, positions, None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert host_data.seen == [], host_data.seen
    assert hooks.metrics()["mtp_1/tokens"] > 0
