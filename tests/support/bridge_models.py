"""DeepSeek-V3, GLM-4.5 and MiMo as verl's model bridge (``mbridge``) configures them, on CPU.

Test-only support for ``tests/integrations/test_bridges.py``. Each family starts from transformers' own config
class (``DeepseekV3Config``, ``Glm4MoeConfig``, ``Qwen2Config`` as MiMo) with the published
model's settings, scaled down in size only (layers, hidden, vocabulary, experts). ``mbridge``
turns it into the mcore ``TransformerConfig`` and the ``GPTModel`` arguments, exactly as verl
gets them. Two things are replaced, because the bridge's own choices need GPU kernels:

* the CPU overrides (``CPU_OVERRIDES``), given through the bridge's ``set_extra_args``: fp32,
  CPU initialisation, fusions off, sequential experts and the allgather dispatcher;
* the layer specs: mcore's own ``get_gpt_decoder_block_spec`` / ``get_gpt_mtp_block_spec`` with
  the local backend (the bridges hard-code Transformer Engine there), with the CPU attention of
  ``tests.support.mcore_cpu`` / ``tests.support.mcore_moe``.

Three bridge breakages are worked around here, each pinned by a test that fails once the
bridge fixes it (``tests/integrations/test_bridges.py``): ``DeepseekV3Bridge`` passes ``max_position_embeddings``
to ``MLATransformerConfig`` (mcore calls it ``original_max_position_embeddings``);
``GLM4MoEBridge`` never sets ``mtp_num_layers``; ``MimoBridge._get_gptmodel_args`` builds a
Transformer-Engine MTP spec.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any, Optional

import torch

from mtp_hooks.testing import cpu_safe_config, environ_kept

# mbridge's notices at import time (no Apex), as conftest.py silences megatron's.
warnings.filterwarnings("ignore", category=UserWarning, module=r"mbridge\.")

# mbridge and the transformers release it reads come from requirements/bridges.txt (make bridges-env).
try:
    import transformers
except ImportError:  # the families' configs need it; so does every bridge
    transformers = None
try:
    import mbridge  # noqa: F401
except ImportError as error:
    BRIDGES_MISSING: Optional[str] = (
        f"mbridge / transformers not importable ({error}); `make test-bridges` runs these with requirements/bridges.txt"
    )
else:
    BRIDGES_MISSING = None

FAMILIES = ("deepseek_v3", "glm4_moe", "mimo")
MOE_FAMILIES = ("deepseek_v3", "glm4_moe")

# What the bridges set for GPUs, replaced for a CPU run (names a release lacks are left out):
# mtp_hooks.testing.cpu_safe_config (CPU initialisation, fusions off) and the MoE settings.
CPU_OVERRIDES: dict[str, Any] = cpu_safe_config(
    cross_entropy_loss_fusion=False,
    moe_permute_fusion=False,
    moe_router_fusion=False,
    moe_grouped_gemm=False,  # SequentialMLP: grouped GEMM needs Transformer Engine or grouped_gemm
    moe_token_dispatcher_type="allgather",
    variable_seq_lengths=False,  # mcore refuses variable lengths with the allgather dispatcher
    moe_shared_expert_overlap=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


@dataclasses.dataclass(frozen=True)
class Family:
    """One family as transformers holds it: its config and model classes, and the published model's
    ``config.json`` settings scaled down in size only (layers, hidden, vocabulary, experts).

    ``model_type`` is set on the config where the bridge registers the family under another name than
    the class's: MiMo runs on ``Qwen2Config`` (the real ``MiMoConfig`` is remote code) as ``"mimo"``.
    """

    config_class: str
    model_class: str  # transformers' own model of the family (``tests.support.export_cases.hf_decoder_layers``)
    settings: dict[str, Any]
    model_type: Optional[str] = None


# What every family shares, then what the two MoE families share; each family's own settings grouped as
# attention, positions and MoE.
_EVERY_FAMILY: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, hidden_act="silu", tie_word_embeddings=False
)
_MOE: dict[str, Any] = dict(
    moe_intermediate_size=16, first_k_dense_replace=1, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
    topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
)
_YARN = dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
HF_FAMILIES: dict[str, Family] = {
    "deepseek_v3": Family(  # deepseek-ai/DeepSeek-V3
        "DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
            num_key_value_heads=4, attention_bias=False,
            kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,  # MLA
            max_position_embeddings=163840, rope_theta=10000, rope_scaling=_YARN, rms_norm_eps=1e-6,
            **_MOE, n_group=2, aux_loss_alpha=0.001, architectures=["DeepseekV3ForCausalLM"],
        ),
    ),
    "glm4_moe": Family(  # zai-org/GLM-4.5; heads * head_dim != hidden_size, as in GLM-4.5 (96 * 128 vs 5120)
        "Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
            num_key_value_heads=2, head_dim=16, use_qk_norm=True, attention_bias=True,
            max_position_embeddings=131072, rope_theta=1000000, partial_rotary_factor=0.5, rms_norm_eps=1e-5,
            **_MOE, n_group=1, architectures=["Glm4MoeForCausalLM"],
        ),
    ),
    "mimo": Family(  # XiaomiMiMo/MiMo-7B
        "Qwen2Config", "Qwen2ForCausalLM", dict(
            num_key_value_heads=2, max_position_embeddings=32768, rope_theta=640000, use_sliding_window=False, rms_norm_eps=1e-5,
            architectures=["MiMoForCausalLM"],
        ),
        model_type="mimo",
    ),
}


def hf_config(family: str, depth: Optional[int] = 1, vocab_size: int = 64, num_layers: int = 2, sizes: Optional[dict[str, Any]] = None) -> Any:
    """transformers' config of ``family`` (one of ``FAMILIES``) with ``depth`` MTP layers (``None``: no MTP)
    after ``num_layers`` decoder layers; ``sizes`` replace the tiny sizes (e.g. the engine's kernel sizes)."""
    if family not in HF_FAMILIES:
        raise ValueError(f"family: expected one of {FAMILIES}, received {family!r}")
    spec = HF_FAMILIES[family]
    extra = {} if depth is None else {"num_nextn_predict_layers": depth}
    settings = {**_EVERY_FAMILY, **spec.settings, "num_hidden_layers": num_layers, **extra, **(sizes or {})}
    config = getattr(transformers, spec.config_class)(vocab_size=vocab_size, **settings)
    if spec.model_type is not None:
        config.model_type = spec.model_type
    return config


def hf_model_class(config: Any) -> type:
    """transformers' model class of a family's config (``hf_config``'s), found by its config class."""
    model_class = next(spec.model_class for spec in HF_FAMILIES.values() if spec.config_class == type(config).__name__)
    return getattr(transformers, model_class)


def _renaming_mla_config(**kwargs: Any) -> Any:
    """``MLATransformerConfig`` taking mbridge's ``max_position_embeddings`` under mcore's name."""
    from megatron.core.transformer import MLATransformerConfig

    if "max_position_embeddings" in kwargs:
        kwargs["original_max_position_embeddings"] = kwargs.pop("max_position_embeddings")
    return MLATransformerConfig(**kwargs)


def bridge_class(family: str) -> type:
    """The bridge class mbridge registers for ``family`` (its ``AutoBridge`` picks it by ``model_type``)."""
    from mbridge.core.bridge import _MODEL_REGISTRY

    return _MODEL_REGISTRY[family]


def _deepseek_v3_bridge_class() -> type:
    """``DeepseekV3Bridge`` building its config with the keyword renamed (workaround 1)."""
    base = bridge_class("deepseek_v3")
    return type("DeepseekV3BridgeOnThisMcore", (base,), {"TransformerConfigClass": staticmethod(_renaming_mla_config)})


def cpu_overrides(config_class: type) -> dict[str, Any]:
    """``CPU_OVERRIDES`` less the names ``config_class`` (an mcore config dataclass) does not have."""
    names = {field.name for field in dataclasses.fields(config_class)}
    return {name: value for name, value in CPU_OVERRIDES.items() if name in names}


def _field_default(config_class: type, name: str) -> Any:
    return {field.name: field.default for field in dataclasses.fields(config_class)}[name]


def make_bridge(family: str, depth: Optional[int] = 1, vocab_size: int = 64, num_layers: int = 2, sizes: Optional[dict[str, Any]] = None) -> Any:
    """mbridge's bridge for ``family`` with the CPU overrides (the three workarounds applied)."""
    config = hf_config(family, depth, vocab_size, num_layers, sizes)
    if family == "deepseek_v3":
        bridge = _deepseek_v3_bridge_class()(config, dtype=torch.float32)
    else:
        from mbridge import AutoBridge

        bridge = AutoBridge.from_config(config, dtype=torch.float32)
    extra = cpu_overrides(type(bridge.config))
    if family == "glm4_moe" and depth is not None:
        # workaround 2: GLM4MoEBridge never sets mtp_num_layers; nor its loss weight, which has no
        # default before mcore 0.16 (0.1 then, as the bridge gives DeepSeek-V3 and MiMo)
        extra["mtp_num_layers"] = depth
        if _field_default(type(bridge.config), "mtp_loss_scaling_factor") is None:
            extra["mtp_loss_scaling_factor"] = 0.1
    bridge.set_extra_args(**extra)
    return bridge


def gptmodel_args(bridge: Any) -> dict[str, Any]:
    """The bridge's ``GPTModel`` arguments (vocabulary, positions, RoPE), without its MTP spec.

    ``MimoBridge`` adds a Transformer-Engine MTP spec there (workaround 3): its parent's
    arguments are taken instead, and the MTP spec is built locally like every family's.
    """
    from mbridge.models.qwen2 import Qwen2Bridge

    if type(bridge).__name__ == "MimoBridge":
        return Qwen2Bridge._get_gptmodel_args(bridge)
    return bridge._get_gptmodel_args()


@dataclasses.dataclass
class BridgeModel:
    """Shape of one bridge-built family: ``num_layers`` decoder layers, ``mtp_num_layers`` MTP layers (``None``: none).

    ``build(seed)`` gives identical twins for the same seed (``tests.support.twins.Twins`` takes it as a
    shape). Build inside ``tests.support.mcore_moe.moe_mla_on_cpu()`` (MoE router and MLA on CPU).
    """

    family: str
    mtp_num_layers: Optional[int] = 1
    vocab_size: int = 64
    num_layers: int = 2
    sizes: dict[str, Any] = dataclasses.field(default_factory=dict)  # over the tiny sizes (hf_config)

    def bridge(self) -> Any:
        return make_bridge(self.family, self.mtp_num_layers, self.vocab_size, self.num_layers, self.sizes)

    def config(self) -> Any:
        return self.bridge().config

    @property
    def tied(self) -> bool:
        return bool(getattr(hf_config(self.family, self.mtp_num_layers, self.vocab_size, self.num_layers, self.sizes), "tie_word_embeddings", False))

    def without_mtp(self) -> "BridgeModel":
        return dataclasses.replace(self, mtp_num_layers=None)

    def build(self, seed: int = 1234, **model_kwargs: Any) -> torch.nn.Module:
        """The ``GPTModel`` from the bridge's config and arguments with mcore's local specs."""
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        from tests.support.mcore_cpu import SDPAttention, _replace_module_class
        from tests.support.mcore_moe import MLACoreAttention

        bridge = self.bridge()
        config = bridge.config
        torch.manual_seed(seed)
        block_kwargs: dict[str, Any] = {"normalization": config.normalization}
        if "vp_stage" in inspect.signature(get_gpt_decoder_block_spec).parameters:
            block_kwargs["vp_stage"] = model_kwargs.get("vp_stage")
        decoder_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, **block_kwargs)
        core_attention = MLACoreAttention if getattr(config, "multi_latent_attention", False) else SDPAttention
        _replace_module_class(decoder_spec, DotProductAttention, core_attention)
        mtp_spec = None
        if config.mtp_num_layers:
            mtp_spec = get_gpt_mtp_block_spec(
                config, decoder_spec, use_transformer_engine=False, vp_stage=model_kwargs.get("vp_stage")
            )
        with environ_kept():  # mcore's NVTE_* attention variables: DeepSeek-V3's bridge asks for fused
            return GPTModel(
                config=config,
                transformer_layer_spec=decoder_spec,
                share_embeddings_and_output_weights=self.tied,
                mtp_block_spec=mtp_spec,
                **gptmodel_args(bridge),
                **model_kwargs,
            )


