"""``mtp_hooks.export`` on one rank: the engine's names and values of real mcore MTP layers.

Names are pinned against the HF decoder layers the engines load (DeepSeek-V3 multi-latent
attention with MoE; Qwen2 / MiMo grouped-query attention with qkv bias), values against the mcore
tensors read the way the HF layer reads them, written out here independently of the library
(per-group QKV slices, gate and up halves, MiMo's swapped input halves). Transformer Engine names
and mcore 0.17's ``mtp_model_layer`` give the same pairs as the local names the CPU models carry.
The bridge check is driven by streams shaped like each known bridge defect (the bridges' own
exports are in ``tests/integrations/test_export_bridges.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

import mtp_hooks
from mtp_hooks import MTPHooksError
from mtp_hooks.export import BridgeExportError, check_bridge_export, mtp_hf_weights, mtp_hf_weights_from_state_dict, replace_mtp_weights
from tests.support.export_cases import VOCAB, deepseek_v3_shape, mtp_state, qwen_shape, set_expert_bias, transformer_engine_names
from tests.support.mcore_cpu import TinyGPT, hooked_train_step, make_batch, stock_train_step
from tests.support.mcore_moe import DEEPSEEK_MISSING, moe_mla_on_cpu

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
needs_deepseek = pytest.mark.skipif(DEEPSEEK_MISSING is not None, reason=f"no DeepSeek-style model on CPU: {DEEPSEEK_MISSING}")


@pytest.fixture(autouse=True)
def _moe_mla() -> Any:
    with moe_mla_on_cpu():
        yield


def exported(model: torch.nn.Module, layout: str) -> dict[str, Tensor]:
    pairs = list(mtp_hf_weights(model, layout))
    names = [name for name, _ in pairs]
    assert len(names) == len(set(names)), "a name repeats"
    return dict(pairs)


def body(model: torch.nn.Module, index: int) -> str:
    """``mtp.layers.{index}.`` plus the transformer layer's attribute on this mcore."""
    layer = model.mtp.layers[index]
    return f"mtp.layers.{index}." + ("mtp_model_layer" if hasattr(layer, "mtp_model_layer") else "transformer_layer")


# ------------------------------------------------------------------------------ names


