"""The architectures users run, as verl's model bridge builds them, side by side with stock mcore.

DeepSeek-V3 (MLA, YaRN, sigmoid router with expert bias, dense-then-MoE layers, MoE MTP layers),
GLM-4.5 (GQA, qk-layernorm, qkv bias, partial RoPE, sigmoid router with expert bias) and
MiMo (dense Qwen2 with MTP): configs from ``mbridge`` 0.15.1 over transformers' own config
classes, scaled down in size only, built with mcore's local specs (``tests/support/bridge_models.py``).
Stock mcore, called with labels, is the reference: main logits bit-equal, per-depth MTP losses,
every parameter's gradient (routers and experts included). Neither MoE bridge turns on an
auxiliary loss (DeepSeek-V3: load balancing ``none``; GLM-4.5: ``seq_aux_loss`` at mcore's
coefficient 0), so mcore's MoE tracker stays empty here (``test_deepseek_style`` covers it).

The bridge breakages ``tests/support/bridge_models.py`` works around are pinned at the end: each of those
tests fails once the bridge fixes its breakage, so an upgrade gets noticed and the workaround
dropped. Needs ``requirements/bridges.txt`` (``make bridges-env``); skipped without it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from mtp_hooks.testing import assert_same_mtp_losses, build_twins, grads_of, make_batch, output_layer_calls, stock_train_step
from tests.support.bridge_models import BRIDGES_MISSING, FAMILIES, MOE_FAMILIES, BridgeModel, assert_routers_and_experts_trained
from tests.support.bridge_models import hf_config, make_bridge, without_mtp_copy
from tests.support.mcore_moe import moe_on_cpu  # noqa: F401 (autouse: MoE and MLA on CPU, an empty MoE tracker)
from tests.support.micro_batches import mtp_block_calls
from tests.support.probes import assert_training_forward_counts_more_flops, counted_flops, hooked_with_reference

pytestmark = [
    pytest.mark.skipif(BRIDGES_MISSING is not None, reason=str(BRIDGES_MISSING)),
    pytest.mark.usefixtures("one_intra_op_thread"),
]

VOCAB = 64
SEQ = 16
# How a Transformer Engine spec fails without it: an undefined TE name (up to 0.16), a None class (0.17+).
TRANSFORMER_ENGINE_MISSING = r"name 'TE\w+' is not defined|'NoneType' object is not callable"



def batches() -> list[Any]:
    return [make_batch(VOCAB, batch=2, seq=SEQ, mask=mask, seed=i) for i, mask in enumerate(("random", "ones"))]


# ------------------------------------------------------------------------------- the bridge's model


@pytest.mark.parametrize("family", FAMILIES)
def test_bridge_config_carries_the_published_switches(family: str) -> None:
    """The switches of the real model reach mcore's config; the CPU overrides change nothing else."""
    config = make_bridge(family).config
    assert config.mtp_num_layers == 1 and config.normalization == "RMSNorm" and config.gated_linear_unit
    assert config.params_dtype == torch.float32 and not config.bf16
    if family == "deepseek_v3":
        assert type(config).__name__ == "MLATransformerConfig" and config.multi_latent_attention
        assert (config.rope_type, config.rotary_scaling_factor, config.original_max_position_embeddings) == ("yarn", 40, 4096)
        assert config.qk_layernorm and (config.q_lora_rank, config.kv_lora_rank, config.v_head_dim) == (24, 16, 8)
        assert config.moe_router_load_balancing_type == "none"
    if family == "glm4_moe":
        assert config.qk_layernorm and config.add_qkv_bias and not config.add_bias_linear
        assert (config.num_query_groups, config.kv_channels) == (2, 16)
        assert config.moe_router_load_balancing_type == "seq_aux_loss" and config.moe_aux_loss_coeff == 0
    if family in MOE_FAMILIES:
        assert config.moe_layer_freq == [0, 1]  # first_k_dense_replace = 1
        assert config.moe_router_score_function == "sigmoid" and config.moe_router_enable_expert_bias
        assert config.moe_router_pre_softmax and config.moe_router_topk_scaling_factor == 2.5
        assert (config.num_moe_experts, config.moe_router_topk, config.moe_shared_expert_intermediate_size) == (4, 2, 16)
        assert not config.moe_grouped_gemm and config.moe_token_dispatcher_type == "allgather"
    if family == "mimo":
        assert config.add_qkv_bias and not config.qk_layernorm and config.num_moe_experts is None


