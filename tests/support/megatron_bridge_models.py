"""DeepSeek-V3, GLM-4.5 and MiMo as NeMo-RL's model bridge (``megatron-bridge``) provides them, on CPU.

Test-only support for ``tests/integrations/test_megatron_bridge.py`` (Python 3.12, megatron-core 0.19.2,
``requirements/bridges-megatron.txt``). The families' transformers configs are those of
``tests/support/bridge_models.py``; megatron-bridge's ``AutoBridge`` turns each into its model provider
(``MLAModelProvider`` / ``GPTModelProvider``, a ``TransformerConfig``), finalised with the same CPU
overrides. Three stand-ins, each only where megatron-bridge needs Transformer Engine:

* importing: ``megatron.bridge`` imports ``transformer_engine.pytorch`` unconditionally
  (``peft/lora_layers.py``). A placeholder module stands in while it imports and is removed
  after; the bridge modules that then cached ``HAVE_TE = True`` get ``False`` back, so the
  providers pick mcore's local decoder spec as they do on a machine without Transformer Engine;
* ``gpt_provider.mtp_block_spec`` hard-codes ``use_transformer_engine=True``: while ``provide()``
  runs, the same call with ``False`` stands in, and is restored after;
* MiMo's provider keeps the Transformer-Engine ``default_layer_spec``: the bridge's own
  ``local_layer_spec`` stands in.

Core attention in the specs is ``tests.support.mcore_cpu.SDPAttention`` / ``tests.support.mcore_moe.MLACoreAttention``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
import sys
import types
from typing import Any, Callable, Iterator, Optional

import torch

from mtp_hooks.testing import environ_kept
from tests.support.bridge_models import CPU_OVERRIDES, hf_config


class _Placeholder(types.ModuleType):
    """A module whose every attribute is another placeholder (``te.ops.Sequential`` in annotations)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


def _import_megatron_bridge() -> None:
    """Import ``megatron.bridge`` without Transformer Engine (see the module docstring)."""
    # mcore decides HAVE_TE from the real import first; with the placeholder present its hybrid
    # specs would build a Transformer Engine spec at import time.
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.models.hybrid.hybrid_layer_specs  # noqa: F401
    import megatron.training  # noqa: F401

    names = ("transformer_engine", "transformer_engine.pytorch")
    if any(name in sys.modules for name in names):
        raise RuntimeError("transformer_engine is already imported: no stand-in needed or possible")
    package = _Placeholder(names[0])
    sys.modules[names[0]], sys.modules[names[1]] = package, package.pytorch
    try:
        import megatron.bridge  # noqa: F401
    finally:
        for name in names:
            del sys.modules[name]
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.bridge") and getattr(module, "HAVE_TE", None) is True:
            module.HAVE_TE = False  # type: ignore[attr-defined]


def _missing() -> Optional[str]:
    if importlib.util.find_spec("megatron.bridge") is None:
        return "megatron-bridge not installed (requirements/bridges-megatron.txt, make test-megatron-bridge)"
    try:
        _import_megatron_bridge()
    except ImportError as error:
        return f"megatron-bridge not importable without Transformer Engine: {error}"
    return None


try:
    MEGATRON_BRIDGE_MISSING: Optional[str] = _missing()
except ModuleNotFoundError as error:  # no megatron package at all
    MEGATRON_BRIDGE_MISSING = f"megatron-bridge not installed ({error})"


def cpu_overrides(provider: Any) -> dict[str, Any]:
    names = {field.name for field in dataclasses.fields(provider)}
    return {name: value for name, value in CPU_OVERRIDES.items() if name in names}


def make_provider(family: str, depth: Optional[int] = 1, vocab_size: int = 64) -> Any:
    """megatron-bridge's finalised provider for ``family`` with the CPU overrides (shipped specs)."""
    from megatron.bridge import AutoBridge
    from megatron.core.process_groups_config import ProcessGroupCollection

    provider = AutoBridge.from_hf_config(hf_config(family, depth, vocab_size)).to_megatron_provider(load_weights=False)
    provider.apply_overrides_and_finalize(dtype=torch.float32, overrides=cpu_overrides(provider))
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()  # as provide_distributed_model sets it
    return provider


def _local_decoder_spec(provider: Any) -> Callable[..., Any]:
    """The provider's decoder spec function, local: MiMo's TE ``default_layer_spec`` -> ``local_layer_spec``."""
    from megatron.bridge.models import gpt_provider

    spec = provider.transformer_layer_spec
    if spec is gpt_provider.default_layer_spec:
        return gpt_provider.local_layer_spec
    return spec


def _with_cpu_attention(spec_function: Callable[..., Any], multi_latent: bool) -> Callable[..., Any]:
    """``spec_function`` whose specs use the CPU core attention of the tests."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from tests.support.mcore_cpu import SDPAttention, _replace_module_class
    from tests.support.mcore_moe import MLACoreAttention

    takes_vp_stage = "vp_stage" in inspect.signature(spec_function).parameters

    def spec(config: Any, vp_stage: Optional[int] = None) -> Any:
        built = spec_function(config, vp_stage=vp_stage) if takes_vp_stage else spec_function(config)
        return _replace_module_class(built, DotProductAttention, MLACoreAttention if multi_latent else SDPAttention)

    return spec


def _local_mtp_block_spec(config: Any, vp_stage: Optional[int] = None) -> Any:
    """``gpt_provider.mtp_block_spec`` with ``use_transformer_engine=False``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    if not getattr(config, "mtp_num_layers", None):
        return None
    spec = config.transformer_layer_spec(config, vp_stage=vp_stage)
    return get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)


@contextlib.contextmanager
def local_mtp_block_spec() -> Iterator[None]:
    """While open, ``provide()`` builds the MTP block from the local backend; restored on exit."""
    from megatron.bridge.models import gpt_provider

    shipped = gpt_provider.mtp_block_spec
    gpt_provider.mtp_block_spec = _local_mtp_block_spec
    try:
        yield
    finally:
        gpt_provider.mtp_block_spec = shipped


@dataclasses.dataclass
class ProvidedModel:
    """Shape of one family as megatron-bridge provides it (``Twins`` takes it as a shape)."""

    family: str
    mtp_num_layers: Optional[int] = 1
    vocab_size: int = 64

    def provider(self) -> Any:
        provider = make_provider(self.family, self.mtp_num_layers, self.vocab_size)
        multi_latent = bool(getattr(provider, "multi_latent_attention", False))
        provider.transformer_layer_spec = _with_cpu_attention(_local_decoder_spec(provider), multi_latent)
        return provider

    def without_mtp(self) -> "ProvidedModel":
        return dataclasses.replace(self, mtp_num_layers=None)

    def build(self, seed: int = 1234) -> torch.nn.Module:
        provider = self.provider()
        torch.manual_seed(seed)
        with local_mtp_block_spec(), environ_kept():
            return provider.provide()
