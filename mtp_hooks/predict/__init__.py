"""What a rollout engine will accept of the trained draft, predicted by the trainer from its weights.

``predict_engine_acceptance(model, hooks, prompts, token_ids, max_tokens)`` replays an engine's speculative
decoding with argmax drafts (greedy or sampling: ``replay``'s docstring) on the engine's own generated tokens
and returns the per-position acceptance vLLM's counters would show (``Replay``), without an engine in the loop:

* ``hits``: ``draft_hits``, one training-style forward of the hooked model that says, at every position,
  whether each draft step's token equals the engine's (``MTP_INPUTS``: which hidden state MTP layer 1 reads);
* ``engine_steps``: ``engine_step_drafts``, draft steps 2..k as vLLM's proposer runs them (one token at a
  time over step 1's states), for ``geometry="engine"``, handing each step the state the engine hands on
  (``RECYCLES``: normed, or unnormed as vLLM 0.32's GLM-4.5 drafter);
* ``replay``: ``replay``, the engine's verification steps over those indicators, and ``Replay``;
* ``head``: the main head's greedy pick (its own weight, or the embedding's when they are tied).

``START_EMBEDDINGS``: what MTP layer 1 reads as the token embedding at a sequence's position 0, ``"kept"`` as mcore
trains it or ``"zeroed"`` as vLLM's drafters replace it.

Which MTP layer runs each step comes from the hooks (``MTPHooks.draft_plan()``), an MTP layer's transformer
layer from ``mtp_hooks.models.mtp_layer_body``. Unsharded models (tensor parallelism 1) on one device.
Measured against vLLM in ``docs/engine.md`` (the acceptance benchmark, the layer-schedule tests).
"""

from mtp_hooks._quiet import megatron_notices_silenced as _megatron_notices_silenced

with _megatron_notices_silenced():  # megatron-core's import-time notices, as mtp_hooks' other faces
    from mtp_hooks.predict.engine_steps import RECYCLES, engine_step_drafts
    from mtp_hooks.predict.hits import MTP_INPUTS, START_EMBEDDINGS, draft_hits
    from mtp_hooks.predict.replay import Replay, engine_sequences, predict_engine_acceptance, replay

__all__ = [
    "MTP_INPUTS", "RECYCLES", "START_EMBEDDINGS", "Replay", "draft_hits", "engine_sequences", "engine_step_drafts",
    "predict_engine_acceptance", "replay",
]