def without_mtp_copy(model: torch.nn.Module, shape: Any) -> torch.nn.Module:
    """The same family built without MTP layers, holding ``model``'s decoder, embedding and head weights.

    The reference for what the MTP layers must not change: inference FLOPs, and with
    ``detach_encoder`` the decoder's and embedding's gradients.
    """
    twin = shape.without_mtp().build()
    weights = {name: value for name, value in model.state_dict().items() if not name.startswith("mtp.")}
    result = twin.load_state_dict(weights, strict=False)
    missing = [key for key in result.missing_keys if not key.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise AssertionError(f"without-MTP copy: missing {missing}, unexpected {result.unexpected_keys}")
    return twin


def assert_routers_and_experts_trained(model: torch.nn.Module, family: str) -> None:
    """Every MTP parameter, router and expert got a non-zero gradient (so the comparison is not vacuous)."""
    trained = [name for name, p in model.named_parameters() if p.grad is not None and bool(p.grad.any())]
    names = [name for name, _ in model.named_parameters()]
    routers = [name for name in names if ".mlp.router." in name]
    experts = [name for name in names if ".mlp.experts." in name]
    if family in MOE_FAMILIES:
        assert any(name.startswith("mtp.") for name in routers), "no router in the MTP layers"
        assert routers and experts
    else:
        assert not routers and not experts
    wanted = routers + experts + [name for name in names if name.startswith("mtp.")]
    assert wanted and not [name for name in wanted if name not in trained], "parameters without gradient"
