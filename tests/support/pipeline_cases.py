"""The pipeline parity matrix's cases: factors, a pairwise selection, and where stock itself is wrong.

Test-only support for ``tests/distributed/test_parity_pipeline.py``. A ``Case`` is one training setup run through
mcore's own pipeline schedule: layout, tied or untied heads, the hooks' output mode and loss path,
the gradient machinery (mcore DDP, gradient-accumulation fusion, ``overlap_grad_reduce``),
``defer_embedding_wgrad_compute``, the detach flags and the draft chain. ``pairwise(...)`` picks cases covering every
pair of factor values that the constraints allow; ``full`` mode takes the whole product.

``STOCK_DEFECTS`` lists the knobs under which stock mcore computes wrong gradients itself; a case
that sets one is compared with stock *without* that knob (``Case.reference``), and each entry names
the test that pins stock's deviation (it fails once stock is fixed, and the entry must go).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Optional

from tests.support.stock_references import CHAIN, ENGINE

FACTORS: dict[str, tuple[Any, ...]] = {
    "layout": ("pp2", "pp2_vpp2"),
    "tied": (False, True),
    "output": ("logits", "logprobs"),
    "loss_impl": ("lean", "fused", "recompute", "dense"),
    "sync": ("ddp", "fusion", "overlap", "fusion_overlap"),
    "defer": (False, True),
    "detach": ("none", "encoder", "head", "both"),
    # The draft chain: none (mcore's N depths), or k = 3 steps of layer 1 in the engine's geometry (rotary twins).
    "draft": ("none", "engine_first_k3"),
}

LAYOUTS: dict[str, dict[str, Any]] = {
    "pp2": {"pipeline_model_parallel_size": 2},
    "pp2_vpp2": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
    "tp2_pp2": {"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 2},
    "cp2_pp2": {"pipeline_model_parallel_size": 2, "context_parallel_size": 2},
}


@dataclasses.dataclass(frozen=True)
class Knobs:
    """What a stock run is built with (stock has no loss path, output mode or detach flags)."""

    tied: bool
    fusion: bool
    overlap: bool
    defer: bool
    mtp_factor: Optional[float] = None  # None: the model's own; 0.0: the main loss's gradients only
    draft: str = "none"  # the chain value of ``stock_references.CHAIN`` stock applies on the last stage


@dataclasses.dataclass(frozen=True)
class Case:
    layout: str = "pp2"
    tied: bool = False
    output: str = "logits"
    loss_impl: str = "lean"
    sync: str = "ddp"
    defer: bool = False
    detach: str = "none"
    draft: str = "none"

    @property
    def id(self) -> str:
        parts = [self.layout, "tied" if self.tied else "untied", self.output, self.loss_impl, self.sync]
        parts += ["defer"] if self.defer else []
        parts += [f"detach_{self.detach}"] if self.detach != "none" else []
        parts += [self.draft] if self.draft != "none" else []
        return "-".join(parts)

    @property
    def parallel_layout(self) -> dict[str, Any]:
        return dict(LAYOUTS[self.layout])

    @property
    def world_size(self) -> int:
        layout = self.parallel_layout
        return layout["pipeline_model_parallel_size"] * layout.get("tensor_model_parallel_size", 1) * layout.get("context_parallel_size", 1)

    @property
    def vpp(self) -> Optional[int]:
        return self.parallel_layout.get("virtual_pipeline_model_parallel_size")

    @property
    def fusion(self) -> bool:
        return self.sync in ("fusion", "fusion_overlap")

    @property
    def overlap(self) -> bool:
        return self.sync in ("overlap", "fusion_overlap")

    @property
    def detach_encoder(self) -> bool:
        return self.detach in ("encoder", "both")

    @property
    def detach_head(self) -> bool:
        return self.detach in ("head", "both")

    @property
    def knobs(self) -> Knobs:
        """Stock built as this case (the side-by-side twin)."""
        return Knobs(self.tied, self.fusion, self.overlap, self.defer, draft=self.draft)

    @property
    def reference(self) -> Knobs:
        """The stock run whose gradients are right for this case: its own knobs, less every knob
        under which stock is wrong (``STOCK_DEFECTS``)."""
        knobs = self.knobs
        for defect in STOCK_DEFECTS:
            if defect.applies(self):
                knobs = defect.fixed(knobs)
        return knobs

    @property
    def hook_options(self) -> dict[str, Any]:
        options = {"loss_impl": self.loss_impl, "output": self.output, "detach_encoder": self.detach_encoder, "detach_head": self.detach_head}
        return {**options, **draft_options(self.draft)}


def draft_options(draft: str) -> dict[str, Any]:
    """The ``attach`` options of a ``draft`` factor value (a chain value of ``stock_references.CHAIN``)."""
    steps, inputs, layers = CHAIN[draft]
    if steps is None:
        return {}
    return {"draft_steps": steps, "draft_inputs": inputs, "draft_layers": layers, **({"draft_geometry": "engine"} if draft in ENGINE else {})}


def draft_steps(draft: str, depth: int) -> int:
    """The MTP losses a forward records: the chain's k, or the model's ``depth`` layers."""
    return CHAIN[draft][0] or depth


def allowed(case: Case) -> bool:
    """Constraints: mcore defers the head's wgrad only with gradient-accumulation fusion; with tied
    heads one detach flag alone has no stock reference here (the shared weight's gradient would
    have to be split into its head and lookup shares), so tied cases detach both or neither."""
    if case.defer and not case.fusion:
        return False
    if case.tied and case.detach in ("encoder", "head"):
        return False
    return True


def full_product(base: Optional[dict[str, Any]] = None) -> list[Case]:
    factors = {**FACTORS, **{k: (v,) for k, v in (base or {}).items()}}
    names = list(factors)
    cases = [Case(**dict(zip(names, values))) for values in itertools.product(*factors.values())]
    return [case for case in cases if allowed(case)]


def pairwise(base: Optional[dict[str, Any]] = None) -> list[Case]:
    """A small set of allowed cases covering every allowed pair of factor values (greedy: each
    step takes the candidate covering the most pairs not yet covered; deterministic)."""
    candidates = full_product(base)
    names = [name for name in FACTORS if name not in (base or {})]

    def pairs_of(case: Case) -> set[tuple[str, Any, str, Any]]:
        return {(a, getattr(case, a), b, getattr(case, b)) for a, b in itertools.combinations(names, 2)}

    uncovered = set().union(*(pairs_of(case) for case in candidates))
    chosen: list[Case] = []
    while uncovered:
        best = max(candidates, key=lambda case: len(pairs_of(case) & uncovered))
        chosen.append(best)
        uncovered -= pairs_of(best)
    return chosen


# --------------------------------------------------------------------------- where stock is wrong


@dataclasses.dataclass(frozen=True)
class StockDefect:
    """A knob under which stock mcore's own gradients are wrong, and the test that pins it."""

    name: str
    applies: Callable[[Case], bool]
    fixed: Callable[[Knobs], Knobs]
    test: str


