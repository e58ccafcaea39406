"""The MTP layers' weights under a rollout engine's names: what the trained draft is in vLLM and SGLang.

``mtp_hf_weights(model, layout)`` yields ``(hf_name, tensor)`` pairs for a model's MTP layers, in
the form vLLM's ``model.load_weights`` and verl's ``per_tensor_generator`` take, gathered to full
tensors over TP, EP and (by default) PP, whether or not ``mtp_hooks`` are attached. With a bridge
for the main model, ``check_bridge_export`` checks its MTP tensors against these (and names the
bridges' known defects), ``replace_mtp_weights`` swaps them in its weight stream. Without one,
``hf_weights`` yields the whole model (main + MTP) the same way, and ``save_hf_folder`` writes it
as an HF folder vLLM loads, with its ``config.json`` derived from the mcore config (``hf_config``).

* ``layouts``: the layouts (``"deepseek_v3"``, ``"mimo"``) and what each requires of a model;
* ``names``: mcore's names (Transformer Engine or local) -> HF decoder-layer names;
* ``convert``: the gate/up and QKV splits, MiMo's swapped input halves;
* ``gather``: TP shards and EP experts to full tensors; ``pipeline``: from the MTP stage to all;
* ``weights``: ``mtp_hf_weights``, ``mtp_hf_weights_from_state_dict``; ``whole``: ``hf_weights``;
* ``families``: ``hf_config``, ``FAMILIES``; ``folder``: ``save_hf_folder``, ``write_hf_folder``;
* ``bridges``: ``check_bridge_export``, ``BridgeExportError``, ``replace_mtp_weights``.
"""

from mtp_hooks.export.bridges import KNOWN_DEFECTS, BridgeExportError, check_bridge_export, replace_mtp_weights
from mtp_hooks.export.families import FAMILIES, hf_config
from mtp_hooks.export.folder import save_hf_folder, write_hf_folder
from mtp_hooks.export.layouts import LAYOUTS, Layout
from mtp_hooks.export.weights import mtp_hf_weights, mtp_hf_weights_from_state_dict
from mtp_hooks.export.whole import hf_weights

__all__ = [
    "FAMILIES",
    "KNOWN_DEFECTS",
    "LAYOUTS",
    "BridgeExportError",
    "Layout",
    "check_bridge_export",
    "hf_config",
    "hf_weights",
    "mtp_hf_weights",
    "mtp_hf_weights_from_state_dict",
    "replace_mtp_weights",
    "save_hf_folder",
    "write_hf_folder",
]
