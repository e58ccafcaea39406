"""mcore's pipeline schedule around the tests' steps: the runner, mcore's loss tuple, stock's last-stage record.

Test-only support for the suites that drive model chunks through ``get_forward_backward_func()``
(``tests/distributed/test_parallel.py``, ``test_deepseek_style_parallel.py`` and
``tests.support.pipeline_parity``). A step is ``step(chunk, batch) -> (output, loss_func or None)``;
``run_schedule`` feeds it one ``Batch`` per micro-batch, ``masked_sum_loss`` is the loss function in
mcore's 3-tuple form, and ``stock_last_stage`` records what stock's last stage computed with labels in:
its main logits (the output layer's last call) and the per-depth MTP losses it added to mcore's tracker.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch import Tensor, nn

from mtp_hooks.testing import Batch, output_layer_calls, tracked_mtp_losses

Step = Callable[[nn.Module, Batch], Any]


def masked_sum_loss(loss_mask: Tensor, per_token: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """mcore's 3-tuple loss: the masked sum, the token count it divides by, and the logged loss."""
    loss = (per_token * loss_mask).sum()
    return loss, loss_mask.sum().to(torch.int), {"lm loss": loss.detach()}


def run_schedule(
    model: Union[nn.Module, list[nn.Module]],
    batches: list[Batch],
    step: Step,
    forward_only: bool = False,
    seq_length: Optional[int] = None,
) -> None:
    """mcore's schedule over ``batches`` (one micro-batch each) with ``step(chunk, batch)``.

    ``model`` is one module or this rank's virtual-stage chunks (one data iterator each);
    ``seq_length`` defaults to the batches' (pass the whole sequence under context parallelism).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    chunks = model if isinstance(model, list) else [model]

    def forward_step(data_iterator: Iterator[Batch], chunk: nn.Module) -> tuple[Tensor, Any]:
        return step(chunk, next(data_iterator))

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches),
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(batches),
        seq_length=seq_length or batches[0].input_ids.shape[1],
        micro_batch_size=batches[0].input_ids.shape[0],
        forward_only=forward_only,
    )


@contextlib.contextmanager
def stock_last_stage(model: nn.Module, depth: int, logits: list[Tensor], mtp: list[list[float]]) -> Iterator[None]:
    """Around stock's forward on the last stage (labels in): on exit, append its main logits ``[b, s, V]``
    to ``logits`` and the ``depth`` MTP losses it added to mcore's tracker to ``mtp``."""
    tracked = tracked_mtp_losses()
    before = torch.zeros(depth) if tracked is None else tracked.clone()
    with output_layer_calls(model) as calls:
        yield
    logits.append(calls[-1].transpose(0, 1))
    mtp.append((tracked_mtp_losses() - before).tolist())
