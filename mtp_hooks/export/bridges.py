"""The bridges' MTP export, checked against ``mtp_hf_weights`` and replaced in a weight stream.

The bridges (mbridge for verl, megatron-bridge for NeMo-RL) export the whole model, MTP layers
included. Their MTP mapping has known defects (mbridge 0.15.1), each of which leaves the engine a
draft other than the one trained:

* MiMo: ``eh_proj`` exported as ``input_proj`` without swapping its halves (HF and vLLM compute
  ``cat(hidden, embedding)``, mcore ``cat(embedding, hidden)``): a perfect draft is accepted 0.000;
* DeepSeek-V3: the MTP mapping is written for 61 decoder layers (``model.layers.61.*``; it asserts
  otherwise);
* GLM-4.5: every MTP layer's ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm`` go to
  ``model.layers.{L}``, so layer 1's overwrite layer 0's.

``check_bridge_export`` names the first MTP tensor of a bridge's pairs that is missing, extra,
repeated, under another name or different, and which known defect it is. ``replace_mtp_weights``
passes a weight stream through without its MTP pairs and appends ours.
"""

from __future__ import annotations

import re
from types import MappingProxyType
from typing import Iterable, Iterator, Mapping, Optional, Union

import torch
from torch import Tensor

from mtp_hooks.errors import MTPHooksError
from mtp_hooks.export.convert import swap_halves
from mtp_hooks.export.layouts import Layout, layout_named
from mtp_hooks.export.weights import Model, _language_models, mtp_hf_weights

__all__ = ["BridgeExportError", "check_bridge_export", "replace_mtp_weights"]

# The main model's weights a bridge may also write under an MTP layer's names (DeepSeek-V3's
# per-layer copies of the embedding and head): not MTP tensors, the bridge's own to check.
SHARED_LEAVES = ("embed_tokens.weight", "shared_head.head.weight")

KNOWN_DEFECTS: Mapping[str, str] = MappingProxyType({
    "swapped": "the input projection's halves are not swapped: MiMo's input_proj reads cat(hidden, embedding), "
    "mcore's eh_proj cat(embedding, hidden) (mbridge 0.15.1's MiMo export)",
    "61": "the MTP layer is written as decoder layer 61 whatever the model's layer count "
    "(mbridge 0.15.1's DeepSeek-V3 mapping, written for DeepSeek-V3's 61 layers)",
    "same": "every MTP layer is written under the first MTP layer's names (mbridge 0.15.1's GLM-4.5 mapping)",
})


class BridgeExportError(MTPHooksError):
    """A bridge's MTP tensors are not the model's: ``kind`` is ``"missing"``, ``"extra"``,
    ``"repeated"``, ``"misnamed"`` or ``"different"``, ``name`` the first such HF name, ``defect``
    the known bridge defect it matches (a key of ``KNOWN_DEFECTS``) or ``None``."""

    def __init__(self, kind: str, name: str, expected: str, received: str, defect: Optional[str] = None) -> None:
        self.kind, self.name, self.defect = kind, name, defect
        known = f"\n  known defect: {KNOWN_DEFECTS[defect]}" if defect else ""
        super().__init__(
            f"pairs_from_bridge: MTP tensor {name!r} is {kind}\n  expected: {expected}\n  received: {received}{known}"
        )


def _layer_number(name: str) -> Optional[int]:
    found = re.match(r"^model\.layers\.(\d+)\.", name)
    return int(found.group(1)) if found else None


def _renumbered(name: str, number: int) -> str:
    return re.sub(r"^model\.layers\.\d+\.", f"model.layers.{number}.", name)


def _equal(ours: Tensor, theirs: Tensor, atol: float, rtol: float) -> bool:
    if ours.shape != theirs.shape:
        return False
    return bool(torch.allclose(ours.to(theirs.device, theirs.dtype), theirs, atol=atol, rtol=rtol))


def _bridge_mtp_pairs(
    pairs: Iterable[tuple[str, Tensor]], layout: Layout, num_layers: int, depth: int
) -> dict[str, Tensor]:
    """The bridge's MTP pairs by name. A name written twice raises: the GLM-4.5 defect when it is
    the first MTP layer's and the model has more than one."""
    theirs: dict[str, Tensor] = {}
    for name, tensor in pairs:
        layer = layout.mtp_layer_of(name, num_layers)
        if layer is None or name.endswith(SHARED_LEAVES):
            continue
        if name in theirs:
            defect = "same" if layer == 0 and depth > 1 else None
            raise BridgeExportError("repeated", name, "each MTP tensor once", "two tensors under this name", defect)
        theirs[name] = tensor.detach()
    return theirs


