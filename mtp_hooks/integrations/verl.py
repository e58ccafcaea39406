"""verl's Megatron engine: ``attach_engine_mtp`` in place of ``patch_engine_mtp``.

verl 0.9.1 wires MTP with ``verl.utils.megatron_utils.patch_engine_mtp(module, model_config)``,
which replaces ``GPTModel._postprocess`` (and, with ``model_config.mtp.detach_encoder``,
``MultiTokenPredictionLayer._get_embeddings``; always ``_checkpointed_forward``) on every model
chunk. ``attach_engine_mtp`` takes the same arguments and gives the same MTP losses and
gradients with ``mtp_hooks.attach`` on every chunk, per installed megatron-core release:

* ``detach_encoder``: the next-token embedding and the trunk's hidden state entering the first
  MTP layer are detached; the hidden states between depths stay attached (``detach_encoder=True``).
* Without ``process_mtp_loss`` (0.14 - 0.16) verl's own loop detaches the output layer's
  parameters for MTP (``detach_head=True``) and, with ``calculate_per_token_loss``, rescales
  depth k by original / rolled token count (``per_token_rescale=True``).
* With it (0.17+) verl delegates to ``process_mtp_loss``: the head trains unless
  ``config.mtp_detach_heads``; with ``calculate_per_token_loss`` the MTP weight is multiplied by
  ``packed_seq_params._verl_mtp_loss_normalization_factor`` when verl's engine set it
  (routed / loss tokens, ``call_loss_scale``).
* Target rolls and the embedding path use ``packed_seq_params.cp_group`` when present (the
  hooks do so for every user).

``engine_draft_options`` reads from verl's rollout config how its engine verifies a draft token and
at which temperature (``accept_rule``, ``draft_temperature``), so the hooks measure and train what
the engine accepts; ``draft_acceptance_metrics`` puts the trainer's expected draft acceptance beside
the engine's measured one (verl's ``rollout/spec_accept_*``) and their gap.

verl itself is not imported here.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional, Union

from torch import nn

from mtp_hooks import _mcore
from mtp_hooks.errors import MTPHooksError, bad_argument, describe
from mtp_hooks.api import attach
from mtp_hooks.handle import MTPHooks
from mtp_hooks.models import find_language_model

# Where verl's engine (``gptmodel_forward_model_engine``) puts its per-micro-batch factor.
NORMALIZATION_FACTOR_ATTR = "_verl_mtp_loss_normalization_factor"

# What verl 0.9.1 logs of the rollout engine's speculative decoding (``compute_spec_decode_metrics``).
ENGINE_ACCEPT_RATE = "rollout/spec_accept_rate"
ENGINE_ACCEPT_LENGTH = "rollout/spec_accept_length"

# How verl 0.9.1's rollout engines verify an MTP draft token by default (``ops.draft_rule``): vLLM
# drafts the head's argmax and accepts it with probability p_T(draft); SGLang does the same with
# ``speculative_eagle_topk = 1``.
ENGINE_ACCEPT_RULES = {"vllm": "argmax", "sglang": "argmax"}
# Keys of vLLM's ``speculative_config`` that change its verification (sampled drafts, other samplers).
VLLM_RULE_KEYS = ("rejection_sample_method", "draft_sample_method")

__all__ = [
    "ENGINE_ACCEPT_LENGTH", "ENGINE_ACCEPT_RATE", "ENGINE_ACCEPT_RULES", "NORMALIZATION_FACTOR_ATTR",
    "attach_engine_mtp",
    "draft_acceptance_metrics", "engine_draft_options", "verl_options",
]


def verl_options(model_config: Any, config: Any) -> dict[str, Any]:
    """The ``attach`` options that reproduce verl 0.9.1's MTP patch on this megatron-core release.

    ``model_config``: verl's ``HFModelConfig`` (or anything whose ``.mtp.detach_encoder`` is a
    bool); ``config``: the model's ``TransformerConfig``.
    """
    mtp = getattr(model_config, "mtp", None)
    detach_encoder = getattr(mtp, "detach_encoder", None)
    if not isinstance(detach_encoder, bool):
        raise bad_argument(
            "model_config",
            "verl's model config, whose .mtp (MtpConfig) has a bool detach_encoder",
            describe(model_config),
        )
    legacy = not _mcore.PER_TOKEN_LOSS_RESCALED  # no process_mtp_loss: verl's own loop
    options: dict[str, Any] = dict(detach_encoder=detach_encoder, detach_head=legacy, per_token_rescale=True)
    if not legacy and getattr(config, "calculate_per_token_loss", False):
        options["call_loss_scale"] = normalization_factor
    return options


def normalization_factor(call: Mapping[str, Any]) -> Optional[float]:
    """verl's routed / loss token factor on this forward's ``packed_seq_params``, or ``None``."""
    factor = getattr(call.get("packed_seq_params"), NORMALIZATION_FACTOR_ATTR, None)
    if factor is not None and not factor > 0:
        raise bad_argument(
            f"packed_seq_params.{NORMALIZATION_FACTOR_ATTR}", "a factor > 0 (routed / loss tokens)", describe(factor)
        )
    return factor


def attach_engine_mtp(module: Any, model_config: Any, **overrides: Any) -> list[MTPHooks]:
    """``mtp_hooks.attach`` on every model chunk with verl 0.9.1's MTP semantics.

    Args:
        module: a model chunk (``GPTModel`` or a DDP / Float16Module wrapper of one) or a list of
            them (virtual pipeline stages), as verl's ``patch_engine_mtp`` takes.
        model_config: verl's ``HFModelConfig``; ``model_config.mtp`` is its ``MtpConfig``, of which
            only ``detach_encoder`` changes the patch (``mtp_loss_scaling_factor`` reaches the model
            through its ``TransformerConfig``, as in verl).
        overrides: further ``attach`` options (e.g. ``loss_impl="dense"``), or replacements of
            the ones verl's semantics set.

    Returns:
        One ``MTPHooks`` per chunk, in order; ``remove()`` on each restores stock mcore. Chunks
        attached before a refused one are removed again.
    """
    chunks = module if isinstance(module, (list, tuple)) else [module]
    if not chunks or not all(isinstance(chunk, nn.Module) for chunk in chunks):
        raise bad_argument("module", "a model chunk (nn.Module) or a non-empty list of them", describe(module))
    attached: list[MTPHooks] = []
    try:
        for chunk in chunks:
            options = {**verl_options(model_config, find_language_model(chunk).config), **overrides}
            attached.append(attach(chunk, **options))
    except MTPHooksError:
        for hooks in attached:
            hooks.remove()
        raise
    return attached


def engine_draft_options(rollout: Any) -> dict[str, Any]:
    """``accept_rule`` and ``draft_temperature`` of verl 0.9.1's rollout engine, as ``attach`` takes them.

    ``rollout``: verl's rollout config, ``config.actor_rollout_ref.rollout`` (a ``RolloutConfig`` or
    its OmegaConf node). The rule is the engine's default (``ENGINE_ACCEPT_RULES``, by
    ``rollout.name``); the temperature ``rollout.temperature`` (0: greedy). Refused
    (``MTPHooksError`` naming ``rollout``): another engine, SGLang with ``speculative_eagle_topk``
    > 1 (tree drafts), and vLLM with a ``speculative_config`` in ``rollout.engine_kwargs.vllm`` that
    sets ``rejection_sample_method`` or ``draft_sample_method``: their verification is not one that
    ``accept_rule`` names. Pass the result to ``attach_engine_mtp`` (with ``agreement_metrics=True``
    or a draft objective) so the hooks measure what the engine accepts.
    """
    name = getattr(rollout, "name", None)
    temperature = getattr(rollout, "temperature", None)
    if name not in ENGINE_ACCEPT_RULES:
        raise bad_argument(
            "rollout",
            f"verl's rollout config with name in {sorted(ENGINE_ACCEPT_RULES)} (the engines whose rule is known)",
            describe(name),
        )
    top_k = getattr(getattr(rollout, "mtp", None), "speculative_eagle_topk", 1)
    if name == "sglang" and top_k != 1:
        raise bad_argument(
            "rollout", "mtp.speculative_eagle_topk = 1 (SGLang's chain of argmax drafts)", describe(top_k)
        )
    speculative = ((getattr(rollout, "engine_kwargs", None) or {}).get("vllm") or {}).get("speculative_config") or {}
    speculative = json.loads(speculative) if isinstance(speculative, str) else speculative  # verl takes either
    changed = sorted(
        key for key in VLLM_RULE_KEYS if isinstance(speculative, Mapping) and speculative.get(key) is not None
    )
    if name == "vllm" and changed:
        raise bad_argument(
            "rollout",
            "vLLM's default verification "
            f"(engine_kwargs.vllm.speculative_config without {' or '.join(VLLM_RULE_KEYS)})",
            changed,
        )
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise bad_argument("rollout", "a rollout temperature >= 0", describe(temperature))
    return {"accept_rule": ENGINE_ACCEPT_RULES[name], "draft_temperature": float(temperature)}


def rollout_draft_tokens(rollout: Any) -> int:
    """The draft tokens verl's engine proposes per verification step: vLLM's ``mtp.num_speculative_tokens``,
    SGLang's ``mtp.speculative_num_steps``."""
    field = "num_speculative_tokens" if getattr(rollout, "name", None) == "vllm" else "speculative_num_steps"
    drafts = getattr(getattr(rollout, "mtp", None), field, None)
    if isinstance(drafts, bool) or not isinstance(drafts, int) or drafts < 1:
        raise bad_argument("rollout", f"verl's rollout config with mtp.{field} >= 1", describe(drafts))
    return drafts


