"""Train Multi-Token Prediction layers of Megatron-Core models inside RL loops, with hooks.

``attach(model)`` makes a GPTModel with MTP layers return main-head logits while its MTP
layers keep training on the same micro-batch; ``remove()`` restores stock mcore exactly.
"""

from mtp_hooks.errors import MTPHooksError, MTPHooksStateError
from mtp_hooks.hooks import MTPHooks, attach, attached, hooks_of
from mtp_hooks.logprobs import TokenLogProbs
from mtp_hooks.targets import mtp_targets

__all__ = ["MTPHooks", "MTPHooksError", "MTPHooksStateError", "TokenLogProbs", "attach", "attached", "hooks_of", "mtp_targets"]
__version__ = "0.2.0"