STOCK_DEFECTS: tuple[StockDefect, ...] = (
    # Tied heads on the last pipeline stage with MTP: the output layer's fused wgrad sets
    # ``grad_added_to_main_grad`` on the shared word-embedding weight, which mcore marks
    # ``zero_out_wgrad`` only at PP = 1; DDP's hook then drops ``.grad``, i.e. the MTP layers'
    # embedding lookups' gradient.
    StockDefect(
        "tied heads x gradient-accumulation fusion x PP > 1",
        lambda case: case.tied and case.fusion and not case.detach_encoder,
        lambda knobs: dataclasses.replace(knobs, fusion=False, defer=False),
        "test_stock_drops_the_mtp_embedding_lookup_gradient_with_tied_heads_and_fusion",
    ),
    # Each stock training forward calls the output layer N + 1 times (MTP depths, then the main
    # head), appending N + 1 activations in forward order; backward appends the gradients in the
    # reverse order, and mcore's drain pairs them index by index.
    StockDefect(
        "defer_embedding_wgrad_compute x MTP: pairing",
        lambda case: case.defer,
        lambda knobs: dataclasses.replace(knobs, defer=False),
        "test_stock_pairs_deferred_activations_with_gradients_in_the_wrong_order",
    ),
    # The schedule drains into ``output_layer.weight`` with tied heads, else into
    # ``shared_embedding_or_output_weight()``; on the MTP stage the latter is the word-embedding
    # weight (untied: the head's gradient lands there) and the tied head is called with that weight
    # (``output_layer.weight`` there is unused: the drained gradient lands on a parameter no
    # forward used).
    StockDefect(
        "defer_embedding_wgrad_compute x MTP: drain target",
        lambda case: case.defer,
        lambda knobs: dataclasses.replace(knobs, defer=False),
        "test_stock_drains_the_deferred_head_gradient_into_the_embedding_weight",
    ),
)


def grad_reference(name: str, case: Case) -> str:
    """Which stock gradient parameter ``name`` must equal under the case's detach flags: ``"full"``
    (stock with MTP) or ``"main"`` (stock with the MTP loss weighted 0).

    ``detach_encoder`` keeps the MTP loss out of everything but the MTP layers and the head;
    ``detach_head`` keeps it out of the output weight (tied: the word embeddings, see ``allowed``).
    """
    if name.startswith("mtp."):
        return "full"
    head = name == "output_layer.weight" or (case.tied and name == "embedding.word_embeddings.weight")
    if head and case.tied:
        return "main" if case.detach_encoder and case.detach_head else "full"
    if head:
        return "main" if case.detach_head else "full"
    return "main" if case.detach_encoder else "full"

