"""DeepSeek-V3, GLM-4.5 and MiMo as megatron-bridge 0.6.2 provides them, side by side with stock mcore.

The optional job on Python 3.12 / megatron-core 0.19.2 (``make test-megatron-bridge``): the same
families as ``tests/integrations/test_bridges.py``, their configs and models from megatron-bridge's providers
(``provide()``) with the stand-ins of ``tests/support/megatron_bridge_models.py``. Stock mcore is the
reference: main logits bit-equal, per-depth MTP losses, every gradient; inference does the FLOPs
of the same model without MTP layers. The stand-ins are pinned at the end: each of those tests
fails once megatron-bridge no longer needs it. Skipped without megatron-bridge.
"""

from __future__ import annotations

import ast
import importlib.util

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mtp_hooks.testing import assert_same_mtp_losses, build_twins, grads_of, make_batch, stock_train_step
from tests.support.bridge_models import FAMILIES, MOE_FAMILIES, assert_routers_and_experts_trained, without_mtp_copy
from tests.support.mcore_moe import moe_on_cpu  # noqa: F401 (autouse: MoE and MLA on CPU, an empty MoE tracker)
from tests.support.micro_batches import mtp_block_calls
from tests.support.megatron_bridge_models import MEGATRON_BRIDGE_MISSING, ProvidedModel, make_provider
from tests.support.probes import hooked_with_reference

pytestmark = [
    pytest.mark.skipif(MEGATRON_BRIDGE_MISSING is not None, reason=str(MEGATRON_BRIDGE_MISSING)),
    pytest.mark.usefixtures("one_intra_op_thread"),
]

VOCAB = 64
SEQ = 16



def batches() -> list:
    return [make_batch(VOCAB, batch=2, seq=SEQ, mask=mask, seed=i) for i, mask in enumerate(("random", "ones"))]


@pytest.mark.parametrize("family", FAMILIES)
def test_provider_carries_the_published_switches(family: str) -> None:
    provider = make_provider(family)
    assert provider.mtp_num_layers == 1 and not provider.share_embeddings_and_output_weights
    if family == "deepseek_v3":
        assert type(provider).__name__ == "MLAModelProvider" and provider.rope_type == "yarn" and provider.qk_layernorm
    if family == "glm4_moe":
        assert provider.qk_layernorm and provider.add_qkv_bias and provider.rotary_percent == 0.5
    if family in MOE_FAMILIES:
        assert provider.moe_layer_freq == [0, 1] and provider.moe_router_score_function == "sigmoid"
        assert provider.moe_router_enable_expert_bias and not provider.moe_grouped_gemm
    if family == "mimo":
        assert provider.add_qkv_bias and provider.num_moe_experts is None


@pytest.mark.parametrize("loss_impl", ["lean", "dense"])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_training_micro_batches_match_stock(family: str, depth: int, loss_impl: str) -> None:
    twins = build_twins(ProvidedModel(family, depth), seed=3, loss_impl=loss_impl)
    assert twins.hooks is not None
    for batch in batches():
        stock = stock_train_step(twins.stock, batch)
        assert torch.equal(twins.hooked_step(batch), stock.logits)
        assert_same_mtp_losses(twins.hooks.metrics(), stock.mtp_losses)
        assert len(stock.mtp_losses) == depth
    twins.assert_same_grads()
    assert_routers_and_experts_trained(twins.hooked, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_detach_encoder_keeps_the_mtp_loss_out_of_decoder_and_embedding(family: str) -> None:
    """As in ``test_bridges``: trunk gradients are those of the model without MTP layers, the rest stock's."""
    shape = ProvidedModel(family, 2)
    twins = build_twins(shape, seed=5, detach_encoder=True)
    assert twins.hooks is not None
    without_mtp = without_mtp_copy(twins.stock, shape)
    for batch in batches():
        stock = stock_train_step(twins.stock, batch)
        stock_train_step(without_mtp, batch)
        assert torch.equal(twins.hooked_step(batch), stock.logits)
        assert_same_mtp_losses(twins.hooks.metrics(), stock.mtp_losses)
    with_mtp, trunk_only = grads_of(twins.stock), grads_of(without_mtp)
    differs = False
    for name, grad in grads_of(twins.hooked).items():
        trunk = not name.startswith(("mtp.", "output_layer."))
        expected = trunk_only[name] if trunk else with_mtp[name]
        assert grad is not None and expected is not None, name
        torch.testing.assert_close(grad, expected, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        differs = differs or (trunk and not torch.allclose(with_mtp[name], grad, atol=1e-6, rtol=1e-5))
    assert differs, "stock's MTP loss reaches no trunk parameter: the check cannot fail"


@pytest.mark.parametrize("family", FAMILIES)
def test_inference_flops_equal_the_model_without_mtp_layers(family: str) -> None:
    model, hooks, reference, batch = hooked_with_reference(ProvidedModel(family, 2), without_mtp_copy, VOCAB, SEQ, seed=6)
    with torch.no_grad():
        with FlopCounterMode(display=False) as expected:
            expected_logits = reference(*batch.model_args)
        with mtp_block_calls(model) as calls, FlopCounterMode(display=False) as counted:
            logits = model(*batch.model_args)
    assert calls == [] and hooks.metrics() == {}
    assert torch.equal(logits, expected_logits)
    assert counted.get_total_flops() == expected.get_total_flops() > 0


# ------------------------------------------------------------------------------- pinned stand-ins
# Each asserts that megatron-bridge still needs a stand-in of tests/support/megatron_bridge_models.py.


def test_megatron_bridge_still_imports_transformer_engine_unconditionally() -> None:
    """Stand-in 1: ``peft/lora_layers.py`` imports ``transformer_engine.pytorch`` at module level."""
    spec = importlib.util.find_spec("megatron.bridge.peft.lora_layers")
    assert spec is not None and spec.origin is not None
    with open(spec.origin) as source:
        tree = ast.parse(source.read())
    top_level = [alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names]
    assert "transformer_engine.pytorch" in top_level


@pytest.mark.parametrize("family", FAMILIES)
def test_shipped_mtp_block_spec_still_needs_transformer_engine(family: str) -> None:
    """Stand-in 2: ``gpt_provider.mtp_block_spec`` builds the MTP block with Transformer Engine."""
    from megatron.bridge.models import gpt_provider

    provider = ProvidedModel(family).provider()  # local decoder spec; the shipped MTP spec
    with pytest.raises(TypeError, match="'NoneType' object is not callable"):
        gpt_provider.mtp_block_spec(provider)


def test_mimo_provider_still_uses_the_transformer_engine_layer_spec() -> None:
    """Stand-in 3: MiMo's (Qwen2's) provider keeps ``default_layer_spec``, Transformer Engine's."""
    from megatron.bridge.models import gpt_provider

    provider = make_provider("mimo")
    assert provider.transformer_layer_spec is gpt_provider.default_layer_spec
    with pytest.raises(TypeError, match="'NoneType' object is not callable"):
        provider.transformer_layer_spec(provider)
