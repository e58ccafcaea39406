"""``mtp_hooks.export``'s whole-model export on one rank: ``hf_weights``, ``hf_config`` and the folder writer's checks.

* Names, order, shapes and values of ``hf_weights`` are those the engine tests' folders were written with
  before the export had a whole-model function: the main model's tensors read through the MTP export's
  decoder-layer table (``legacy_main_pairs`` below, the former ``engine_models.main_hf_pairs``), then
  ``mtp_hf_weights``; for each family of ``engine_models`` (DeepSeek-V3, GLM-4.5, MiMo). MiMo's main names
  are also spelled out, and tensors that need no split are the model's own.
* ``hf_config``: each field from the mcore config and the ``GPTModel`` (or a bare config with the model's
  values given), overrides in place, YaRN and the MoE fields' variants.
* Refusals name the argument, what was expected and what came (``MTPHooksError``), before any tensor moves.

That the pairs and the config are the family's HF model (logits equal to transformers' own model of each
family), that the folder loads and that vLLM serves it: ``tests/engine/test_engine_own_model.py``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterator

import pytest
import torch
from torch import Tensor

import mtp_hooks
from mtp_hooks import MTPHooksError
from mtp_hooks.export import FAMILIES, LAYOUTS, hf_config, hf_weights, mtp_hf_weights, save_hf_folder, write_hf_folder
from mtp_hooks.export.convert import hf_pairs
from mtp_hooks.testing import TinyGPT, moe_mla_on_cpu
from mtp_hooks.testing import engine_models as em
from tests.support.export_cases import VOCAB, deepseek_v3_shape, qwen_shape
from tests.support.mcore_moe import DEEPSEEK_MISSING

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
needs_deepseek = pytest.mark.skipif(DEEPSEEK_MISSING is not None, reason=f"no DeepSeek-style model on CPU: {DEEPSEEK_MISSING}")


def needs_family(family: str) -> pytest.MarkDecorator:
    missing = em.family_missing(family)
    return pytest.mark.skipif(missing is not None, reason=f"no {family} engine shape on CPU: {missing}")


@pytest.fixture(autouse=True)
def _moe_mla() -> Iterator[None]:
    with moe_mla_on_cpu():
        yield


def legacy_main_pairs(model: torch.nn.Module, layout: str) -> list[tuple[str, Tensor]]:
    """How the engine tests' folders got the main model's tensors before ``hf_weights``: each decoder layer's
    tensor named as MTP layer 0's transformer layer, then moved to ``model.layers.{n}.``."""
    top = {"embedding.word_embeddings.weight": "model.embed_tokens.weight", "decoder.final_layernorm.weight": "model.norm.weight",
           "output_layer.weight": "lm_head.weight"}
    found = LAYOUTS[layout]
    mtp_prefix = found.layer_prefix(model.config.num_layers, 0)
    pairs = []
    for name, tensor in model.state_dict().items():
        if name in top:
            pairs.append((top[name], tensor))
        layer = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
        if layer and not name.endswith("_extra_state"):
            for hf_name, part in hf_pairs(f"mtp.layers.0.transformer_layer.{layer.group(2)}", tensor, model.config, found):
                pairs.append((f"model.layers.{layer.group(1)}." + hf_name.removeprefix(mtp_prefix), part))
    return pairs


def family_model(family: str, **shape_kwargs: Any) -> torch.nn.Module:
    """``engine_models``' mcore model of ``family`` with random weights (its engine sizes)."""
    model = em.shape(family, **shape_kwargs).build(seed=4)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and (tensor.dim() > 1 or name.endswith("expert_bias")):
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
    return model


# ------------------------------------------------------------------------------ names, shapes, values


@pytest.mark.parametrize("family", [pytest.param(family, marks=needs_family(family)) for family in em.FAMILIES])
def test_whole_model_pairs_are_what_the_engine_folders_held(family: str) -> None:
    model = family_model(family)
    layout = FAMILIES[family]
    pairs = list(hf_weights(model, layout))
    expected = legacy_main_pairs(model, layout) + list(mtp_hf_weights(model, layout))
    assert [name for name, _ in pairs] == [name for name, _ in expected]
    for (name, tensor), (_, reference) in zip(pairs, expected):
        assert tensor.dtype == reference.dtype and torch.equal(tensor, reference), name
    main = list(hf_weights(model, layout, mtp=False))
    assert [name for name, _ in main] == [name for name, _ in pairs[: len(main)]] and len(main) == len(legacy_main_pairs(model, layout))


