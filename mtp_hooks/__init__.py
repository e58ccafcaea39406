"""Train Multi-Token Prediction layers of Megatron-Core models inside RL loops, with hooks.

``attach(model)`` makes a GPTModel with MTP layers return main-head logits while its MTP
layers keep training on the same micro-batch; ``remove()`` restores stock mcore exactly.

Importing ``mtp_hooks`` imports ``megatron.core`` (about 3 s on a 2-core CPU, most of it torch's
dynamo / inductor and ``torch.distributed.tensor``, which megatron-core loads; ``mtp_hooks`` itself
takes milliseconds). megatron-core's import-time notices that Transformer Engine, Apex or absl are not
installed are silenced for the length of that import only; every other warning is left alone.
"""

import warnings as _warnings

with _warnings.catch_warnings():
    # megatron-core's notices, at import, that it falls back from optional fused kernels.
    _warnings.filterwarnings(
        "ignore", message=r"(Transformer Engine and Apex are|Apex is|absl\.logging is) not installed", category=UserWarning, module=r"megatron\."
    )
    from mtp_hooks.errors import MTPHooksError, MTPHooksStateError
    from mtp_hooks.api import attach, attached, hooks_of
    from mtp_hooks.handle import MTPHooks
    from mtp_hooks.ops.logprobs import TokenLogProbs
    from mtp_hooks.targets import mtp_targets

__all__ = ["MTPHooks", "MTPHooksError", "MTPHooksStateError", "TokenLogProbs", "attach", "attached", "hooks_of", "mtp_targets"]
__version__ = "0.3.0"
