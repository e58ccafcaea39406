"""``mtp_hooks.testing`` builds Qwen-style (GQA) and DeepSeek-style (MLA + MoE) models that train a
hooked micro-batch on CPU exactly as stock mcore does, and its attention handles grouped queries.

Twins from ``build_twins`` (same seed): stock gets labels and returns its per-token loss, the
hooked twin returns logits. Compared: main logits, per-depth MTP losses and every parameter's
gradient. ``SDPAttention`` with fewer key/value heads than query heads is checked against causal
softmax attention written out per head.
"""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

from mtp_hooks import testing
from tests.support.mcore_moe import reset_moe_process_state

VOCAB = 64
SEQ = 16


@pytest.fixture(autouse=True)
def moe_on_cpu() -> Iterator[None]:
    with testing.moe_mla_on_cpu():
        reset_moe_process_state()
        try:
            yield
        finally:
            reset_moe_process_state()


def assert_hooked_micro_batch_matches_stock(twins: testing.Twins, depth: int) -> None:
    batch = testing.make_batch(VOCAB, seq=SEQ, seed=5)
    with testing.output_layer_calls(twins.stock) as calls:
        testing.stock_train_step(twins.stock, batch)
    stock_losses = testing.stock_mtp_losses()
    logits = testing.hooked_train_step(twins.hooked, twins.hooks, batch)

    assert len(calls) == depth + 1
    torch.testing.assert_close(logits, calls[-1].transpose(0, 1), atol=0, rtol=0)
    testing.assert_same_mtp_losses(twins.hooks.metrics(), stock_losses)
    testing.assert_same_grads(twins.hooked, twins.stock)
    assert all(p.grad is not None and p.grad.any() for n, p in twins.hooked.named_parameters() if n.startswith("mtp."))


def test_qwen_style_gqa_model_trains_a_hooked_micro_batch_like_stock() -> None:
    shape = testing.TinyQwen(vocab_size=VOCAB)
    twins = testing.build_twins(shape, seed=7)

    config = twins.stock.config
    assert config.num_query_groups == 2 < config.num_attention_heads == 4
    assert config.normalization == "RMSNorm" and config.gated_linear_unit and config.add_qkv_bias
    head_dim = config.hidden_size // config.num_attention_heads
    qkv = twins.stock.decoder.layers[0].self_attention.linear_qkv
    assert qkv.weight.shape[0] == (4 + 2 * 2) * head_dim  # 4 query heads, 2 key and 2 value heads
    assert_hooked_micro_batch_matches_stock(twins, depth=2)
    twins.hooks.remove()


@pytest.mark.skipif(testing.deepseek_missing() is not None, reason=f"no DeepSeek-style model on CPU: {testing.deepseek_missing()}")
def test_deepseek_style_mla_moe_model_trains_a_hooked_micro_batch_like_stock() -> None:
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    twins = testing.build_twins(testing.TinyDeepSeek(vocab_size=VOCAB), seed=7)

    modules = dict(twins.stock.named_modules())
    assert isinstance(modules["decoder.layers.0.self_attention"], MultiLatentAttention)
    assert isinstance(modules["decoder.layers.1.mlp"], MoELayer)
    assert any(name.startswith("mtp.") and isinstance(m, MoELayer) for name, m in modules.items())
    assert_hooked_micro_batch_matches_stock(twins, depth=2)
    twins.hooks.remove()


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_sdpa_attention_with_query_groups_equals_repeated_key_value_heads(groups: int) -> None:
    shape = testing.TinyGPT(num_query_groups=groups)
    attention = testing.SDPAttention(shape.config(), layer_number=1, attn_mask_type=None, attention_type="self")
    gen = torch.Generator().manual_seed(groups)
    s, b, heads, d = 6, 2, 4, 8
    query = torch.randn(s, b, heads, d, generator=gen)
    key, value = torch.randn(s, b, groups, d, generator=gen), torch.randn(s, b, groups, d, generator=gen)

    out = attention(query, key, value, attention_mask=None)

    # Reference: query head h attends with key/value head h // (heads // groups), causally.
    expected = torch.empty(s, b, heads, d)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for h in range(heads):
        g = h // (heads // groups)
        scores = torch.einsum("ibd,jbd->bij", query[:, :, h], key[:, :, g]) / d**0.5
        weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        expected[:, :, h] = torch.einsum("bij,jbd->ibd", weights, value[:, :, g])
    assert out.shape == (s, b, heads * d)
    torch.testing.assert_close(out, expected.reshape(s, b, heads * d), atol=1e-5, rtol=1e-5)


def test_sdpa_attention_refuses_query_heads_that_do_not_divide_into_groups() -> None:
    attention = testing.SDPAttention(testing.TinyGPT().config(), layer_number=1, attn_mask_type=None, attention_type="self")
    query, key = torch.randn(4, 1, 4, 8), torch.randn(4, 1, 3, 8)
    with pytest.raises(ValueError, match="4 query heads cannot share 3 key/value heads"):
        attention(query, key, key, attention_mask=None)


def test_sdpa_attention_narrows_the_causal_mask_by_a_given_mask_as_mcore_softmax_does() -> None:
    """A given ``attention_mask`` (True where masked, mcore's convention) removes keys from the causal mask; a row it
    empties keeps its own key. Checked against softmax attention written out with the combined mask."""
    attention = testing.SDPAttention(testing.TinyGPT().config(), layer_number=1, attn_mask_type=None, attention_type="self")
    gen = torch.Generator().manual_seed(5)
    s, b, heads, d = 6, 2, 4, 8
    query, key, value = (torch.randn(s, b, heads, d, generator=gen) for _ in range(3))
    given = torch.rand(1, 1, s, s, generator=gen) < 0.5
    given[0, 0, 3] = True  # row 3 loses every key: it keeps its own

    out = attention(query, key, value, attention_mask=given)

    allowed = torch.ones(s, s, dtype=torch.bool).tril() & ~given[0, 0] | torch.eye(s, dtype=torch.bool)
    scores = torch.einsum("ibhd,jbhd->bhij", query, key) / d**0.5
    expected = torch.einsum("bhij,jbhd->ibhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), value)
    torch.testing.assert_close(out, expected.reshape(s, b, heads * d), atol=1e-5, rtol=1e-5)
    causal = attention(query, key, value, attention_mask=None)
    assert not torch.allclose(out, causal), "the given mask changed nothing"