def _same_leaf(ours: str, theirs: str) -> bool:
    number = _layer_number(ours)
    return number is not None and _renumbered(theirs, number) == ours


def check_bridge_export(
    pairs_from_bridge: Iterable[tuple[str, Tensor]],
    model: Model,
    layout: Union[str, Layout],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> int:
    """Check a bridge's export against ``mtp_hf_weights(model, layout)``; return the MTP tensors checked.

    Args:
        pairs_from_bridge: the bridge's ``(hf_name, tensor)`` pairs, the whole model's or the MTP
            layers' only (names outside the layout's MTP range are skipped, as are the main
            model's embedding and head under MTP names: ``SHARED_LEAVES``).
        model, layout: as for ``mtp_hf_weights`` (collective: every rank calls it).
        atol, rtol: value tolerance (default exact, after casting ours to the bridge's dtype).

    Raises:
        BridgeExportError: naming the first MTP tensor, in our order, that the bridge leaves out,
        writes under another name, writes twice or with other values, then the first it writes
        that we do not; with the known bridge defect it matches, if any.
    """
    found = layout_named(layout)
    config = _language_models(model)[0].config
    num_layers = config.num_layers
    ours = dict(mtp_hf_weights(model, found))  # consumed in full first: it is collective
    theirs = _bridge_mtp_pairs(pairs_from_bridge, found, num_layers, config.mtp_num_layers)
    unclaimed = [name for name in theirs if name not in ours]
    for name, tensor in ours.items():
        if name not in theirs:
            equal = sorted(
                (other for other in unclaimed if _equal(tensor, theirs[other], atol, rtol)),
                key=lambda other: not _same_leaf(name, other),
            )
            if not equal:
                received = "none, and no equal tensor under another MTP name"
                raise BridgeExportError("missing", name, "a tensor under this name", received)
            elsewhere = equal[0]
            defect = "61" if _layer_number(elsewhere) == 61 and _same_leaf(name, elsewhere) else None
            raise BridgeExportError("misnamed", name, f"{name!r}", f"this tensor under {elsewhere!r}", defect)
        other = theirs[name]
        if not _equal(tensor, other, atol, rtol):
            swapped = tensor.dim() == 2 and _equal(swap_halves(tensor), other, atol, rtol)
            defect = "swapped" if swapped and found.swap_input_halves else None
            received = f"shape {tuple(other.shape)}, max |difference| {_difference(tensor, other)}"
            expected = f"shape {tuple(tensor.shape)} with the model's values"
            raise BridgeExportError("different", name, expected, received, defect)
    if unclaimed:
        received = f"{len(unclaimed)} MTP names the model has no tensor for"
        raise BridgeExportError("extra", unclaimed[0], "only the model's MTP tensors", received)
    return len(ours)


def _difference(ours: Tensor, theirs: Tensor) -> str:
    if ours.shape != theirs.shape:
        return "n/a (shapes differ)"
    return f"{(ours.to(theirs.device, torch.float64) - theirs.double()).abs().max().item():.3g}"


def replace_mtp_weights(
    pairs: Iterable[tuple[str, Tensor]], model: Model, layout: Union[str, Layout], *, all_stages: bool = True
) -> Iterator[tuple[str, Tensor]]:
    """A bridge's weight stream with its MTP pairs dropped and ``mtp_hf_weights``'s appended.

    ``pairs`` (verl's ``per_tensor_generator``, a bridge's ``export_weights``) pass through unchanged
    except names in the layout's MTP range (``model.layers.{k >= L}.*`` or ``model.mtp_layers.*``),
    which are dropped; after the last of them come ``mtp_hf_weights(model, layout,
    all_stages=all_stages)``. Like both, every rank must consume it to the end. A bridge whose MTP
    mapping raises while it exports (mbridge 0.15.1's DeepSeek-V3 below 61 layers) raises here too.

    Example::

        weights = replace_mtp_weights(per_tensor_generator(...), model, "mimo")
        engine_model.load_weights(weights)
    """
    found = layout_named(layout)
    num_layers = _language_models(model)[0].config.num_layers
    ours = mtp_hf_weights(model, found, all_stages=all_stages)  # checked now, run after the stream
    return _replaced(pairs, ours, found, num_layers)


def _replaced(
    pairs: Iterable[tuple[str, Tensor]], ours: Iterator[tuple[str, Tensor]], layout: Layout, num_layers: int
) -> Iterator[tuple[str, Tensor]]:
    for name, tensor in pairs:
        if layout.mtp_layer_of(name, num_layers) is None:
            yield name, tensor
    yield from ours
