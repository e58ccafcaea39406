"""``defer_embedding_wgrad_compute`` on the MTP stage: the main head's weight gradient in its own backward.

With the flag mcore's output layer buffers each call's input (forward) and output gradient
(backward) in the GPTModel's lists, and the pipeline schedule drains them after the last backward
(``drain_embedding_wgrad_compute``) into ``output_layer.weight`` when tied, else into
``shared_embedding_or_output_weight()`` (0.16.1 - 0.19.2). On the stage that holds the MTP layers
both are the wrong weight: untied, the latter is the MTP layers' word-embedding copy; tied, the head
is called with that copy and ``output_layer.weight`` is unused. So the main head's training call
runs with the flag hidden (``undeferred``: a ``proxies.config_view``, installed for that call only,
``undefer_main_call``): its weight gradient goes to the weight it used, in backward, as an
undeferred call's does. The dense MTP heads' own calls of the output layer run undeferred too
(``undeferred_call``): the drain pairs buffered inputs and gradients in order, while a
micro-batch's head calls reach backward in the reverse order.

The drain still runs and pops a pair per buffered call (it fails on empty lists), so each such call
leaves an empty pair where mcore's own would be (``end_main_call``): its input (no positions) in
forward, its gradient (no positions) when the logits' gradient is made. The drain's GEMM over no
positions adds nothing (cuBLAS defines ``k = 0`` as ``C = beta C``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional

from torch import Tensor, nn

from mtp_hooks.runtime.forward import Forward
from mtp_hooks.runtime.proxies import config_view


@dataclasses.dataclass
class MainCall:
    """Per forward: the input of the main head's call run undeferred, until it returns."""

    undeferred: Optional[Tensor] = None


def defers(layer: nn.Module) -> bool:
    """Whether mcore's ``layer`` would buffer this call for the deferred weight gradient."""
    config = layer.__dict__.get("config")
    if not getattr(config, "defer_embedding_wgrad_compute", False):
        return False
    return (
        getattr(layer, "embedding_activation_buffer", None) is not None
        and getattr(layer, "grad_output_buffer", None) is not None
    )


def undeferred(config: Any) -> Any:
    """``config`` seen with ``defer_embedding_wgrad_compute`` off (the real config otherwise)."""
    return config_view(config, lambda: True, "defer_embedding_wgrad_compute")


def undefer_main_call(forward: Forward, call: MainCall, layer: nn.Module, hidden: Tensor) -> None:
    """The main head's training call of ``layer`` on ``hidden``: undeferred where mcore would buffer it."""
    if defers(layer):
        forward.swap(layer, "config", undeferred(layer.__dict__["config"]))
        call.undeferred = hidden


def end_main_call(forward: Forward, call: MainCall, layer: nn.Module, hidden: Tensor, output: Any) -> bool:
    """The output layer returned: if it was the undeferred main call, its real config back and an
    empty pair in mcore's buffers. Returns whether it was."""
    if call.undeferred is None or hidden is not call.undeferred:
        return False
    call.undeferred = None
    forward.restore_swaps()
    _leave_empty_pair(layer, layer.__dict__["config"], hidden, output[0])
    return True


@contextlib.contextmanager
def undeferred_call(layer: nn.Module) -> Iterator[None]:
    """A call of ``layer`` made inside the block sees its config with the flag off (if it is on)."""
    config = layer.__dict__.get("config")
    if not getattr(config, "defer_embedding_wgrad_compute", False):
        yield
        return
    layer.__dict__["config"] = undeferred(config)
    try:
        yield
    finally:
        layer.__dict__["config"] = config


def _room(buffer: list[Tensor], limit: Any) -> bool:
    """mcore's rule: a call is buffered while the list is shorter than ``wgrad_deferral_limit`` (0: always)."""
    return not limit or len(buffer) < limit


def _leave_empty_pair(layer: nn.Module, config: Any, hidden: Tensor, logits: Tensor) -> None:
    """Buffer an empty pair for an undeferred call of ``layer`` (``config``: its real config): the
    input now, the gradient when ``logits``' gradient is made (mcore's own layer appends it there)."""
    limit = getattr(config, "wgrad_deferral_limit", 0)
    activations, gradients = layer.embedding_activation_buffer, layer.grad_output_buffer
    if not _room(activations, limit):
        return
    activations.append(hidden.new_empty((0, *hidden.shape[1:])))
    rows = layer.output_size_per_partition  # the vocabulary shard the drain's weight has
    if logits.requires_grad:

        def append_gradient(grad: Tensor) -> None:
            if _room(gradients, limit):
                gradients.append(grad.new_empty((0, *grad.shape[1:-1], rows)))

        logits.register_hook(append_gradient)
