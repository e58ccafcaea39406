"""``mtp_hooks.export`` on the families as verl's bridge (mbridge 0.15.1) builds them, against
transformers' own model classes and mbridge's own export of the same weights.

* Names and shapes: every MTP tensor we yield for DeepSeek-V3 (MLA + MoE), GLM-4.5 (GQA with qkv
  bias and qk-norm + MoE) and MiMo (dense Qwen2) is a tensor of transformers' model of that family
  built with L + N decoder layers (the MTP layers' transformer layers), with its shape, and every
  tensor of those HF layers is yielded.
* Values: mbridge's per-tensor conversion (``_weight_to_hf_format``) of the MTP tensors equals
  ours where its mapping is right (GLM-4.5 with one MTP layer; DeepSeek-V3 at the 61 decoder layers
  its mapping is written for), and ``check_bridge_export`` names each of its MTP defects. Those
  tests pin the defects: each fails once mbridge fixes its defect (then drop the pin).
* mbridge maps the MTP layer's transformer layer by its mcore <= 0.16 name, ``transformer_layer``; on
  0.17+ (``mtp_model_layer``) it refuses or misnames it (pinned on every release of the matrix).
* ``replace_mtp_weights`` on mbridge's whole-model stream: the main model's pairs pass unchanged,
  the MTP pairs are ours, the result passes the check.

Needs ``requirements/bridges.txt`` (``make bridges-env``); skipped without it.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from mtp_hooks.export import BridgeExportError, check_bridge_export, mtp_hf_weights, replace_mtp_weights
from tests.support.bridge_models import BRIDGES_MISSING, FAMILIES, BridgeModel, hf_config
from tests.support.export_cases import hf_decoder_layers, mbridge_pairs
from tests.support.mcore_moe import moe_on_cpu  # noqa: F401 (autouse: MoE and MLA on CPU, an empty MoE tracker)

pytestmark = [
    pytest.mark.skipif(BRIDGES_MISSING is not None, reason=str(BRIDGES_MISSING)),
    pytest.mark.usefixtures("one_intra_op_thread"),
]

LAYOUT = {"deepseek_v3": "deepseek_v3", "glm4_moe": "deepseek_v3", "mimo": "mimo"}
WRAPPER_LEAVES = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight")


def built(family: str, depth: int = 1, num_layers: int = 2, seed: int = 3) -> tuple[BridgeModel, torch.nn.Module]:
    shape = BridgeModel(family, depth, num_layers=num_layers)
    model = shape.build(seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms and the expert bias start at ones / zeros: make every tensor distinct
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name.startswith("mtp.") and isinstance(tensor, torch.Tensor) and not name.endswith("_extra_state"):
                tensor.add_(0.01 * torch.randn(tensor.shape, generator=generator))
    return shape, model


def as_hf_decoder_name(name: str, num_layers: int) -> str:
    """Our MTP transformer-layer name -> the name of the HF model's decoder layer L + i."""
    found = re.match(r"^model\.mtp_layers\.(\d+)\.(.+)$", name)
    return f"model.layers.{num_layers + int(found.group(1))}.{found.group(2)}" if found else name


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_name_and_shape_is_transformers_decoder_layer_l_plus_i(family: str, depth: int) -> None:
    _, model = built(family, depth)
    ours = dict(mtp_hf_weights(model, LAYOUT[family]))
    hidden = model.config.hidden_size
    hf = hf_decoder_layers(hf_config(family, depth), depth)
    body = {as_hf_decoder_name(name, 2): tuple(t.shape) for name, t in ours.items() if not name.endswith(WRAPPER_LEAVES + ("final_layernorm.weight",))}
    assert body == {name: tuple(t.shape) for name, t in hf.items()}
    wrappers = {name: tuple(t.shape) for name, t in ours.items() if name.endswith(WRAPPER_LEAVES + ("final_layernorm.weight",))}
    assert len(wrappers) == 4 * depth
    for name, shape in wrappers.items():
        assert shape == ((hidden, 2 * hidden) if name.endswith(("eh_proj.weight", "input_proj.weight")) else (hidden,)), name


def test_mbridge_glm4_moe_export_with_one_mtp_layer_is_ours() -> None:
    shape, model = built("glm4_moe", 1)
    assert check_bridge_export(mbridge_pairs(shape.bridge(), model), model, "deepseek_v3") == len(list(mtp_hf_weights(model, "deepseek_v3")))


