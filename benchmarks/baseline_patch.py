"""The counter-example: MTP training by replacing ``_postprocess`` on one GPTModel instance.

This is how RL frameworks make an mcore 0.16 MTP model return logits today, written here from
scratch so the benchmark can measure that approach next to ``mtp_hooks``: bind a new
``_postprocess`` on the instance with ``types.MethodType``. The replacement runs the MTP block,
computes each depth's loss from mcore pieces (output layer, ``roll_tensor``,
``compute_language_model_loss``, ``MTPLossAutoScaler``) and returns main-head logits.

It is what ``mtp_hooks`` avoids, and is here only to be measured:

* it re-implements mcore's private post-processing, so it silently goes stale when mcore changes
  ``_postprocess`` (its signature changed in 0.17 and again in 0.18);
* an inference micro-batch still runs the whole MTP block (the model decides that in
  ``forward``, before ``_postprocess`` is called), then throws its output away;
* removing it means deleting an instance attribute; a second patch silently wraps the first.
"""

from __future__ import annotations

import types
from typing import Any, Optional

import torch
from torch import Tensor, nn

from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, roll_tensor


def _postprocess_returning_logits(
    self: nn.Module,
    hidden_states: Tensor,
    input_ids: Tensor,
    position_ids: Tensor,
    labels: Optional[Tensor],
    rotary_pos_emb: Any,
    rotary_pos_cos: Any,
    rotary_pos_sin: Any,
    mtp_in_postprocess: Optional[bool] = None,
    loss_mask: Optional[Tensor] = None,
    decoder_input: Any = None,
    attention_mask: Optional[Tensor] = None,
    inference_params: Any = None,
    packed_seq_params: Any = None,
    sequence_len_offset: Any = None,
    runtime_gather_output: Optional[bool] = None,
    extra_block_kwargs: Optional[dict[str, Any]] = None,
    inference_context: Any = None,
) -> Tensor:
    """Replacement of ``GPTModel._postprocess`` (0.16): MTP losses attached to backward, logits out."""
    weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
    if mtp_in_postprocess:
        hidden_states = self.mtp(
            input_ids=input_ids,
            position_ids=position_ids,
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            inference_params=inference_params,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
            embedding=self.embedding,
            **(extra_block_kwargs or {}),
        )
    depth = self.config.mtp_num_layers
    chunks = torch.chunk(hidden_states, 1 + depth, dim=0)
    hidden_states = chunks[0]
    if labels is not None and torch.is_grad_enabled():
        mask = torch.ones_like(labels) if loss_mask is None else loss_mask
        for k in range(depth):
            logits_k, _ = self.output_layer(chunks[k + 1], weight=weight, runtime_gather_output=runtime_gather_output)
            labels, _ = roll_tensor(labels, shifts=-1, dims=-1, cp_group=self.cp_group, packed_seq_params=packed_seq_params)
            mask, tokens = roll_tensor(mask, shifts=-1, dims=-1, cp_group=self.cp_group, packed_seq_params=packed_seq_params)
            ce = self.compute_language_model_loss(labels, logits_k)
            scale = self.config.mtp_loss_scaling_factor / depth
            loss = (mask * ce).sum() * scale
            if not self.config.calculate_per_token_loss:
                loss = loss / tokens.clamp(min=1)
            hidden_states = MTPLossAutoScaler.apply(hidden_states, loss)
    logits, _ = self.output_layer(hidden_states, weight=weight, runtime_gather_output=runtime_gather_output)
    return logits.transpose(0, 1).contiguous()


def patch(model: nn.Module) -> None:
    """Replace ``model._postprocess`` on this instance (the approach ``mtp_hooks`` replaces)."""
    model._postprocess = types.MethodType(_postprocess_returning_logits, model)


def unpatch(model: nn.Module) -> None:
    """Drop the instance attribute, so the class method is found again."""
    model.__dict__.pop("_postprocess", None)
