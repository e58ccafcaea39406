"""The main head's greedy pick, as a draft token: the argmax of its weight on an MTP layer's output.

The head's weight is the one mcore's ``GPTModel`` hands its output layer: the output layer's own, or, with
tied embeddings (``share_embeddings_and_output_weights``), ``shared_embedding_or_output_weight()``, passed
as ``weight=`` (the output layer then holds no weight of its own). Unsharded models (tensor parallelism 1).
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["head_argmax", "head_weight"]


def head_weight(model: nn.Module) -> Tensor:
    """The main head's weight ``[V, h]``, detached, as the model's forward gives it to its output layer."""
    if getattr(model, "share_embeddings_and_output_weights", False):
        return model.shared_embedding_or_output_weight().detach()
    return model.output_layer.weight.detach()


def head_argmax(model: nn.Module, hidden: Tensor) -> Tensor:
    """The main head's greedy pick (its weight, fp32) for each row of ``hidden``: a draft token."""
    return (hidden.float() @ head_weight(model).float().t()).argmax(-1)
