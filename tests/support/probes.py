"""Probes on what torch computes, for tests that pin what a loss path never materialises."""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode


class LargestOutput(TorchDispatchMode):
    """Records the largest tensor any op produces while active (forward and backward alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def counted_flops(run: Callable[[], Tensor]) -> tuple[int, Tensor]:
    """``run()``'s output and the FLOPs torch's ``FlopCounterMode`` counted in it."""
    with FlopCounterMode(display=False) as counter:
        out = run()
    return counter.get_total_flops(), out


def assert_training_forward_counts_more_flops(hooks: Any, model: Any, batch: Any, inference_flops: int) -> None:
    """A training forward of ``model`` (its ``micro_batch`` block) counts more than ``inference_flops``:
    the counter sees the MTP work, so an inference count equal to a model without MTP layers means something."""
    with hooks.micro_batch(batch.labels, batch.loss_mask):
        training_flops, _ = counted_flops(lambda: model(*batch.model_args))
    assert training_flops > inference_flops, "the counter saw no MTP work in a training forward"
    hooks.metrics()


def hooked_with_reference(shape: Any, without_mtp: Callable[[Any, Any], Any], vocab: int, seq: int, seed: int) -> tuple[Any, Any, Any, Any]:
    """``(model, hooks, reference, batch)``: ``shape`` built with ``seed`` and hooked, ``without_mtp(model,
    shape)`` (the same weights without MTP layers) and a batch, for the inference-FLOPs pins."""
    import mtp_hooks
    from mtp_hooks.testing import make_batch

    model = shape.build(seed=seed)
    hooks = mtp_hooks.attach(model)
    reference = without_mtp(model, shape)
    return model, hooks, reference, make_batch(vocab, batch=2, seq=seq, seed=seed)