@needs_deepseek
def test_deepseek_v3_layout_names_every_tensor_of_mla_moe_mtp_layers_after_the_decoder_layers() -> None:
    model = deepseek_v3_shape(mtp_num_layers=2).build()
    names = set(exported(model, "deepseek_v3"))
    expected = set()
    for k in (2, 3):  # L = 2 decoder layers, N = 2 MTP layers
        p = f"model.layers.{k}."
        expected |= {p + n for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight")}
        expected |= {p + f"self_attn.{n}.weight" for n in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")}
        expected |= {p + "mlp.gate.weight", p + "mlp.gate.e_score_correction_bias"}
        expected |= {p + f"mlp.experts.{e}.{n}_proj.weight" for e in range(4) for n in ("gate", "up", "down")}
        expected |= {p + f"mlp.shared_experts.{n}_proj.weight" for n in ("gate", "up", "down")}
    assert names == expected


def test_mimo_layout_names_a_dense_gqa_mtp_layer_under_mtp_layers() -> None:
    model = qwen_shape(mtp_num_layers=1).build()
    p = "model.mtp_layers.0."
    expected = {p + n for n in ("token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight", "final_layernorm.weight")}
    expected |= {p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight")}
    expected |= {p + f"self_attn.{x}_proj.{w}" for x in "qkv" for w in ("weight", "bias")}
    expected |= {p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
    assert set(exported(model, "mimo")) == expected


# ------------------------------------------------------------------------------ values


def test_values_are_mcore_tensors_read_as_the_hf_layer_reads_them_gqa_gated_and_swapped() -> None:
    shape = qwen_shape(mtp_num_layers=2)
    model = shape.build()
    config = model.config
    out = exported(model, "mimo")
    state = mtp_state(model)
    heads, groups, d, h = config.num_attention_heads, config.num_query_groups, config.kv_channels, config.hidden_size
    assert (heads, groups) == (4, 2)
    for i in range(2):
        p, t = f"model.mtp_layers.{i}.", body(model, i)
        eh = state[f"mtp.layers.{i}.eh_proj.weight"]
        assert torch.equal(out[p + "input_proj.weight"][:, :h], eh[:, h:]) and torch.equal(out[p + "input_proj.weight"][:, h:], eh[:, :h])
        for kind in ("weight", "bias"):
            qkv = state[f"{t}.self_attention.linear_qkv.{kind}"]
            rows = (heads // groups + 2) * d
            q = torch.cat([qkv[g * rows : g * rows + (heads // groups) * d] for g in range(groups)])
            k = torch.cat([qkv[g * rows + (heads // groups) * d : g * rows + (heads // groups + 1) * d] for g in range(groups)])
            v = torch.cat([qkv[g * rows + (heads // groups + 1) * d : (g + 1) * rows] for g in range(groups)])
            for name, value in zip("qkv", (q, k, v)):
                assert torch.equal(out[p + f"self_attn.{name}_proj.{kind}"], value), (i, name, kind)
        fc1 = state[f"{t}.mlp.linear_fc1.weight"]
        ffn = fc1.shape[0] // 2
        assert torch.equal(out[p + "mlp.gate_proj.weight"], fc1[:ffn]) and torch.equal(out[p + "mlp.up_proj.weight"], fc1[ffn:])
        wrapper = {"token_layernorm": "enorm", "hidden_layernorm": "hnorm", "final_layernorm": "final_layernorm"}
        inner = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "pre_mlp_layernorm", "self_attn.o_proj": "self_attention.linear_proj", "mlp.down_proj": "mlp.linear_fc2"}
        same = {f"{hf}.weight": f"mtp.layers.{i}.{mcore}.weight" for hf, mcore in wrapper.items()}
        same.update({f"{hf}.weight": f"{t}.{mcore}.weight" for hf, mcore in inner.items()})
        for hf, mcore in same.items():
            assert torch.equal(out[p + hf], state[mcore]), hf
    assert len(out) == 2 * 16


@needs_deepseek
def test_deepseek_values_keep_mla_tensors_and_number_experts_as_mcore_does() -> None:
    model = deepseek_v3_shape(mtp_num_layers=1).build()
    set_expert_bias(model)
    out = exported(model, "deepseek_v3")
    state = mtp_state(model)
    p, t = "model.layers.2.", body(model, 0)
    pairs = {
        "eh_proj.weight": "mtp.layers.0.eh_proj.weight",
        "shared_head.norm.weight": "mtp.layers.0.final_layernorm.weight",
        "self_attn.q_a_proj.weight": f"{t}.self_attention.linear_q_down_proj.weight",
        "self_attn.q_a_layernorm.weight": f"{t}.self_attention.q_layernorm.weight",
        "self_attn.q_b_proj.weight": f"{t}.self_attention.linear_q_up_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight": f"{t}.self_attention.linear_kv_down_proj.weight",
        "self_attn.kv_a_layernorm.weight": f"{t}.self_attention.kv_layernorm.weight",
        "self_attn.kv_b_proj.weight": f"{t}.self_attention.linear_kv_up_proj.weight",
        "self_attn.o_proj.weight": f"{t}.self_attention.linear_proj.weight",
        "mlp.gate.weight": f"{t}.mlp.router.weight",
        "mlp.gate.e_score_correction_bias": f"{t}.mlp.router.expert_bias",
        "mlp.shared_experts.down_proj.weight": f"{t}.mlp.shared_experts.linear_fc2.weight",
    }
    for hf, mcore in pairs.items():
        assert torch.equal(out[p + hf], state[mcore]), hf
    assert out[p + "mlp.gate.e_score_correction_bias"].any(), "expert bias left at zeros: the check cannot fail"
    for e in range(4):
        fc1 = state[f"{t}.mlp.experts.local_experts.{e}.linear_fc1.weight"]
        gate, up = fc1.chunk(2)
        assert torch.equal(out[p + f"mlp.experts.{e}.gate_proj.weight"], gate) and torch.equal(out[p + f"mlp.experts.{e}.up_proj.weight"], up)
        assert torch.equal(out[p + f"mlp.experts.{e}.down_proj.weight"], state[f"{t}.mlp.experts.local_experts.{e}.linear_fc2.weight"])


def test_tensors_that_need_no_gathering_are_the_models_parameters_without_a_copy() -> None:
    model = qwen_shape(mtp_num_layers=1).build()
    out = exported(model, "mimo")
    assert out["model.mtp_layers.0.token_layernorm.weight"].data_ptr() == model.mtp.layers[0].enorm.weight.data_ptr()
    assert not out["model.mtp_layers.0.token_layernorm.weight"].requires_grad


@needs_deepseek
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen"])
def test_transformer_engine_names_and_mcore_0_17_layer_name_give_the_same_pairs(family: str) -> None:
    """Fused norms, grouped-GEMM expert names and ``mtp_model_layer`` read as the local names do."""
    model = (deepseek_v3_shape(mtp_num_layers=2) if family == "deepseek_v3" else qwen_shape(mtp_num_layers=2)).build()
    layout = "deepseek_v3"
    reference = exported(model, layout)
    state = model.state_dict()
    te_state = transformer_engine_names(state, family == "deepseek_v3")
    assert te_state.keys() != state.keys(), "no name changed: the check cannot fail"
    renamed_body = {name.replace(".transformer_layer.", ".mtp_model_layer."): value for name, value in te_state.items()}
    for variant in (te_state, renamed_body):
        pairs = dict(mtp_hf_weights_from_state_dict(variant, model.config, layout))
        assert list(pairs) == list(reference)
        for name, tensor in reference.items():
            assert torch.equal(pairs[name], tensor), name


# ------------------------------------------------------------------------------ hooks


def test_export_is_the_same_with_hooks_attached_while_training_and_after_remove() -> None:
    """Same model: bit-identical pairs before, while and after; twins trained stock / hooked agree."""
    shape = qwen_shape(mtp_num_layers=2)
    stock, hooked = shape.build(seed=5), shape.build(seed=5)
    before = exported(hooked, "mimo")
    hooks = mtp_hooks.attach(hooked)
    attached = exported(hooked, "mimo")
    assert attached.keys() == before.keys() and all(torch.equal(attached[n], before[n]) for n in before)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (stock, hooked)]
    for step in range(2):
        batch = make_batch(VOCAB, batch=2, seq=16, seed=step)
        stock_train_step(stock, batch)
        hooked_train_step(hooked, hooks, batch)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    reference = exported(stock, "mimo")
    assert any(not torch.equal(reference[n], before[n]) for n in before), "MTP did not train: the check cannot fail"
    for when in ("attached", "removed"):
        if when == "removed":
            hooks.remove()
        now = exported(hooked, "mimo")
        assert list(now) == list(reference), when
        for name, tensor in reference.items():
            # the hooked twin's main CE is the user's, from logits: equal up to float rounding
            torch.testing.assert_close(now[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{when}: {n}: {m}")


# ------------------------------------------------------------------------------ refused


@needs_deepseek
@pytest.mark.parametrize(
    "case, match",
    [
        ("unknown_layout", r"layout: bad value\n  expected: one of 'deepseek_v3', 'mimo'"),
        ("layernorm_gelu", r"(?s)normalization='LayerNorm'.*gated_linear_unit=False"),
        ("mimo_moe", r"(?s)do not fit layout 'mimo'.*multi_latent_attention=True.*num_moe_experts=4"),
        ("no_latent_norms", r"multi_latent_attention without qk_layernorm"),
        ("linear_bias", r"MTP tensor 'mtp\.layers\.0\.transformer_layer\.self_attention\.linear_proj\.bias' has no name in layout 'mimo'"),
        ("all_stages", r"all_stages: bad value"),
    ],
)
def test_models_the_layout_cannot_hold_are_refused_on_the_call_naming_why(case: str, match: str) -> None:
    model: Any
    layout, kwargs = "mimo", {}
    if case == "unknown_layout":
        model, layout = qwen_shape(1).build(), "qwen3_next"
    elif case == "layernorm_gelu":
        model = TinyGPT(vocab_size=VOCAB).build()
    elif case == "mimo_moe":
        model = deepseek_v3_shape(1).build()
    elif case == "no_latent_norms":
        model, layout = deepseek_v3_shape(1, qk_layernorm=False).build(), "deepseek_v3"
    elif case == "linear_bias":
        model = qwen_shape(1, add_bias_linear=True).build()
        match = match.replace("transformer_layer", body(model, 0).rpartition(".")[2])
    else:
        model, kwargs = qwen_shape(1).build(), {"all_stages": "yes"}
    with pytest.raises(MTPHooksError, match=match):
        mtp_hf_weights(model, layout, **kwargs)  # on the call, not on the first next()


def test_a_model_without_mtp_layers_is_refused() -> None:
    with pytest.raises(MTPHooksError, match=r"mtp_num_layers=None \(no MTP layers\)"):
        mtp_hf_weights(qwen_shape(None).build(), "mimo")


# ------------------------------------------------------------------------------ bridge check and stream


def bridge_like(model: torch.nn.Module, layout: str, main: bool = True) -> list[tuple[str, Tensor]]:
    """A bridge's whole-model stream as a correct bridge writes it: main tensors (stand-ins under the
    main model's names, and the per-layer shared copies) and the MTP tensors, copied."""
    pairs = [("model.embed_tokens.weight", torch.zeros(VOCAB, 32)), ("model.layers.0.input_layernorm.weight", torch.ones(32))] if main else []
    pairs += [(name, tensor.clone()) for name, tensor in mtp_hf_weights(model, layout)]
    if layout == "deepseek_v3":
        pairs.append(("model.layers.2.shared_head.head.weight", torch.zeros(VOCAB, 32)))
    return pairs


def test_check_passes_a_correct_stream_and_counts_the_mtp_tensors() -> None:
    model = qwen_shape(2).build()
    assert check_bridge_export(bridge_like(model, "deepseek_v3"), model, "deepseek_v3") == 2 * 16
    # ours are cast to the bridge's dtype first: a bf16 export of fp32 weights is the same tensors
    bf16 = [(n, t.to(torch.bfloat16)) for n, t in bridge_like(model, "mimo")]
    assert check_bridge_export(bf16, model, "mimo") == 2 * 16
    nudged = [(n, t + 1e-4 if n.endswith("up_proj.weight") else t) for n, t in bridge_like(model, "mimo")]
    with pytest.raises(BridgeExportError, match="is different"):
        check_bridge_export(nudged, model, "mimo")
    assert check_bridge_export(nudged, model, "mimo", atol=1e-3) == 2 * 16


def swapped_input_halves(model: torch.nn.Module, pairs: list[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    """mbridge 0.15.1's MiMo export: ``eh_proj`` as ``input_proj``, halves unswapped."""
    eh = model.mtp.layers[0].eh_proj.weight.detach()
    return [(n, eh.clone() if n.endswith("input_proj.weight") else t) for n, t in pairs]


def written_as_layer_61(model: torch.nn.Module, pairs: list[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    """mbridge 0.15.1's DeepSeek-V3 mapping: the MTP layer at decoder layer 61, whatever L."""
    return [(n.replace("model.layers.2.", "model.layers.61."), t) for n, t in pairs]


def every_layer_as_the_first(model: torch.nn.Module, pairs: list[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    """mbridge 0.15.1's GLM-4.5 mapping: every MTP layer's wrapper tensors at model.layers.{L}."""
    wrapper = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
    return [(n.replace("model.layers.3.", "model.layers.2.") if n.endswith(wrapper) else n, t) for n, t in pairs]


@pytest.mark.parametrize(
    "defect, layout, depth, expected",
    [
        (swapped_input_halves, "mimo", 1, ("different", "model.mtp_layers.0.input_proj.weight", "swapped", "cat(hidden, embedding)")),
        (written_as_layer_61, "deepseek_v3", 1, ("misnamed", "model.layers.2.enorm.weight", "61", "under 'model.layers.61.enorm.weight'")),
        (every_layer_as_the_first, "deepseek_v3", 2, ("repeated", "model.layers.2.enorm.weight", "same", "under the first MTP layer's names")),
    ],
    ids=["mimo_unswapped", "deepseek_61", "glm_same_names"],
)
def test_check_names_each_known_bridge_defect(defect: Any, layout: str, depth: int, expected: tuple[str, ...]) -> None:
    model = qwen_shape(depth).build()
    with pytest.raises(BridgeExportError) as raised:
        check_bridge_export(defect(model, bridge_like(model, layout)), model, layout)
    kind, name, known, words = expected
    assert (raised.value.kind, raised.value.name, raised.value.defect) == (kind, name, known)
    assert words in str(raised.value)


@pytest.mark.parametrize("fault, kind", [("drop", "missing"), ("add", "extra"), ("perturb", "different")])
def test_check_names_the_first_missing_extra_or_different_tensor(fault: str, kind: str) -> None:
    model = qwen_shape(1).build()
    pairs = bridge_like(model, "mimo")
    target = "model.mtp_layers.0.self_attn.k_proj.weight"
    if fault == "drop":
        pairs = [(n, t) for n, t in pairs if n != target]
    elif fault == "add":
        pairs.append(("model.mtp_layers.0.self_attn.k_proj.weight_scale", torch.ones(1)))
        target = "model.mtp_layers.0.self_attn.k_proj.weight_scale"
    else:
        pairs = [(n, t + 1e-3 if n == target else t) for n, t in pairs]
    with pytest.raises(BridgeExportError) as raised:
        check_bridge_export(pairs, model, "mimo")
    assert (raised.value.kind, raised.value.name, raised.value.defect) == (kind, target, None)
    assert isinstance(raised.value, MTPHooksError)


def test_replace_passes_the_main_weights_through_and_swaps_in_the_models_mtp_tensors() -> None:
    model = qwen_shape(2).build()
    stale = [(n, torch.zeros_like(t)) for n, t in bridge_like(model, "deepseek_v3")]
    main = [(n, t) for n, t in stale if not n.startswith(("model.layers.2.", "model.layers.3."))]
    replaced = list(replace_mtp_weights(iter(stale), model, "deepseek_v3"))
    assert [n for n, _ in replaced[: len(main)]] == [n for n, _ in main]
    assert all(t is s for (_, t), (_, s) in zip(replaced, main))
    assert dict(replaced[len(main) :]).keys() == exported(model, "deepseek_v3").keys()
    assert check_bridge_export(replaced, model, "deepseek_v3") == 2 * 16
    with pytest.raises(BridgeExportError, match="is different"):
        check_bridge_export(stale, model, "deepseek_v3")
