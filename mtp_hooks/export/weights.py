"""``mtp_hf_weights``: a model's MTP layers as (HF name, full tensor) pairs, on every rank.

The pairs are what vLLM's ``model.load_weights(weights)`` and verl's ``per_tensor_generator``
take: a generator of ``(name, tensor)``. The main model's weights are not in it; they stay with
the bridges (``bridges.py`` checks a bridge's MTP pairs against these and swaps them in verl's
stream).
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence, Union

import torch
from torch import Tensor, nn

from mtp_hooks import _mcore
from mtp_hooks.errors import bad_argument, describe
from mtp_hooks.export.convert import hf_pairs, hf_pairs_of_state_dict
from mtp_hooks.export.gather import mtp_units
from mtp_hooks.export.layouts import Layout, check_config, layout_named
from mtp_hooks.export.names import hf_target
from mtp_hooks.export.pipeline import broadcast_pairs, holder_of
from mtp_hooks.models import find_language_model

__all__ = ["mtp_hf_weights", "mtp_hf_weights_from_state_dict"]

Model = Union[nn.Module, Sequence[nn.Module]]


def _language_models(model: Model) -> list[nn.Module]:
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks or not all(isinstance(chunk, nn.Module) for chunk in chunks):
        expected = "an mcore GPTModel (or a wrapper of one), or a list of a stage's model chunks"
        raise bad_argument("model", expected, describe(model))
    return [find_language_model(chunk) for chunk in chunks]


def _check_names(language_model: nn.Module, layout: Layout) -> None:
    """Every local MTP tensor has a name in the layout, before any collective starts."""
    config = language_model.config
    for index, layer in enumerate(language_model.mtp.layers):
        for rest in layer.state_dict(keep_vars=True):
            if not rest.endswith("_extra_state"):
                hf_target(f"mtp.layers.{index}.{rest}", config, layout)


def mtp_hf_weights(
    model: Model, layout: Union[str, Layout], *, all_stages: bool = True
) -> Iterator[tuple[str, Tensor]]:
    """The MTP layers' tensors under the engine's HF names, gathered to full tensors.

    Args:
        model: the mcore ``GPTModel`` (or a DDP / Float16Module wrapper of one) with MTP layers, or
            this pipeline stage's list of model chunks (virtual pipeline stages).
        layout: ``"deepseek_v3"`` (DeepSeek-V3, GLM-4.5, GLM-4.7-Flash: ``model.layers.{L+i}.*``, L
            = ``config.num_layers``) or ``"mimo"`` (``model.mtp_layers.{i}.*``, ``input_proj``'s
            halves swapped); see ``LAYOUTS``.
        all_stages: with pipeline parallelism, ``True`` (default) broadcasts the pairs from the
            stage that holds the MTP layers to every stage, so every rank yields them (as verl's
            ``per_tensor_generator`` does for the whole model); ``False``: only the holding
            stage's ranks yield, the others yield nothing and communicate nothing.

    Returns:
        A generator of ``(hf_name, tensor)``, MTP layer by MTP layer. Every rank of the model's
        TP, EP (and, with ``all_stages``, PP) groups must consume it to the end, in step: the
        gathering is collective. Every yielding rank gets the same full tensors, in the model's
        dtype and on its device; tensors that needed no gathering alias the model's parameters
        (copy before changing them). Attached ``mtp_hooks`` change nothing here.

    Raises:
        MTPHooksError: on the call, before any tensor moves: an unknown layout, a model without
        MTP layers or one the layout's engine layer cannot hold, a tensor without a name in the layout.

    Example::

        # every rank, after the optimizer step; the engine's draft model takes the pairs as they come
        draft_model.load_weights(mtp_hf_weights(model, "deepseek_v3"))
    """
    found = layout_named(layout)
    if not isinstance(all_stages, bool):
        raise bad_argument("all_stages", "a bool", describe(all_stages))
    language_models = _language_models(model)
    config = language_models[0].config
    check_config(config, found)
    holding = _holding(language_models)
    for language_model in holding:
        _check_names(language_model, found)
    return _pairs(language_models, holding, found, config, all_stages)


def _holding(language_models: list[nn.Module]) -> list[nn.Module]:
    """The model chunks of this stage that hold MTP layers."""
    return [lm for lm in language_models if getattr(lm, "mtp_process", False) and getattr(lm, "mtp", None) is not None]


def _pairs(
    language_models: list[nn.Module], holding: list[nn.Module], layout: Layout, config: Any, all_stages: bool
) -> Iterator[tuple[str, Tensor]]:
    units = (
        [(hf_name, part) for name, tensor in unit for hf_name, part in hf_pairs(name, tensor, config, layout)]
        for lm in holding
        for unit in mtp_units(lm)
    )
    group = _mcore.pipeline_group_of(language_models[-1])
    source = holder_of(group, bool(holding)) if all_stages else None
    if source is None:
        for unit in units:
            yield from unit
        return
    device = next(iter(language_models[-1].parameters()), torch.empty(0)).device
    assert group is not None
    yield from broadcast_pairs(units if holding else None, group, source, device)


def mtp_hf_weights_from_state_dict(
    state_dict: Mapping[str, Any], config: Any, layout: Union[str, Layout]
) -> Iterator[tuple[str, Tensor]]:
    """``mtp_hf_weights`` for an unsharded mcore ``GPTModel`` state dict (e.g. a TP = PP = EP = 1
    checkpoint): its ``mtp.layers.*`` tensors under the layout's names. Expert numbers in the
    keys are taken as global; Transformer Engine and local names are both read.

    Args:
        state_dict: mcore's names to tensors (``_extra_state`` entries are skipped).
        config: the model's ``TransformerConfig``.
        layout: as for ``mtp_hf_weights``.
    """
    found = layout_named(layout)
    check_config(config, found)
    return hf_pairs_of_state_dict(state_dict, config, found)
