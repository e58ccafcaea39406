"""``hf_weights``: the whole model (main + MTP layers) as (HF name, full tensor) pairs, on every rank.

What an engine's checkpoint holds, in the layout's names: the embedding (``model.embed_tokens``),
each decoder layer (``model.layers.{n}.*``, the decoder-layer names of ``names.py``), the final norm
(``model.norm``), the head (``lm_head``), then the MTP layers as ``mtp_hf_weights`` yields them. The
pairs fill an HF folder (``folder.save_hf_folder``) or go into a running engine: the main model's
into its target (``VLLMSync.push(..., model="target")``), the MTP layers' into its draft.

Gathered as ``mtp_hf_weights`` gathers: TP shards concatenated, EP experts numbered globally and,
with pipeline parallelism, each stage's pairs broadcast to every stage in stage order (``all_stages``).

A tied model (``share_embeddings_and_output_weights``) writes no ``lm_head`` in the ``"mimo"`` layout
(Qwen2 / MiMo tie it to the embedding: ``tie_word_embeddings``); in ``"deepseek_v3"``, whose engine
models do not tie, ``lm_head.weight`` is the embedding, under its own name.
"""

from __future__ import annotations

from typing import Any, Iterator, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mtp_hooks import _mcore
from mtp_hooks.errors import bad_argument, describe
from mtp_hooks.export.convert import hf_pairs, main_hf_pairs
from mtp_hooks.export.gather import Unit, _gather_tensor_parallel, main_units, mtp_units
from mtp_hooks.export.layouts import Layout, check_config, layout_named
from mtp_hooks.export.names import main_target
from mtp_hooks.export.pipeline import broadcast_pairs
from mtp_hooks.export.weights import Model, _check_names, _holding, _language_models

__all__ = ["hf_weights"]

_HEAD = "output_layer.weight"


def hf_weights(
    model: Model, layout: Union[str, Layout], *, mtp: bool = True, all_stages: bool = True
) -> Iterator[tuple[str, Tensor]]:
    """The whole model's tensors (main model, then MTP layers) under the engine's HF names, gathered
    to full tensors: what an HF folder of the model holds and ``vllm.LLM(model=folder)`` loads.

    Args:
        model: the mcore ``GPTModel`` (or a DDP / Float16Module wrapper of one) with MTP layers, or
            this pipeline stage's list of model chunks (virtual pipeline stages).
        layout: ``"deepseek_v3"`` (DeepSeek-V3, GLM-4.5) or ``"mimo"``, as for ``mtp_hf_weights``.
        mtp: ``True`` (default): the main model, then the MTP layers (an HF folder's tensors);
            ``False``: the main model only, what an engine's target takes (``VLLMSync.push(...,
            model="target")``; the draft takes ``mtp_hf_weights``).
        all_stages: with pipeline parallelism, ``True`` (default) broadcasts every stage's pairs to
            every stage, stage after stage, so every rank yields the whole model; ``False``: each
            stage yields its own pairs only and the stages communicate nothing.

    Returns:
        A generator of ``(hf_name, tensor)``: embedding, decoder layers, final norm, head, then the
        MTP layers layer by layer. Every rank of the model's TP, EP (and, with ``all_stages``, PP)
        groups must consume it to the end, in step. Tensors keep the model's dtype and device; those
        that needed no gathering alias the model's parameters (copy before changing them).

    Raises:
        MTPHooksError: on the call, before any tensor moves: an unknown layout, a model without MTP
            layers or one the layout's engine layers cannot hold, a tensor without an HF name
            (learned position embeddings, LayerNorm biases, linear biases, ...).

    Example::

        save_hf_folder(folder, model, "mimo")                         # hf_weights(model, "mimo") on disk
        sync.push(hf_weights(model, "mimo", mtp=False), model="target")   # after a step: the policy
        sync.push(mtp_hf_weights(model, "mimo"))                          # and the draft
    """
    found = layout_named(layout)
    for name, value in (("mtp", mtp), ("all_stages", all_stages)):
        if not isinstance(value, bool):
            raise bad_argument(name, "a bool", describe(value))
    language_models = _language_models(model)
    config = language_models[0].config
    check_config(config, found)
    holding = _holding(language_models) if mtp else []
    for language_model in language_models:
        _check_main_names(language_model, config)
    for language_model in holding:
        _check_names(language_model, found)
    return _pairs(language_models, holding, found, config, all_stages)


def _check_main_names(language_model: nn.Module, config: Any) -> None:
    """Every local main-model tensor has an HF name, before any collective starts."""
    for name, tensor in language_model.state_dict(keep_vars=True).items():
        if not isinstance(tensor, Tensor) or name.endswith("_extra_state") or name.startswith("mtp."):
            continue
        if name.startswith("embedding.") and not getattr(language_model, "pre_process", True):
            continue  # the MTP stage's copy of the embedding: the first stage exports it
        main_target(name, config)  # local decoder-layer numbers: the table does not depend on them


def _head_units(language_model: nn.Module, layout: Layout) -> Iterator[Unit]:
    """A tied model's head in a layout whose engine does not tie: the shared weight, as ``output_layer``."""
    if layout.name == "mimo" or not getattr(language_model, "post_process", True):
        return
    weight = language_model.shared_embedding_or_output_weight()
    first = getattr(language_model, "pre_process", True)
    owner = language_model.embedding.word_embeddings if first else language_model.output_layer
    yield [(_HEAD, _gather_tensor_parallel(weight, _mcore.tp_group_of(owner), False))]


def _stage_units(
    language_models: list[nn.Module], holding: list[nn.Module], layout: Layout, config: Any
) -> Iterator[list[tuple[str, Tensor]]]:
    """This stage's pairs, unit by unit: its main-model tensors, then its MTP layers'."""
    for language_model in language_models:
        tied = bool(getattr(language_model, "share_embeddings_and_output_weights", False))
        for unit in main_units(language_model):
            if not (tied and unit[0][0] == _HEAD):  # a tied stage's output layer is the embedding's copy
                yield [pair for name, tensor in unit for pair in main_hf_pairs(name, tensor, config)]
        if tied:
            for unit in _head_units(language_model, layout):
                yield [pair for name, tensor in unit for pair in main_hf_pairs(name, tensor, config)]
    for language_model in holding:
        for unit in mtp_units(language_model):
            yield [pair for name, tensor in unit for pair in hf_pairs(name, tensor, config, layout)]


def _pairs(
    language_models: list[nn.Module], holding: list[nn.Module], layout: Layout, config: Any, all_stages: bool
) -> Iterator[tuple[str, Tensor]]:
    units = _stage_units(language_models, holding, layout, config)
    group = _mcore.pipeline_group_of(language_models[-1])
    if not all_stages or group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        for unit in units:
            yield from unit
        return
    device = next(iter(language_models[-1].parameters()), torch.empty(0)).device
    for source in dist.get_process_group_ranks(group):  # stage after stage, each to every other
        yield from broadcast_pairs(units if dist.get_rank() == source else None, group, source, device)