def draft_acceptance_metrics(
    trainer: Union[MTPHooks, Mapping[str, float]], engine: Mapping[str, Any], *, rollout: Any
) -> dict[str, float]:
    """The trainer's expected draft acceptance beside the rollout engine's measured one, for one step.

    ``trainer``: ``MTPHooks`` (read with ``metrics(reset=False)``) or a dict they returned, with
    acceptance measured (``agreement_metrics=True`` or a draft objective). ``engine``: verl's step
    metrics. ``rollout``: verl's rollout config (``config.actor_rollout_ref.rollout``), which says how
    the engine verifies and at which temperature (``engine_draft_options``) and how many draft
    tokens it proposes per verification step (``rollout_draft_tokens``: 1 or the trainer's depth N).
    Hooks whose ``accept_rule`` or ``draft_temperature`` differ from the engine's are refused
    (``MTPHooksError`` naming ``trainer``): their acceptance is another quantity, and the gap would
    read as a stale draft. A dict of metrics cannot say under which rule it was measured: the
    caller vouches for it (attach with ``**engine_draft_options(rollout)``).

    verl 0.9.1 (``compute_spec_decode_metrics``) takes per request the engine's drafted tokens d,
    accepted draft tokens a and verification steps v and logs the unweighted means over requests of
    ``spec_accept_rate = a / d`` and ``spec_accept_length = 1 + a / v``: the length counts the
    target's own (bonus or correcting) token of every step. ``mtp/accept_len`` (N drafts) or
    ``mtp_1/accept`` (one) is the trainer's expected a / v, so the prediction is
    ``mtp/predicted_spec_accept_length = 1 + that`` and, with d = draft_tokens * v,
    ``mtp/predicted_spec_accept_rate = that / draft_tokens``; ``mtp/accept_len_gap`` and
    ``mtp/accept_rate_gap`` are engine minus prediction. A draft the engine holds that is not the
    trainer's (stale, mis-synced) shows as a gap beyond sampling noise. The trainer's figures are
    teacher-forced and token-weighted over its positions, the engine's per request over its steps,
    so on the same policy and draft they agree up to noise (exactly in expectation at one draft
    token; depth k >= 2 of a chain reads its own drafts in the engine, the data's in the trainer).
    Without the engine's figures (speculative rollout off) only the trainer's are returned.
    """
    expected = engine_draft_options(rollout)
    draft_tokens = rollout_draft_tokens(rollout)
    if isinstance(trainer, MTPHooks):
        measured = {"accept_rule": trainer.options.accept_rule, "draft_temperature": trainer.options.draft_temperature}
        if measured != expected:
            raise bad_argument(
                "trainer", f"hooks measuring the {rollout.name} rollout's acceptance: {expected}", measured
            )
        metrics: Any = trainer.metrics(reset=False)
    else:
        metrics = trainer
    if not isinstance(metrics, Mapping):
        raise bad_argument("trainer", "MTPHooks or the dict of their metrics()", describe(trainer))
    depth = sum(1 for key in metrics if key.startswith("mtp_") and key.endswith("/tokens"))
    if draft_tokens not in {1, depth}:
        raise bad_argument(
            "rollout", f"1 or the trainer's MTP depth {depth} draft tokens per verification step", draft_tokens
        )
    key = "mtp_1/accept" if draft_tokens == 1 else "mtp/accept_len"
    if key not in metrics:
        raise bad_argument(
            "trainer",
            f"metrics with {key!r} (attach with agreement_metrics=True or a draft objective; a step with targets)",
            sorted(metrics),
        )
    out = {k: float(v) for k, v in metrics.items() if k.endswith("/accept") or k == "mtp/accept_len"}
    accepted = float(metrics[key])
    out["mtp/predicted_spec_accept_length"] = 1.0 + accepted
    out["mtp/predicted_spec_accept_rate"] = accepted / draft_tokens
    present = [name in engine for name in (ENGINE_ACCEPT_RATE, ENGINE_ACCEPT_LENGTH)]
    if not any(present):
        return out
    if not all(present):
        raise bad_argument(
            "engine", f"verl's metrics with both {ENGINE_ACCEPT_RATE!r} and {ENGINE_ACCEPT_LENGTH!r}", sorted(engine)
        )
    rate, length = float(engine[ENGINE_ACCEPT_RATE]), float(engine[ENGINE_ACCEPT_LENGTH])
    out[ENGINE_ACCEPT_RATE], out[ENGINE_ACCEPT_LENGTH] = rate, length
    out["mtp/accept_rate_gap"] = rate - out["mtp/predicted_spec_accept_rate"]
    out["mtp/accept_len_gap"] = length - out["mtp/predicted_spec_accept_length"]
    return out