def test_mimo_main_model_takes_qwen2s_names_and_shapes() -> None:
    model = qwen_shape(mtp_num_layers=1).build()  # hidden 32, 4 heads of 8, 2 key/value groups, ffn 128
    main = {name: tuple(t.shape) for name, t in hf_weights(model, "mimo", mtp=False)}
    expected = {"model.embed_tokens.weight": (VOCAB, 32), "model.norm.weight": (32,), "lm_head.weight": (VOCAB, 32)}
    for n in range(2):
        p = f"model.layers.{n}."
        expected |= {p + "input_layernorm.weight": (32,), p + "post_attention_layernorm.weight": (32,), p + "self_attn.o_proj.weight": (32, 32)}
        expected |= {p + "self_attn.q_proj.weight": (32, 32), p + "self_attn.k_proj.weight": (16, 32), p + "self_attn.v_proj.weight": (16, 32)}
        expected |= {p + "self_attn.q_proj.bias": (32,), p + "self_attn.k_proj.bias": (16,), p + "self_attn.v_proj.bias": (16,)}
        expected |= {p + "mlp.gate_proj.weight": (128, 32), p + "mlp.up_proj.weight": (128, 32), p + "mlp.down_proj.weight": (32, 128)}
    assert main == expected
    params = dict(model.named_parameters())
    pairs = dict(hf_weights(model, "mimo", mtp=False))
    assert pairs["model.embed_tokens.weight"].data_ptr() == params["embedding.word_embeddings.weight"].data_ptr()  # no copy
    assert pairs["lm_head.weight"].data_ptr() == params["output_layer.weight"].data_ptr()
    assert torch.equal(pairs["model.layers.1.mlp.up_proj.weight"], params["decoder.layers.1.mlp.linear_fc1.weight"][128:])


@needs_deepseek
def test_deepseek_decoder_layers_dense_then_moe_with_experts_numbered_as_mcore_does() -> None:
    model = deepseek_v3_shape(mtp_num_layers=1).build()
    names = {name for name, _ in hf_weights(model, "deepseek_v3", mtp=False)}
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" not in names  # dense
    assert {f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(4)} <= names
    assert {"model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.self_attn.kv_b_proj.weight"} <= names
    assert not any(name.startswith("model.layers.2.") for name in names)  # MTP layer L = 2: with mtp=True only


def test_a_tied_head_is_tied_in_mimo_and_written_as_lm_head_in_deepseek_v3() -> None:
    model = dataclasses.replace(qwen_shape(mtp_num_layers=1), tied=True).build()
    mimo = dict(hf_weights(model, "mimo"))
    assert "lm_head.weight" not in mimo
    assert hf_config(model, "mimo")["tie_word_embeddings"] is True
    glm_layout = dict(hf_weights(model, "deepseek_v3", mtp=False))
    assert torch.equal(glm_layout["lm_head.weight"], glm_layout["model.embed_tokens.weight"])


def test_hooks_attached_change_nothing() -> None:
    model = qwen_shape(mtp_num_layers=1).build()
    before = [(n, t.clone()) for n, t in hf_weights(model, "mimo")]
    hooks = mtp_hooks.attach(model)
    try:
        during = list(hf_weights(model, "mimo"))
    finally:
        hooks.remove()
    assert [n for n, _ in before] == [n for n, _ in during] and all(torch.equal(a, b) for (_, a), (_, b) in zip(before, during))


# ------------------------------------------------------------------------------ config