@pytest.mark.parametrize("family", FAMILIES)
def test_bridge_model_builds_the_families_layers(family: str) -> None:
    """Decoder and MTP layers are the family's (MLA or GQA, MoE with shared expert); untied as published."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    shape = BridgeModel(family)
    model = shape.build()
    assert not hf_config(family).tie_word_embeddings and not shape.tied
    assert not model.share_embeddings_and_output_weights
    kinds = {type(module) for module in model.modules()}
    assert (MLASelfAttention in kinds) == (family == "deepseek_v3")
    assert ({SequentialMLP, SharedExpertMLP, TopKRouter} <= kinds) == (family in MOE_FAMILIES)
    mtp_kinds = {type(module) for module in model.mtp.modules()}
    assert (TopKRouter in mtp_kinds) == (family in MOE_FAMILIES)
    if family == "glm4_moe":
        assert model.rotary_pos_emb.inv_freq.numel() * 2 == 16 // 2  # partial RoPE: half of head_dim 16


# ------------------------------------------------------------------------------- training


@pytest.mark.parametrize("loss_impl", ["lean", "dense"])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_training_micro_batches_match_stock(family: str, depth: int, loss_impl: str) -> None:
    """Two micro-batches: logits bit-equal, MTP losses and every gradient (routers, experts) equal stock."""
    twins = build_twins(BridgeModel(family, depth), seed=3, loss_impl=loss_impl)
    for batch in batches():
        stock = stock_train_step(twins.stock, batch)
        logits = twins.hooked_step(batch)
        assert torch.equal(logits, stock.logits)
        assert twins.hooks is not None
        assert_same_mtp_losses(twins.hooks.metrics(), stock.mtp_losses)
        assert len(stock.mtp_losses) == depth
    twins.assert_same_grads()
    assert_routers_and_experts_trained(twins.hooked, family)


def group_of(name: str) -> str:
    """``mtp``, ``head`` (the untied output layer) or ``trunk`` (decoder and embedding)."""
    if name.startswith("mtp."):
        return "mtp"
    return "head" if name.startswith("output_layer.") else "trunk"


@pytest.mark.parametrize("loss_impl", ["lean", "dense"])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_detach_encoder_keeps_the_mtp_loss_out_of_decoder_and_embedding(family: str, depth: int, loss_impl: str) -> None:
    """With ``detach_encoder``: logits and MTP losses are stock's, MTP layers and head train as in stock,
    and the decoder and embedding get the gradient of the same model without MTP layers.

    The "without MTP" reference is the family built with no MTP layers holding the same weights
    (not stock with the MTP loss weighted 0, through which an MTP router's auxiliary loss, were a
    bridge to set one, would still reach the trunk).
    """
    shape = BridgeModel(family, depth)
    twins = build_twins(shape, seed=5, loss_impl=loss_impl, detach_encoder=True)
    without_mtp = without_mtp_copy(twins.stock, shape)
    for batch in batches():
        stock = stock_train_step(twins.stock, batch)
        stock_train_step(without_mtp, batch)
        assert torch.equal(twins.hooked_step(batch), stock.logits)
        assert twins.hooks is not None
        assert_same_mtp_losses(twins.hooks.metrics(), stock.mtp_losses)
    with_mtp, trunk_only, ours = grads_of(twins.stock), grads_of(without_mtp), grads_of(twins.hooked)
    reaches_trunk = False
    for name, grad in ours.items():
        expected = trunk_only[name] if group_of(name) == "trunk" else with_mtp[name]
        if expected is None:
            assert grad is None or not grad.any(), name
            continue
        assert grad is not None, name
        torch.testing.assert_close(grad, expected, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        if group_of(name) == "trunk" and with_mtp[name] is not None:
            reaches_trunk = reaches_trunk or not torch.allclose(with_mtp[name], grad, atol=1e-6, rtol=1e-5)
    assert reaches_trunk, "stock's MTP loss reaches no trunk parameter: the check cannot fail"
    assert_routers_and_experts_trained(twins.hooked, family)


# ------------------------------------------------------------------------------- inference


@pytest.mark.parametrize("with_labels", [False, True], ids=["no_labels", "labels_under_no_grad"])
@pytest.mark.parametrize("family", FAMILIES)
def test_inference_flops_equal_the_model_without_mtp_layers(family: str, with_labels: bool) -> None:
    """An inference forward does exactly the FLOPs of the same model without MTP layers, with its logits."""
    model, hooks, reference, batch = hooked_with_reference(BridgeModel(family, 2), without_mtp_copy, VOCAB, SEQ, seed=6)

    with torch.no_grad():
        expected_flops, expected_logits = counted_flops(lambda: reference(*batch.model_args))
        with mtp_block_calls(model) as calls:
            if with_labels:
                with hooks.micro_batch(batch.labels, batch.loss_mask):
                    flops, logits = counted_flops(lambda: model(*batch.model_args))
            else:
                flops, logits = counted_flops(lambda: model(*batch.model_args))
    assert calls == [] and hooks.metrics() == {}
    assert torch.equal(logits, expected_logits)
    assert flops == expected_flops > 0
    assert_training_forward_counts_more_flops(hooks, model, batch, flops)


@pytest.mark.parametrize("family", FAMILIES)
def test_inference_micro_batches_between_training_ones_leave_training_as_stock(family: str) -> None:
    """train, infer (no_grad with labels), infer (grad on, no labels), train == stock's two training steps.

    The inference forwards return stock's main logits, run no MTP layer and leave no metric.
    """
    twins = build_twins(BridgeModel(family, 1), seed=7)
    assert twins.hooks is not None
    train_a, infer, train_b = (make_batch(VOCAB, batch=2, seq=SEQ, seed=s) for s in (1, 2, 3))
    stock_a, stock_b = stock_train_step(twins.stock, train_a), stock_train_step(twins.stock, train_b)
    with output_layer_calls(twins.stock) as calls, torch.no_grad():
        twins.stock(*infer.model_args, labels=infer.labels, loss_mask=infer.loss_mask)
    stock_infer_logits = calls[-1].transpose(0, 1)

    twins.hooked_step(train_a)
    metrics_a = twins.hooks.metrics()
    with mtp_block_calls(twins.hooked) as mtp_calls:
        with torch.no_grad(), twins.hooks.micro_batch(infer.labels, infer.loss_mask):
            no_grad_logits = twins.hooked(*infer.model_args)
        grad_logits = twins.hooked(*infer.model_args)
    assert mtp_calls == [] and twins.hooks.metrics() == {}
    assert grad_logits.requires_grad
    assert torch.equal(no_grad_logits, stock_infer_logits) and torch.equal(grad_logits.detach(), stock_infer_logits)
    del grad_logits
    twins.hooked_step(train_b)
    assert_same_mtp_losses(metrics_a, stock_a.mtp_losses)
    assert_same_mtp_losses(twins.hooks.metrics(), stock_b.mtp_losses)
    twins.assert_same_grads()
    assert_routers_and_experts_trained(twins.hooked, family)


# ------------------------------------------------------------------------------- pinned bridge breakages
# Each test asserts that a breakage worked around in tests/support/bridge_models.py still happens. When one
# fails after an upgrade, the bridge fixed it: drop the workaround and this test.


def test_deepseek_v3_bridge_still_passes_max_position_embeddings_to_mla_config() -> None:
    """Workaround 1: mcore 0.14+ names the field ``original_max_position_embeddings``; mbridge 0.15.1
    passes ``max_position_embeddings``, so the stock bridge cannot build DeepSeek-V3's config."""
    from mbridge import AutoBridge
    from megatron.core.transformer import MLATransformerConfig

    fields = {field.name for field in dataclasses.fields(MLATransformerConfig)}
    assert "original_max_position_embeddings" in fields and "max_position_embeddings" not in fields
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_position_embeddings'"):
        AutoBridge.from_config(hf_config("deepseek_v3"), dtype=torch.float32)