def test_mbridge_deepseek_v3_export_at_61_decoder_layers_is_ours() -> None:
    """Where mbridge's DeepSeek-V3 MTP mapping holds (L = 61, one MTP layer), its export is ours."""
    shape, model = built("deepseek_v3", 1, num_layers=61)
    pairs = list(mbridge_pairs(shape.bridge(), model))
    assert {name for name, _ in pairs if name.startswith("model.layers.61.")} == {name for name, _ in pairs}
    assert check_bridge_export(pairs, model, "deepseek_v3") == 30


# ------------------------------------------------------------------------------- pinned bridge defects
# Each test asserts that an mbridge 0.15.1 defect still happens and that the check names it. When one
# fails after an upgrade, the bridge fixed it: drop the pin.


def test_mbridge_mimo_still_exports_input_proj_unswapped_and_the_check_names_it() -> None:
    shape, model = built("mimo", 1)
    pairs = list(mbridge_pairs(shape.bridge(), model))
    with pytest.raises(BridgeExportError) as raised:
        check_bridge_export(pairs, model, "mimo")
    assert (raised.value.kind, raised.value.name, raised.value.defect) == ("different", "model.mtp_layers.0.input_proj.weight", "swapped")
    ours = dict(mtp_hf_weights(model, "mimo"))
    fixed = [(name, ours[name] if name.endswith("input_proj.weight") else tensor) for name, tensor in pairs]
    assert check_bridge_export(fixed, model, "mimo") == len(ours)  # everything else is right


def test_mbridge_deepseek_v3_mtp_mapping_still_requires_61_decoder_layers() -> None:
    shape, model = built("deepseek_v3", 1)
    with pytest.raises(AssertionError, match="only support 61 layers"):
        list(mbridge_pairs(shape.bridge(), model))


def test_mbridge_glm4_moe_still_writes_every_mtp_layer_under_the_first_and_the_check_names_it() -> None:
    shape, model = built("glm4_moe", 2)
    with pytest.raises(BridgeExportError) as raised:
        check_bridge_export(mbridge_pairs(shape.bridge(), model), model, "deepseek_v3")
    assert (raised.value.kind, raised.value.defect) == ("repeated", "same")
    assert raised.value.name.startswith("model.layers.2.")


@pytest.mark.parametrize("family", FAMILIES)
def test_mbridge_still_cannot_name_the_mtp_layers_of_mcore_0_17_and_later(family: str) -> None:
    """mbridge 0.15.1 maps ``mtp.layers.{i}.transformer_layer.*``; from mcore 0.17.1 the layer is
    ``mtp_model_layer``, which it refuses or misnames. (Elsewhere the tests hand mbridge the names it knows.)"""
    shape, model = built(family, 1, num_layers=61 if family == "deepseek_v3" else 2)
    renamed_in_this_release = hasattr(model.mtp.layers[0], "mtp_model_layer")
    try:
        check_bridge_export(mbridge_pairs(shape.bridge(), model, mcore_0_16_names=False), model, LAYOUT[family])
    except (AssertionError, NotImplementedError, BridgeExportError) as error:
        swapped = isinstance(error, BridgeExportError) and error.defect == "swapped"  # MiMo's own pin, above
        assert renamed_in_this_release != swapped, f"mbridge: {error}"
    else:
        assert not renamed_in_this_release, "mbridge named mcore 0.17+'s mtp_model_layer right: drop this pin"


# ------------------------------------------------------------------------------- verl's stream


@pytest.mark.parametrize("family", ["mimo", "glm4_moe"])
def test_replace_in_mbridges_whole_model_stream_keeps_the_main_model_and_fixes_the_mtp_layers(family: str) -> None:
    shape, model = built(family, 2)
    layout: Any = LAYOUT[family]
    stream = list(mbridge_pairs(shape.bridge(), model, mtp_only=False))
    main = [(name, tensor) for name, tensor in stream if not name.startswith(("model.mtp_layers.", "model.layers.2.", "model.layers.3."))]
    assert len(main) < len(stream) and any(".mlp." in name for name, _ in main)
    replaced = list(replace_mtp_weights(iter(stream), model, layout))
    assert [name for name, _ in replaced[: len(main)]] == [name for name, _ in main]
    assert all(mine is theirs for (_, mine), (_, theirs) in zip(replaced, main))
    with pytest.raises(BridgeExportError):
        check_bridge_export(stream, model, layout)
    assert check_bridge_export(replaced, model, layout) == len(replaced) - len(main)
