"""The proof of MLA's derived tensors, on both CPU backends, whichever one this machine's vLLM picks.

vLLM picks ``AMX_MLA`` on a CPU with AMX and ``CPU_MLA`` (the generic derivation GPUs share) elsewhere,
so ``make test-engine`` pushes through one of them. Here each backend's own derivation code runs on
tensors, without an engine: vLLM's ``MLAAttention.process_weights_after_loading`` (generic: ``W_UK_T`` /
``W_UV``) and ``AMXMLAImpl.process_weights_after_loading`` (VNNI-packed, with vLLM's CPU op) derive from
a ``kv_b_proj``, and ``mtp_hooks.engine.derived.prove_mla`` must find exactly those tensors from the
same weight and refuse them for another one. Neither path can rot unseen on a machine that runs the other.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn

from mtp_hooks.engine.derived import mla_backends, prove_mla

LORA, HEADS, NOPE, V = 512, 2, 64, 64  # the sizes vLLM's CPU MLA kernels take


class _Linear(nn.Module):
    """What vLLM's derivations read of ``kv_b_proj``: an unquantized weight ``[heads * (nope + v), lora]``."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.quant_method = None


class _Impl(nn.Module):
    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        pass


class _Attention(nn.Module):
    """The attributes vLLM's ``MLAAttention.process_weights_after_loading`` reads on its way to the generic
    derivation (no AMX, no DCP, no quantization)."""

    is_amx_bmm_enabled = False
    dcp_q_replicate = False
    is_aiter_triton_fp4_bmm_enabled = False
    is_aiter_triton_fp8_bmm_enabled = False
    quant_config = None
    layer_name = "model.layers.2.mtp_block.self_attn.mla_attn"

    def __init__(self, kv_b_proj: torch.Tensor, impl: nn.Module) -> None:
        super().__init__()
        self.kv_b_proj = _Linear(kv_b_proj)
        self.impl = impl
        self.kv_lora_rank, self.num_heads, self.qk_nope_head_dim, self.v_head_dim = LORA, HEADS, NOPE, V
        for name in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"):
            setattr(self, name, torch.ones(()))


def _weight(seed: int) -> torch.Tensor:
    return torch.randn(HEADS * (NOPE + V), LORA, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _generic(weight: torch.Tensor) -> _Attention:
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    attention = _Attention(weight, _Impl())
    try:
        MLAAttention.process_weights_after_loading(attention, torch.bfloat16)
    except AttributeError as missing:
        pytest.fail(f"vLLM's MLAAttention.process_weights_after_loading reads more than this test gives it: {missing}")
    return attention


def _amx(weight: torch.Tensor) -> _Attention:
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLAImpl

    attention = _Attention(weight, _Impl())
    impl = attention.impl
    impl.kv_b_proj, impl.kv_lora_rank, impl.num_heads, impl.qk_nope_head_dim, impl.v_head_dim = attention.kv_b_proj, LORA, HEADS, NOPE, V
    AMXMLAImpl.process_weights_after_loading(impl, torch.bfloat16)
    return attention


@pytest.mark.parametrize("derive, backend", [(_generic, "generic"), (_amx, "amx")], ids=["generic", "amx"])
def test_prove_mla_accepts_what_vllm_derived_and_refuses_another_weights(derive: Callable[[torch.Tensor], nn.Module], backend: str) -> None:
    weight = _weight(0)
    attention = derive(weight)
    assert mla_backends(attention) == [backend]
    assert prove_mla("layer", attention, weight) == []
    assert prove_mla("layer", attention, weight.float()) == []  # an fp32 trainer's tensor, cast as the engine casts it
    other = prove_mla("layer", attention, _weight(1))
    assert [m.tensor for m in other] == (["W_UK_T", "W_UV"] if backend == "generic" else ["impl._w_uk_packed", "impl._w_uv_packed"])


def test_an_mla_module_with_no_known_derivation_is_refused() -> None:
    attention = _Attention(_weight(0), _Impl())
    (found,) = prove_mla("layer", attention, _weight(0))
    assert found.tensor == "*" and "not known here (_Impl)" in found.reason
