"""The options of ``attach``: one frozen, validated object, and the vocabulary of every option."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, Mapping, Optional, Sequence, Union, get_args

from mtp_hooks.checks import VALIDATE_MODES, Validate
from mtp_hooks.errors import bad_argument, describe
from mtp_hooks.ops.draft_rule import AcceptRule, DraftRule, Objective

LossImpl = Literal["lean", "fused", "recompute", "dense"]
Output = Literal["logits", "logprobs"]
DraftInputs = Literal["labels", "argmax", "sample"]  # what feeds the draft chain's steps 2..k
DraftLayers = Literal["per_step", "first", "cyclic"]  # which MTP layer runs draft step j
DraftRecycle = Literal["normed", "unnormed"]  # what step j + 1 reads of step j: after or before its final norm
DraftGeometry = Literal["chain", "engine"]  # what steps 2..k attend over (``features.engine_geometry``)
MTPInput = Literal["decoder_output", "pre_final_norm"]  # which main-model state MTP layer 1 reads
StartEmbedding = Literal["kept", "zeroed"]  # the token embedding MTP layer 1 reads at a sequence's position 0
StepWeights = Union[float, Sequence[float]]  # a decay beta (step j weighs beta ** (j - 1)), or one weight per step

LOSS_IMPLS: tuple[str, ...] = get_args(LossImpl)
OUTPUTS: tuple[str, ...] = get_args(Output)
DRAFT_INPUTS: tuple[str, ...] = get_args(DraftInputs)
DRAFT_LAYERS: tuple[str, ...] = get_args(DraftLayers)
MTP_INPUTS: tuple[str, ...] = get_args(MTPInput)
DRAFT_GEOMETRIES: tuple[str, ...] = get_args(DraftGeometry)
DRAFT_RECYCLES: tuple[str, ...] = get_args(DraftRecycle)
START_EMBEDDINGS: tuple[str, ...] = get_args(StartEmbedding)


def _is_real(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


@dataclasses.dataclass(frozen=True)
class Options:
    """How the hooks train the MTP layers and what the model returns (see ``attach``).

    Constructing one validates every field and raises ``MTPHooksError`` naming the first bad one.
    """

    detach_encoder: bool = False
    detach_head: bool = False
    detach_between_depths: bool = False
    loss_scale: Optional[float] = None
    loss_impl: LossImpl = "lean"
    chunk_size: Optional[int] = None
    objective: Objective = "ce"
    agreement_metrics: bool = False
    # The speculative sampler's temperature (0: greedy): the draft objectives and the acceptance at softmax(logits / T).
    draft_temperature: float = 1.0
    # How the rollout engine verifies a draft token (``ops.draft_rule``): what acceptance is measured and trained.
    accept_rule: AcceptRule = "argmax"
    # The draft chain (``chain``): steps trained (None: the model's N layers) and what feeds steps 2..k.
    draft_steps: Optional[int] = None
    draft_inputs: DraftInputs = "labels"
    draft_layers: DraftLayers = "per_step"
    draft_geometry: DraftGeometry = "chain"
    draft_recycle: DraftRecycle = "normed"  # ``features.mtp_input``
    # Each draft step's loss multiplied by its weight (None: all 1, stock's even split).
    draft_step_weights: Optional[StepWeights] = None
    # What MTP layer 1 reads of the main model (``features.mtp_input``): its decoder output, or the final norm's input.
    mtp_input: MTPInput = "decoder_output"
    # The token embedding MTP layer 1 reads at each sequence's position 0 (``features.start_embedding``): mcore's, or
    # zeros, as vLLM's drafters feed it.
    start_embedding: StartEmbedding = "kept"
    output: Output = "logits"
    entropy: bool = False
    temperature: float = 1.0
    validate: Validate = "device"
    # Per-token loss normalisation on any release (``_mcore.depth_coefficient``); None follows it.
    per_token_rescale: Optional[bool] = None
    # A per-micro-batch multiplier of the MTP loss read from each training forward's arguments.
    call_loss_scale: Optional[Callable[[Mapping[str, Any]], Any]] = None

    def __post_init__(self) -> None:
        for name in ("detach_encoder", "detach_head", "detach_between_depths"):
            _require_bool(name, getattr(self, name))
        if self.detach_between_depths and not self.detach_encoder:
            raise bad_argument(
                "detach_between_depths",
                "False unless detach_encoder=True (each depth then trains only its own layer)",
                True,
            )
        if self.loss_scale is not None:
            if not _is_real(self.loss_scale) or not self.loss_scale >= 0:
                raise bad_argument("loss_scale", "None or a float >= 0", describe(self.loss_scale))
            object.__setattr__(self, "loss_scale", float(self.loss_scale))
        if self.loss_impl not in LOSS_IMPLS:
            raise bad_argument("loss_impl", " or ".join(map(repr, LOSS_IMPLS)), describe(self.loss_impl))
        if self.chunk_size is not None and (
            isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1
        ):
            raise bad_argument("chunk_size", "None or an int >= 1", describe(self.chunk_size))
        # DraftRule refuses what T = 0 leaves undefined.
        rule = DraftRule(self.objective, self.draft_temperature, self.accept_rule)
        object.__setattr__(self, "draft_temperature", rule.draft_temperature)
        for name in ("agreement_metrics", "entropy"):
            _require_bool(name, getattr(self, name))
        if self.loss_impl == "dense" and (self.objective != "ce" or self.agreement_metrics):
            raise bad_argument(
                "loss_impl",
                "'lean', 'fused' or 'recompute' for objective 'distill' / 'tv' / 'accept' and for agreement_metrics "
                "(dense keeps stock's CE)",
                "'dense'",
            )
        if self.draft_temperature != 1.0 and not (self.compares_with_main_head or self.draft_inputs == "sample"):
            raise bad_argument(
                "draft_temperature",
                "1.0 unless objective is 'distill', 'tv' or 'accept', agreement_metrics=True or draft_inputs='sample' "
                "('ce' trains on the labels, untempered)",
                describe(self.draft_temperature),
            )
        if self.accept_rule != "argmax" and not self.compares_with_main_head:
            raise bad_argument(
                "accept_rule",
                "'argmax' unless objective is 'distill', 'tv' or 'accept' or agreement_metrics=True "
                "(nothing else measures acceptance)",
                describe(self.accept_rule),
            )
        if self.draft_steps is not None and (
            isinstance(self.draft_steps, bool) or not isinstance(self.draft_steps, int) or self.draft_steps < 1
        ):
            raise bad_argument(
                "draft_steps", "None or an int >= 1 (at least the model's MTP layers)", describe(self.draft_steps)
            )
        if self.draft_inputs not in DRAFT_INPUTS:
            raise bad_argument("draft_inputs", " or ".join(map(repr, DRAFT_INPUTS)), describe(self.draft_inputs))
        if self.draft_layers not in DRAFT_LAYERS:
            raise bad_argument("draft_layers", " or ".join(map(repr, DRAFT_LAYERS)), describe(self.draft_layers))
        if self.draft_geometry not in DRAFT_GEOMETRIES:
            expected = " or ".join(map(repr, DRAFT_GEOMETRIES))
            raise bad_argument("draft_geometry", expected, describe(self.draft_geometry))
        if self.draft_recycle not in DRAFT_RECYCLES:
            raise bad_argument("draft_recycle", " or ".join(map(repr, DRAFT_RECYCLES)), describe(self.draft_recycle))
        if self.draft_step_weights is not None:
            object.__setattr__(self, "draft_step_weights", _step_weights(self.draft_step_weights))
        if self.mtp_input not in MTP_INPUTS:
            raise bad_argument("mtp_input", " or ".join(map(repr, MTP_INPUTS)), describe(self.mtp_input))
        if self.start_embedding not in START_EMBEDDINGS:
            expected = " or ".join(map(repr, START_EMBEDDINGS))
            raise bad_argument("start_embedding", expected, describe(self.start_embedding))
        if self.output not in OUTPUTS:
            raise bad_argument("output", " or ".join(map(repr, OUTPUTS)), describe(self.output))
        if self.entropy and self.output != "logprobs":
            raise bad_argument("entropy", "False unless output='logprobs'", True)
        if not _is_real(self.temperature) or not self.temperature > 0:
            raise bad_argument("temperature", "a float > 0", describe(self.temperature))
        if self.temperature != 1.0 and self.output != "logprobs":
            raise bad_argument(
                "temperature", "1.0 unless output='logprobs' (logits are mcore's own)", describe(self.temperature)
            )
        object.__setattr__(self, "temperature", float(self.temperature))
        if self.validate not in VALIDATE_MODES:
            raise bad_argument("validate", " or ".join(map(repr, VALIDATE_MODES)), describe(self.validate))
        if self.per_token_rescale is not None:
            _require_bool("per_token_rescale", self.per_token_rescale)
        if self.call_loss_scale is not None and not callable(self.call_loss_scale):
            raise bad_argument(
                "call_loss_scale",
                "None or a callable taking the forward's arguments by name",
                describe(self.call_loss_scale),
            )

    @property
    def compares_with_main_head(self) -> bool:
        """Whether each depth is scored against the main head (agreement metrics, draft objectives)."""
        return self.agreement_metrics or self.objective != "ce"

    @property
    def draft_rule(self) -> DraftRule:
        """The objective at ``draft_temperature`` under ``accept_rule``, as the lean kernel takes them."""
        return DraftRule(self.objective, self.draft_temperature, self.accept_rule)

    @property
    def feeds_drafts(self) -> bool:
        """Whether steps 2..k read the previous step's own draft instead of the data's token."""
        return self.draft_inputs != "labels"

    def steps(self, config: Any) -> int:
        """Draft steps trained per forward: ``draft_steps``, or the model's ``mtp_num_layers``."""
        return config.mtp_num_layers if self.draft_steps is None else self.draft_steps

    def step_weights(self, steps: int) -> Optional[tuple[float, ...]]:
        """Each of the ``steps`` draft steps' loss weight (``draft_step_weights``), or ``None`` for stock's (all 1)."""
        weights = self.draft_step_weights
        if weights is None:
            return None
        if isinstance(weights, float):
            return tuple(weights**j for j in range(steps))
        return tuple(weights)

    def mtp_loss_scale(self, config: Any) -> Any:
        """The total MTP loss weight (split evenly over the draft steps): ``loss_scale``, or where it is
        ``None`` the model's ``config.mtp_loss_scaling_factor`` as it reads now."""
        return config.mtp_loss_scaling_factor if self.loss_scale is None else self.loss_scale

    def check_config(self, config: Any) -> None:
        """Refuse options that the model's config leaves undefined."""
        if self.loss_scale is None and config.mtp_loss_scaling_factor is None:
            raise bad_argument("loss_scale", "a float, since config.mtp_loss_scaling_factor is None", None)
        every_layer = self.draft_layers != "first"
        if self.draft_steps is not None and every_layer and self.draft_steps < config.mtp_num_layers:
            raise bad_argument(
                "draft_steps",
                f"None or an int >= the model's {config.mtp_num_layers} MTP layers "
                f"(draft_layers={self.draft_layers!r}: layer j is step j for j <= N; "
                "draft_layers='first' trains fewer steps than layers)",
                describe(self.draft_steps),
            )

        weights = self.draft_step_weights
        if isinstance(weights, tuple) and len(weights) != self.steps(config):
            raise bad_argument(
                "draft_step_weights",
                f"a decay, or one weight per draft step ({self.steps(config)}: draft_steps or the model's MTP layers)",
                f"{len(weights)} weights {weights}",
            )

    def changed(self) -> dict[str, Any]:
        """The fields that differ from their defaults, in declaration order."""
        return {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if getattr(self, field.name) != field.default
        }


def _step_weights(value: Any) -> Union[float, tuple[float, ...]]:
    """``draft_step_weights`` as stored: a decay as a float, per-step weights as a tuple of floats."""
    if _is_real(value):
        if not 0 < value <= 1e6:
            raise bad_argument("draft_step_weights", "a decay > 0, or a sequence of weights >= 0", describe(value))
        return float(value)
    if isinstance(value, (list, tuple)) and value and all(_is_real(w) and 0 <= w <= 1e6 for w in value) and any(value):
        return tuple(float(w) for w in value)
    raise bad_argument(
        "draft_step_weights", "None, a decay > 0, or a non-empty sequence of weights >= 0, not all 0", describe(value)
    )


def _require_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise bad_argument(name, "a bool", describe(value))