def test_glm4_moe_bridge_still_leaves_mtp_num_layers_unset() -> None:
    """Workaround 2: GLM-4.5 publishes ``num_nextn_predict_layers``; the bridge maps MTP weights but
    never sets ``mtp_num_layers``, so the stock bridge builds GLM-4.5 without MTP layers."""
    from mbridge import AutoBridge

    config = hf_config("glm4_moe", depth=1)
    assert config.num_nextn_predict_layers == 1
    assert AutoBridge.from_config(config, dtype=torch.float32).config.mtp_num_layers is None


def test_mimo_bridge_gptmodel_args_still_build_a_transformer_engine_mtp_spec() -> None:
    """Workaround 3: ``MimoBridge._get_gptmodel_args`` builds its MTP spec with Transformer Engine
    (and from the config in place of a layer spec); without Transformer Engine it raises."""
    bridge = make_bridge("mimo")
    with pytest.raises((NameError, TypeError), match=TRANSFORMER_ENGINE_MISSING):
        bridge._get_gptmodel_args()


@pytest.mark.parametrize("family", FAMILIES)
def test_bridge_layer_spec_still_needs_transformer_engine(family: str) -> None:
    """Why the models are built from mcore's local specs: the bridges' own layer spec is
    Transformer Engine's (``use_transformer_engine=True``) and fails without it."""
    bridge = make_bridge(family)
    with pytest.raises((NameError, TypeError), match=TRANSFORMER_ENGINE_MISSING):
        bridge._get_transformer_layer_spec()
