"""``defer_embedding_wgrad_compute`` on the MTP stage: the main head's weight gradient in its own backward.

With the flag mcore's output layer buffers each call's input (forward) and output gradient
(backward) in the GPTModel's lists, and the pipeline schedule drains them after the last backward
(``drain_embedding_wgrad_compute``) into ``output_layer.weight`` when tied, else into
``shared_embedding_or_output_weight()`` (0.16.1 - 0.19.2). On the stage that holds the MTP layers
both are the wrong weight: untied, the latter is the MTP layers' word-embedding copy; tied, the head
is called with that copy and ``output_layer.weight`` is unused. So the main head's training call
runs with the flag hidden (``undeferred``: a ``proxies.config_view``, installed for that call only):
its weight gradient goes to the weight it used, in backward, as an undeferred call's does.

The drain still runs and pops a pair per buffered call (it fails on empty lists), so each such call
leaves an empty pair where mcore's own would be: its input (no positions) in forward, its gradient
(no positions) when the logits' gradient is made. The drain's GEMM over no positions adds nothing
(cuBLAS defines ``k = 0`` as ``C = beta C``).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from mtp_hooks.runtime.proxies import config_view


def defers(layer: nn.Module) -> bool:
    """Whether mcore's ``layer`` would buffer this call for the deferred weight gradient."""
    config = layer.__dict__.get("config")
    if not getattr(config, "defer_embedding_wgrad_compute", False):
        return False
    return getattr(layer, "embedding_activation_buffer", None) is not None and getattr(layer, "grad_output_buffer", None) is not None


def undeferred(config: Any) -> Any:
    """``config`` seen with ``defer_embedding_wgrad_compute`` off (the real config otherwise)."""
    return config_view(config, lambda: True, "defer_embedding_wgrad_compute")


def _room(buffer: list[Tensor], limit: Any) -> bool:
    """mcore's rule: a call is buffered while the list is shorter than ``wgrad_deferral_limit`` (0: always)."""
    return not limit or len(buffer) < limit


def leave_empty_pair(layer: nn.Module, config: Any, hidden: Tensor, logits: Tensor) -> None:
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
