"""The ``TransformerConfig`` settings that keep a tiny mcore model off CUDA-only kernels.

mcore's defaults turn on fused kernels that need Transformer Engine, Apex or CUDA (gradient
accumulation into ``main_grad``, bias + activation, bias + dropout, RoPE, masked softmax, the
persistent layer norm) and initialise weights on the current CUDA device. ``cpu_safe_config()``
is the one place these are switched off; pass it into ``TransformerConfig(**...)``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["cpu_safe_config"]


def cpu_safe_config(**overrides: Any) -> dict[str, Any]:
    """``TransformerConfig`` keyword arguments: CPU weight initialisation, every fused kernel off.

    Args:
        overrides: settings that replace or extend the defaults (e.g. ``use_cpu_initialization=False``
            for a model built on the GPU).

    Returns:
        A new dict on each call, so the caller may change it.

    Example::

        config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **cpu_safe_config())
    """
    settings: dict[str, Any] = dict(
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
    )
    settings.update(overrides)
    return settings