@pytest.mark.parametrize("family", [pytest.param(family, marks=needs_family(family)) for family in em.FAMILIES])
def test_config_fields_come_from_the_mcore_config_and_the_model(family: str) -> None:
    model = em.trainer(family)
    config = hf_config(model, family)
    common = dict(vocab_size=1024, hidden_size=128, num_hidden_layers=2, num_nextn_predict_layers=1, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  max_position_embeddings=512, bos_token_id=None, eos_token_id=None, dtype="bfloat16", hidden_act="silu")
    moe = dict(intermediate_size=256, moe_intermediate_size=64, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
               first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid")
    expected = {
        "mimo": dict(common, num_attention_heads=4, architectures=["MiMoForCausalLM"], model_type="qwen2", intermediate_size=512, num_key_value_heads=2,
                     rope_theta=10000.0, use_sliding_window=False),
        "glm4_moe": dict(common, num_attention_heads=4, **moe, architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", num_key_value_heads=2,
                         head_dim=32, partial_rotary_factor=1.0, use_qk_norm=True, attention_bias=True, rope_theta=10000.0),
        "deepseek_v3": dict(common, num_attention_heads=2, **moe, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_key_value_heads=2,
                            kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, rope_theta=10000.0),
    }[family]
    assert config == expected
    assert list(config) == list(em.hf_config(family, model.config))  # the engine tests' folders: the same keys, in order


def test_overrides_replace_in_place_or_add_and_a_bare_config_takes_the_models_values() -> None:
    model = em.trainer("mimo")
    config = hf_config(model, "mimo", dtype=torch.float32, max_position_embeddings=4096, bos_token_id=0, rope_scaling=None)
    assert list(config) == list(hf_config(model, "mimo")) + ["rope_scaling"]
    assert (config["max_position_embeddings"], config["bos_token_id"], config["dtype"]) == (4096, 0, "float32")
    bare = hf_config(model.config, "mimo", vocab_size=1024, max_position_embeddings=512, tie_word_embeddings=False, rope_theta=10000.0)
    assert bare == hf_config(model, "mimo")


@needs_deepseek
def test_mla_yarn_rope_and_moe_variants() -> None:
    yarn = dict(rope_type="yarn", rotary_scaling_factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
    config = hf_config(deepseek_v3_shape(1, **yarn).build(), "deepseek_v3")
    assert config["rope_scaling"] == dict(type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                                          mscale_all_dim=1.0)
    variant = hf_config(deepseek_v3_shape(1, moe_router_topk=1, moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=32).build(),
                        "deepseek_v3")
    assert (variant["norm_topk_prob"], variant["routed_scaling_factor"], variant["n_shared_experts"]) == (False, 2.5, 2)  # mcore: no normalising at k = 1


# ------------------------------------------------------------------------------ refused


@pytest.mark.parametrize(
    "case, match",
    [
        ("family", r"family: bad value\n  expected: one of 'deepseek_v3', 'glm4_moe', 'mimo'\n  received: 'qwen3_next'"),
        ("layout", r"(?s)do not fit layout 'mimo'.*normalization='LayerNorm'"),
        ("gqa_as_deepseek", r"(?s)does not fit the HF family 'deepseek_v3'\n  expected: .*\n  received: .*multi_latent_attention=False"),
        ("mla_as_glm", r"multi_latent_attention=True \(GLM-4.5 uses grouped-query attention"),
        ("dense_as_glm", r"num_moe_experts=None \(the family's layers after the first k are MoE\)"),
        ("mimo_qk_norm", r"qk_layernorm=True \(Qwen2 / MiMo attention has no q / k norm\)"),
        ("mimo_no_qkv_bias", r"add_qkv_bias=False \(Qwen2 / MiMo attention has a QKV bias\)"),
        ("softmax_router", r"a router other than sigmoid scores with expert bias"),
        ("moe_pattern", r"moe_layer_freq=\[1, 0\] \(the families: k dense layers, then MoE layers only\)"),
        ("learned_positions", r"position_embedding_type='learned_absolute' \(the families' layers apply RoPE\)"),
        ("bare_config", r"overrides: bad value\n  expected: with a bare TransformerConfig, the model-level values vocab_size, max_position_embeddings"),
    ],
)
def test_configs_the_family_cannot_describe_are_refused_naming_why(case: str, match: str) -> None:
    if case in ("mla_as_glm", "softmax_router", "moe_pattern") and DEEPSEEK_MISSING is not None:
        pytest.skip(f"no DeepSeek-style model on CPU: {DEEPSEEK_MISSING}")
    family, model = "mimo", None
    if case == "family":
        family, model = "qwen3_next", qwen_shape(1).build()
    elif case == "layout":
        model = TinyGPT(vocab_size=VOCAB).build()
    elif case == "gqa_as_deepseek":
        family, model = "deepseek_v3", qwen_shape(1).build()
    elif case == "mla_as_glm":
        family, model = "glm4_moe", deepseek_v3_shape(1).build()
    elif case == "dense_as_glm":
        family, model = "glm4_moe", qwen_shape(1, qk_layernorm=True).build()
    elif case == "mimo_qk_norm":
        model = qwen_shape(1, qk_layernorm=True).build()
    elif case == "mimo_no_qkv_bias":
        model = qwen_shape(1, add_qkv_bias=False).build()
    elif case == "softmax_router":
        family, model = "deepseek_v3", deepseek_v3_shape(1, moe_router_score_function="softmax", moe_router_enable_expert_bias=False).build()
    elif case == "moe_pattern":
        family, model = "deepseek_v3", deepseek_v3_shape(1, moe_layer_freq=[1, 0]).build()
    elif case == "learned_positions":
        model = dataclasses.replace(qwen_shape(1), position_embedding_type="learned_absolute").build()
    else:
        model = qwen_shape(1).build().config
    with pytest.raises(MTPHooksError, match=match):
        hf_config(model, family)


def test_weights_without_an_hf_name_and_bad_arguments_are_refused_on_the_call() -> None:
    learned = dataclasses.replace(qwen_shape(1), position_embedding_type="learned_absolute").build()
    with pytest.raises(MTPHooksError, match=r"main-model tensor 'embedding.position_embeddings.weight' has no HF name"):
        hf_weights(learned, "mimo")  # on the call, not on the first next()
    with pytest.raises(MTPHooksError, match=r"mtp: bad value\n  expected: a bool\n  received: 'no'"):
        hf_weights(qwen_shape(1).build(), "mimo", mtp="no")
    with pytest.raises(MTPHooksError, match=r"layout: bad value\n  expected: one of 'deepseek_v3', 'mimo'"):
        hf_weights(qwen_shape(1).build(), "glm4_moe")  # a family, not a layout: FAMILIES["glm4_moe"]


def test_folder_arguments_are_refused_before_anything_is_written(tmp_path: Any) -> None:
    model = qwen_shape(1).build()
    config = hf_config(model, "mimo")
    cases = [
        (lambda: write_hf_folder(tmp_path / "a", hf_weights(model, "mimo"), config, dtype=torch.float32),
         r"config: bad value\n  expected: dtype 'float32', the dtype the weights are written in\n  received: dtype 'bfloat16'"),
        (lambda: write_hf_folder(tmp_path / "b", [], {"hidden_size": 32}), r"config: bad value\n  expected: a config.json dict with architectures"),
        (lambda: write_hf_folder(tmp_path / "c", [], config, max_shard_bytes=0), r"max_shard_bytes: bad value\n  expected: an int >= 1"),
        (lambda: save_hf_folder(tmp_path / "d", model, "mimo", tokenizer="gpt2"), r"tokenizer: bad value\n  expected: None or a tokenizer with save_pretrained"),
        (lambda: save_hf_folder(tmp_path / "e", model, "mimo", dtype=torch.int8), r"dtype: bad value\n  expected: a floating torch.dtype"),
        (lambda: save_hf_folder(tmp_path / "f", model, "mimo", config={"dtype": "float16"}), r"config: bad value\n  expected: dtype 'bfloat16'"),
        (lambda: save_hf_folder(tmp_path / "g", model, "llama"), r"family: bad value\n  expected: one of 'deepseek_v3', 'glm4_moe', 'mimo'"),
    ]
    for call, match in cases:
        with pytest.raises(MTPHooksError, match=match):
            call()
    assert not any(tmp_path.iterdir())
