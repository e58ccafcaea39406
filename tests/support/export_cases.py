"""Models, names and references for the tests of ``mtp_hooks.export``.

Test-only support:

* ``deepseek_v3_shape`` / ``qwen_shape``: ``TinyDeepSeek`` and ``TinyQwen`` as the engines' layers
  hold them (gated SwiGLU MLPs; DeepSeek's latent q / kv norms, sigmoid router with expert bias);
* ``transformer_engine_names``: a local-spec state dict under the names a Transformer Engine spec
  gives the same tensors (fused norms, grouped-GEMM experts), as mcore's TE specs name them;
* ``mbridge_pairs``: mbridge's own mcore -> HF conversion of a model's MTP tensors, tensor by
  tensor (``_weight_to_hf_format`` at world size 1; its ``export_weights`` needs CUDA), after the
  Transformer-Engine renaming its tables expect;
* ``hf_decoder_layers``: transformers' own model of a family with L + N decoder layers, whose layers
  L .. L + N - 1 are the HF decoder layers the MTP layers' transformer layers become.
"""

from __future__ import annotations

import re
from typing import Any, Iterator, Mapping

import torch
from torch import Tensor

from mtp_hooks.testing import TinyDeepSeek, TinyQwen
from mtp_hooks.testing.engine_shapes import DEEPSEEK_V3_STYLE  # what DeepSeek-V3's HF layer computes

VOCAB = 64



def deepseek_v3_shape(mtp_num_layers: int = 2, **overrides: Any) -> TinyDeepSeek:
    """MLA + MoE (dense first layer, MoE MTP layers) as DeepSeek-V3's HF layer holds it."""
    return TinyDeepSeek(vocab_size=VOCAB, mtp_num_layers=mtp_num_layers, config_overrides={**DEEPSEEK_V3_STYLE, **overrides})


def qwen_shape(mtp_num_layers: int = 2, **overrides: Any) -> TinyQwen:
    """Dense GQA with qkv bias and SwiGLU: MiMo's (Qwen2's) layer."""
    return TinyQwen(vocab_size=VOCAB, mtp_num_layers=mtp_num_layers, config_overrides=overrides)


def set_expert_bias(model: torch.nn.Module, seed: int = 7) -> None:
    """Give every router's ``expert_bias`` buffer distinct values (mcore starts it at zeros)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("router.expert_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator))


def moe_layers(state: Mapping[str, Any]) -> set[str]:
    """The layer prefixes (``decoder.layers.k`` / ``mtp.layers.i``) that have a router."""
    return {found.group(1) for name in state if (found := re.match(r"^((?:decoder|mtp)\.layers\.\d+)\..*mlp\.router\.weight$", name))}


def transformer_engine_name(name: str, multi_latent: bool, moe_layer: bool) -> str:
    """A local-spec parameter name -> the Transformer-Engine spec's name of the same tensor."""
    name = re.sub(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$", r"mlp.experts.\2.weight\1", name)
    if multi_latent:
        name = name.replace("self_attention.q_layernorm.weight", "self_attention.linear_q_up_proj.layer_norm_weight")
        name = name.replace("self_attention.kv_layernorm.weight", "self_attention.linear_kv_up_proj.layer_norm_weight")
    else:
        name = name.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
    if not moe_layer:
        name = name.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
    return name


def transformer_engine_names(state: Mapping[str, Any], multi_latent: bool) -> dict[str, Any]:
    """``state`` (a local-spec GPTModel's state dict) under Transformer Engine's names."""
    moe = moe_layers(state)
    out = {}
    for name, value in state.items():
        layer = re.match(r"^((?:decoder|mtp)\.layers\.\d+)\.", name)
        out[transformer_engine_name(name, multi_latent, bool(layer) and layer.group(1) in moe)] = value
    return out


def mtp_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """The model's MTP tensors (parameters and the routers' ``expert_bias``) by mcore name."""
    return {name: tensor for name, tensor in model.state_dict().items() if name.startswith("mtp.") and not name.endswith("_extra_state")}


def mbridge_pairs(bridge: Any, model: torch.nn.Module, mtp_only: bool = True, mcore_0_16_names: bool = True) -> Iterator[tuple[str, Tensor]]:
    """mbridge's HF pairs of the model's MTP tensors (``mtp_only=False``: of all its tensors), its
    ``_weight_to_hf_format`` tensor by tensor after the Transformer-Engine renaming.

    mbridge 0.15.1 knows the MTP layer's transformer layer as ``transformer_layer`` only; with
    ``mcore_0_16_names`` the names of mcore 0.17+ (``mtp_model_layer``) are handed to it so.
    """
    state = {name: t for name, t in model.state_dict().items() if not name.endswith("_extra_state")}
    if mtp_only:
        state = {name: t for name, t in state.items() if name.startswith("mtp.")}
    renamed = transformer_engine_names(state, bool(getattr(model.config, "multi_latent_attention", False)))
    for name, tensor in renamed.items():
        if mcore_0_16_names:
            name = re.sub(r"^(mtp\.layers\.\d+)\.mtp_model_layer\.", r"\1.transformer_layer.", name)
        names, tensors = bridge._weight_to_hf_format(name, tensor)
        yield from zip(names, tensors)


def hf_decoder_layers(family_config: Any, mtp_num_layers: int) -> dict[str, Tensor]:
    """transformers' model of ``family_config`` (a family's HF config with L decoder layers) built
    with L + N layers: the state of its layers L .. L + N - 1, by name."""
    from tests.support.bridge_models import hf_model_class

    settings = family_config.to_dict()
    settings.pop("layer_types", None)  # recomputed for the new layer count (Qwen2)
    num_layers = family_config.num_hidden_layers
    settings["num_hidden_layers"] = num_layers + mtp_num_layers
    config = type(family_config)(**settings)
    model = hf_model_class(family_config)(config)
    wanted = tuple(f"model.layers.{num_layers + i}." for i in range(mtp_num_layers))
    return {name: tensor for name, tensor in model.state_dict().items() if name.startswith(wanted)}
