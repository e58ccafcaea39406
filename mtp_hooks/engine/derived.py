"""What vLLM derives from the loaded weights, per attention backend, and the proof that a push re-derived it.

An MLA layer (DeepSeek-V3's attention) computes with tensors vLLM derives from ``kv_b_proj`` after
loading; a push that reloads ``kv_b_proj`` but not them leaves a stale draft whose parameters look
right. Which tensors, and how, depends on the backend vLLM picked for the machine:

* ``"generic"`` (vLLM's ``CPU_MLA`` on a CPU without AMX, and the GPU backends): the parameters
  ``W_UK_T = W_UK.permute(1, 2, 0)`` and ``W_UV = W_UV.transpose(0, 1)``, where ``kv_b_proj.weight.T``
  viewed as ``[kv_lora_rank, heads, qk_nope + v]`` splits into ``W_UK`` and ``W_UV``;
* ``"amx"`` (``AMX_MLA``, a CPU with AMX): the impl's VNNI-packed ``_w_uk_packed`` / ``_w_uv_packed``,
  ``convert_weight_packed`` of ``W_UK.permute(1, 0, 2)`` and ``W_UV.permute(1, 2, 0)``; vLLM then
  releases ``kv_b_proj.weight``.

``expected_mla`` re-derives them from the pushed ``kv_b_proj`` (cast to the engine's dtype) and
``prove_mla`` compares them, bit for bit, with what the engine holds after the push; ``prove_pushed`` does
it for every MLA layer whose ``kv_b_proj`` a push wrote.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from mtp_hooks.engine.ledger import Write

__all__ = ["MLA_BACKENDS", "DerivedMismatch", "expected_mla", "is_mla", "mla_backends", "prove_mla", "prove_pushed"]

MLA_BACKENDS = ("generic", "amx")
_PLACES = {"generic": ("W_UK_T", "W_UV"), "amx": ("impl._w_uk_packed", "impl._w_uv_packed")}


@dataclasses.dataclass(frozen=True)
class DerivedMismatch:
    """A derived tensor the engine holds that is not what its pushed source gives."""

    layer: str
    tensor: str
    reason: str


def mla_backends(attention: nn.Module) -> list[str]:
    """The derivations an MLA attention module holds (empty: not an MLA module, or an unknown backend)."""
    if not hasattr(attention, "kv_b_proj") or not hasattr(attention, "kv_lora_rank"):
        return []
    found = []
    if isinstance(getattr(attention, "W_UK_T", None), Tensor) and isinstance(getattr(attention, "W_UV", None), Tensor):
        found.append("generic")
    if isinstance(getattr(getattr(attention, "impl", None), "_w_uk_packed", None), Tensor):
        found.append("amx")
    return found


def is_mla(attention: nn.Module) -> bool:
    """vLLM's MLA attention layer (``MLAAttention``): the one that derives its runtime weights from ``kv_b_proj``."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    return isinstance(attention, MLAAttention)


def _split(kv_b_proj: Tensor, attention: Any) -> tuple[Tensor, Tensor]:
    heads, nope, v = attention.num_heads, attention.qk_nope_head_dim, attention.v_head_dim
    weight = kv_b_proj.T.reshape(attention.kv_lora_rank, heads, nope + v)
    w_uk, w_uv = weight.split([nope, v], dim=-1)
    return w_uk, w_uv


def expected_mla(backend: str, kv_b_proj: Tensor, attention: Any) -> dict[str, Tensor]:
    """The tensors ``backend`` derives from ``kv_b_proj`` (already in the engine's dtype), by their
    place on the attention module (``"W_UK_T"``, ``"impl._w_uk_packed"``, ...)."""
    w_uk, w_uv = _split(kv_b_proj, attention)
    if backend == "generic":
        return {"W_UK_T": w_uk.permute(1, 2, 0), "W_UV": w_uv.transpose(0, 1)}
    if backend == "amx":
        pack = torch.ops._C.convert_weight_packed
        return {
            "impl._w_uk_packed": pack(w_uk.permute(1, 0, 2).contiguous()),
            "impl._w_uv_packed": pack(w_uv.permute(1, 2, 0).contiguous()),
        }
    raise AssertionError(f"unknown MLA backend {backend!r}")


def _held(attention: nn.Module, place: str) -> Optional[Tensor]:
    owner: Any = attention
    for part in place.split(".")[:-1]:
        owner = getattr(owner, part, None)
    found = getattr(owner, place.split(".")[-1], None)
    return found if isinstance(found, Tensor) else None


def prove_mla(layer: str, attention: nn.Module, kv_b_proj: Tensor) -> list[DerivedMismatch]:
    """Compare what ``attention`` holds with what its backend derives from the pushed ``kv_b_proj``."""
    backends = mla_backends(attention)
    if not backends:
        impl = type(getattr(attention, "impl", None)).__name__
        return [
            DerivedMismatch(
                layer, "*", f"an MLA backend whose derived weights are not known here ({impl}); known: {MLA_BACKENDS}"
            )
        ]
    found = []
    for backend in backends:
        held_dtype = next(t.dtype for t in (_held(attention, p) for p in _PLACES[backend]) if t is not None)
        for place, expected in expected_mla(backend, kv_b_proj.to(held_dtype), attention).items():
            held = _held(attention, place)
            same = (
                held is not None
                and held.shape == expected.shape
                and torch.equal(held, expected.to(device=held.device, dtype=held.dtype))
            )
            if not same:
                found.append(
                    DerivedMismatch(layer, place, f"not derived from the pushed kv_b_proj ({backend} backend)")
                )
    return found


def prove_pushed(
    model: nn.Module, pairs: Sequence[tuple[str, Tensor]], writes: Sequence[Write]
) -> tuple[list[str], list[str]]:
    """Re-derive every MLA layer's runtime weights from its pushed ``kv_b_proj``: (backends, mismatches)."""
    tensors = dict(pairs)
    by_parameter = {w.parameter: w for w in writes}
    backends: list[str] = []
    mismatches: list[str] = []
    for prefix, module in model.named_modules():
        if not is_mla(module):
            continue
        owner = next((p for p, m in model.named_modules() if m is module.kv_b_proj), None)
        write = by_parameter.get(f"{owner}.weight") if owner is not None else None
        if write is None:
            continue
        backends += [b for b in mla_backends(module) if b not in backends]
        pushed = tensors[write.name].to(write.torch_dtype)
        mismatches += [f"{m.layer}.{m.tensor}: {m.reason}" for m in prove_mla(prefix, module, pushed)]
    return backends, mismatches
