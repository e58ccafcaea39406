"""The public entry points: ``attach`` installs the hooks on a language model and returns its
``MTPHooks`` handle (``handle``), ``attached`` does it for a ``with`` block, ``hooks_of`` finds it again.

No class or instance method is replaced: the behaviour lives in torch hooks (``hooks``, which calls
one module of ``features`` per option) and proxies that exist only inside one forward. The handle
is stored under ``_mtp_hooks`` in the language model's ``__dict__`` and found again by ``hooks_of``.

Parallel layouts follow mcore (its own groups and rolls; nothing to configure): under TP the
logits stay vocab-parallel ``[b, s, V/tp]`` and every MTP reduction runs over the TP group, with
sequence parallelism the head input is gathered first; with CP each depth is normalised by this
CP rank's masked-token count, as stock 0.16.1 does; packed (THD) targets stay inside each
sequence; with pipeline (and virtual pipeline) parallelism attach to every model chunk, labels are
read on the chunk with the output layer, which must also hold the MTP layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Mapping, Optional

from torch import nn

from mtp_hooks import preflight
from mtp_hooks.checks import Validate
from mtp_hooks.errors import MTPHooksError
from mtp_hooks.handle import MTPHooks
from mtp_hooks.models import STATE_KEY, find_language_model
from mtp_hooks.options import AcceptRule, DraftGeometry, DraftInputs, DraftLayers, DraftRecycle, LossImpl, MTPInput
from mtp_hooks.options import Objective
from mtp_hooks.options import Options, Output
from mtp_hooks.options import StartEmbedding, StepWeights
from mtp_hooks.profiles import EngineProfile, merged_options


def attach(
    model: nn.Module,
    *,
    detach_encoder: bool = False,
    detach_head: bool = False,
    detach_between_depths: bool = False,
    loss_scale: Optional[float] = None,
    loss_impl: LossImpl = "lean",
    chunk_size: Optional[int] = None,
    objective: Objective = "ce",
    agreement_metrics: bool = False,
    draft_temperature: float = 1.0,
    accept_rule: AcceptRule = "argmax",
    draft_steps: Optional[int] = None,
    draft_inputs: DraftInputs = "labels",
    draft_layers: DraftLayers = "per_step",
    draft_geometry: DraftGeometry = "chain",
    draft_recycle: DraftRecycle = "normed",
    draft_step_weights: Optional[StepWeights] = None,
    mtp_input: MTPInput = "decoder_output",
    start_embedding: StartEmbedding = "kept",
    output: Output = "logits",
    entropy: bool = False,
    temperature: float = 1.0,
    validate: Validate = "device",
    per_token_rescale: Optional[bool] = None,
    call_loss_scale: Optional[Callable[[Mapping[str, Any]], Any]] = None,
    engine: Optional[EngineProfile] = None,
) -> MTPHooks:
    """Make an mcore model with MTP layers return main-head logits while its MTP layers train.

    Hooks and proxies only: no method of any class or instance is replaced, and ``remove()``
    leaves the model exactly as stock.

    Args:
        model: a ``GPTModel``, a wrapper exposing it as ``.module`` (DDP, Float16Module), or a
            model whose ``.language_model`` is one. Its config must have ``mtp_num_layers``.
        detach_encoder: MTP layers get detached next-token embeddings and detached trunk hidden
            states, so the MTP loss sends no gradient into the decoder, nor into the embedding
            through the MTP layers' input (a tied output weight still trains without ``detach_head``).
        detach_head: MTP logits use a detached output weight (tied or untied).
        detach_between_depths: with ``detach_encoder``, also detach the hidden states each MTP
            depth hands to the next, so depth k's loss trains MTP layer k alone (verl's
            ``mtp_patch`` semantics); without it depth k's loss also reaches layers 1 .. k-1, as
            in stock mcore.
        loss_scale: total MTP loss weight, split evenly over depths; ``None`` reads
            ``config.mtp_loss_scaling_factor`` at every forward.
        loss_impl: ``"lean"`` (default) never keeps MTP logits for backward and picks per
            forward ``"fused"`` (the head's weight gradient accumulated during forward in one fp32
            ``[V/tp, h]`` buffer: stock's matmul count) unless that buffer outweighs the MTP
            logits it replaces (``h > N * tokens``), then ``"recompute"`` (weight gradient
            recomputed in backward: one head matmul per depth more, no buffer). ``"fused"`` and
            ``"recompute"`` force a path; ``"dense"`` computes logits with the output layer and
            mcore's own CE, as stock mcore does. ``loss_path`` says which path ran.
        chunk_size: tokens per chunk of the lean loss and log-probs; ``None``: the largest power
            of two whose fp32 logits fit 256 MiB (``ops.chunking.auto_chunk_size``).
        objective: what the MTP heads learn (lean only). ``"ce"``: stock cross-entropy on the
            labels. ``"distill"``: cross-entropy against the main head's detached distribution at
            the position predicting the same token. ``"tv"``: total variation to that
            distribution, ``1 - sum_v min(p, q)``. ``"accept"``: ``-log alpha`` per token, alpha the
            expected acceptance under ``accept_rule``; under ``"argmax"``, whose ``p_T(argmax q)``
            has no gradient, the surrogate ``-log sum_v p_T q_1`` with the draft's untempered
            softmax (optimum: the draft's argmax is the target's; at T = 0 the draft's CE against
            the target's argmax; ``mtp_hooks.ops.draft_rule`` says why).
        agreement_metrics: also report per depth ``mtp_k/agree`` (MTP argmax equals the main
            head's at the matching position) and ``mtp_k/accept`` (the expected acceptance alpha
            under ``accept_rule``), and ``mtp/accept_len`` (expected accepted draft tokens,
            ``MTPHooks.metrics``); costs one more head matmul per depth in forward (lean only;
            implied by ``"distill"`` / ``"tv"`` / ``"accept"``).
        draft_temperature: the rollout's sampling temperature T (0: greedy): ``"distill"``,
            ``"tv"``, ``"accept"`` and the acceptance metrics use ``p_main`` and ``q_mtp`` at
            ``softmax(logits / T)``, both tempered as a speculative sampler at T verifies against
            the tempered target (at T = 0 both one-hot at the first argmax). The CE on the labels
            (``"ce"``, ``mtp_k/loss``) stays untempered. A float >= 0; other than 1.0 only with a
            draft objective, ``agreement_metrics`` or ``draft_inputs="sample"``; 0 refused with
            ``"distill"``, ``"tv"``, and ``"accept"`` under ``"sampled"`` / ``"match"`` (undefined
            or without gradient there).
        accept_rule: how the rollout engine verifies a draft token, i.e. which acceptance
            ``mtp_k/accept``, ``mtp/accept_len`` and ``"accept"`` measure: ``"argmax"`` (default;
            vLLM's and SGLang's default: the draft's argmax accepted with probability
            ``p_T(argmax q)``), ``"sampled"`` (rejection sampling of sampled drafts:
            ``sum_v min(p_T, q_T)``) or ``"match"`` (exact match of independent samples, an
            exact-match verifier fed a sampled draft: ``sum_v p_T q_T``). All three are argmax agreement at T = 0. Other
            than ``"argmax"`` only where acceptance is measured.
        draft_steps: train a chain of k draft steps (``mtp_hooks.features.chain``); ``None``: the
            model's N MTP layers. Which layer runs step j is ``draft_layers``'; every step's loss
            (the chosen ``objective``) targets the token at ``t + j + 1``, the loss weight split
            evenly over the k steps. Needs every MTP layer on the output layer's pipeline stage.
        draft_inputs: what feeds steps 2..k: ``"labels"`` (teacher forcing: the data's token,
            as mcore trains), ``"argmax"`` or ``"sample"`` (the previous step's own draft: its
            argmax, or a sample at ``draft_temperature`` (its argmax at 0), as a speculative decoder feeds it),
            always with the previous step's output hidden state. The draft token is detached.
        draft_layers: which MTP layer runs draft step j, as the target engine schedules them:
            ``"per_step"`` (step j <= N is layer j, steps past N reuse the last layer: mcore's
            depths, SGLang's multi-layer drafter) or ``"first"`` (layer 1 for every step, each
            on the previous step's output: vLLM 0.32's MTP proposer, which never runs layers
            2..N) or ``"cyclic"`` (step j is layer ((j - 1) mod N) + 1, each over its own states:
            vLLM 0.34's model runner V2 with N >= 2). With ``"first"`` and N >= 2 the block still
            runs layers 2..N (mcore's block calls every layer), their outputs are dropped and they
            get no gradient; train an N = 1 model for vLLM to spend nothing on them.
        draft_geometry: what steps 2..k attend over: ``"chain"`` (default; each step over its own states at every
            position, mcore's depth geometry) or ``"engine"`` (as an engine reusing one MTP layer drafts: from each
            start p, step 1's cached states up to p and the start's own steps 2..j; rotary positions advanced by
            j - 1), for every start at once (``features.engine_geometry``). Needs one layer drafting every step.
        draft_recycle: what step j + 1 reads of step j: ``"normed"`` (default; its output after the MTP layer's
            final norm, as mcore and most engines hand it on) or ``"unnormed"`` (before that norm, as vLLM 0.32 /
            0.33's GLM-4.5 drafter does); the head reads the normed output either way.
        draft_step_weights: each draft step's loss multiplied by a weight: a sequence of one weight
            >= 0 per step (``draft_steps``, or the model's N layers), or a decay ``beta`` > 0 (step j
            weighs ``beta ** (j - 1)``, e.g. 0.6). ``None`` (default): all 1, stock's even split. Step j's
            loss then weighs ``loss_scale * w_j / k``, before the per-token rule where
            ``calculate_per_token_loss`` is set; ``mtp_j/loss`` stays the unweighted mean and
            ``metrics()`` adds ``mtp_j/weight``.
        mtp_input: which hidden state of the main model MTP layer 1 reads: ``"decoder_output"`` (after the
            decoder's final norm, as mcore trains it) or ``"pre_final_norm"`` (the norm's input, as vLLM's MiMo
            drafter reads it); the main head reads the normed output either way.
        start_embedding: the token embedding MTP layer 1 reads at each sequence's position 0 in draft step 1:
            ``"kept"`` (mcore's) or ``"zeroed"`` (zeros, as vLLM's DeepSeek-V3, GLM-4.5 and MiMo drafters feed it,
            so the draft's attention back to the sequence's start reads what the engine computes there;
            ``features.start_embedding``).
        output: ``"logits"`` (mcore's own ``[b, s, V/tp]``) or ``"logprobs"``: a
            ``TokenLogProbs(logprobs, entropy)`` of ``[b, s]`` tensors, the main head's
            log-probabilities of the labels computed in chunks without ``[b, s, V]`` logits;
            every forward then needs labels (training or not).
        entropy: with ``output="logprobs"``, also return the per-token entropy.
        temperature: with ``output="logprobs"``, divide the main head's logits by it.
        validate: how the values of the targets are checked (mask in {0, 1}, labels inside the
            vocabulary): ``"device"`` (default) without a host sync, by device-side asserts
            (immediate ``MTPHooksError`` on CPU; a CUDA device-side assert on GPU);
            ``"host"`` with one host sync per check and a full ``MTPHooksError``; ``"off"``.
        per_token_rescale: with ``config.calculate_per_token_loss``, whether depth k's loss is
            rescaled by original / rolled token count (stock 0.17.1+) or not (stock 0.14 - 0.16);
            ``None`` follows the installed release.
        call_loss_scale: called at the start of every training forward with that forward's
            arguments by name (``input_ids``, ``packed_seq_params``, ...); returns a multiplier of
            the micro-batch's MTP loss (float or 0-d tensor) or ``None``. Multiplies
            ``micro_batch(loss_scale=)``.
        engine: the rollout engine the draft is for (``mtp_hooks.profiles.vllm("0.32", family, k)``, ``sglang``,
            ``megatron``): sets ``draft_steps``, ``draft_layers``, ``draft_inputs``, ``accept_rule``,
            ``mtp_input``, ``draft_geometry``, ``draft_recycle`` and ``start_embedding`` as that engine drafts; one
            of them also given with another value is refused. ``predict_engine_acceptance`` takes the same profile.

    Returns:
        An ``MTPHooks`` handle (also a context manager that removes the hooks on exit).

    Raises:
        MTPHooksError: for a model without MTP layers, a second attach, bad arguments (also
            for the wrappers given: ``features.detach.check``), or a megatron-core release that
            calls the output layer, MTP block or MTP layers with other keyword names than the
            hooks rely on (``_mcore.check_call_conventions``); all of them raised by one check
            phase (``preflight``) before anything is registered.

    Example::

        hooks = mtp_hooks.attach(model, detach_encoder=True)
        with hooks.micro_batch(labels=labels, loss_mask=loss_mask):
            logits = model(input_ids, position_ids, attention_mask)   # [b, s, V/tp]

    The model is stock outside the hooks' forwards, and every user hook inside one sees it stock
    (the two attributes a forward changes are changed only inside mcore's post-processing). If a
    forward raises, or a model forward hook after the hooks' own raises, that forward's targets
    are dropped with their ``micro_batch`` block and its metrics are not counted.

    One forward at a time per model (a lock): a forward from a second thread while one is in
    flight, or a ``micro_batch`` while another thread's is open, raises ``MTPHooksStateError``.
    Separate models may run in separate threads. ``copy.deepcopy`` of the model (with a memo
    sharing its process groups, as a stock mcore model needs) gives a copy with its own hooks.
    """
    arguments = locals()  # the options, by the names ``Options`` has (a test holds the two equal)
    fields = dataclasses.fields(Options)
    given = merged_options(engine, {f.name: arguments[f.name] for f in fields}, {f.name: f.default for f in fields})
    options = Options(**given)
    language_model = preflight.check(model, options)
    hooks = MTPHooks(language_model, options)
    language_model.__dict__[STATE_KEY] = hooks
    return hooks


@contextlib.contextmanager
def attached(model: nn.Module, **options: Any) -> Iterator[MTPHooks]:
    """``attach`` for the length of a ``with`` block; the hooks are removed on exit."""
    hooks = attach(model, **options)
    try:
        yield hooks
    finally:
        hooks.remove()


def hooks_of(model: nn.Module) -> Optional[MTPHooks]:
    """The ``MTPHooks`` attached to ``model`` (or the language model inside it), or ``None``
    (also for a module that holds no mcore language model)."""
    try:
        language_model = find_language_model(model)
    except MTPHooksError:
        return None
    return language_model.__dict__.get(STATE_KEY)
