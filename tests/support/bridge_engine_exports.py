"""The bridge families' whole-model exports through mbridge 0.15.1, for the engine to load (a separate process).

Test-only support for ``tests/engine/test_engine_bridges.py``. mbridge reads transformers 4.57.1 and
vLLM 5.19: they cannot share a process, so this runs in the bridges environment (``make bridges-env``:
``.venv`` with ``.bridges/py311`` first on ``PYTHONPATH``) and writes, per case, to ``OUT/<case>/``:

* ``bridge.safetensors``: mbridge's stream of the whole model (``_weight_to_hf_format`` tensor by
  tensor), the last of two pairs under one name kept, as a stream into the engine's loader keeps it;
* ``fixed.safetensors``: the same stream with its MTP pairs replaced by ``mtp_hf_weights``'
  (``replace_mtp_weights``), what verl's stream becomes with the fix;
* ``config.json``: the bridge's HF config, as vLLM reads it;

and ``OUT/report.json``: per case, what ``check_bridge_export`` says of mbridge's MTP pairs, what
mbridge raised (if it did), and the acceptance the mcore weights predict (``predicted``).

The families are the bridge-built ones (``tests/support/bridge_models.py``) at vLLM's CPU kernel sizes
with the counting target of ``tests/support/engine_models.py``:

* ``mimo``: a copy draft; mbridge does not swap ``input_proj``'s halves;
* ``deepseek_v3``: a copy draft; mbridge's MTP mapping asserts 61 decoder layers: its bridge for a
  61-layer config names the MTP layer ``model.layers.61`` (this model has 2 decoder layers);
* ``glm4_moe_depth2``: MTP layer 1 a copy draft, layer 2 random; mbridge writes both under layer L's
  names (vLLM drafts with layer 1 only, for every step);
* ``glm4_moe``: one MTP layer, a copy draft; mbridge's export is right.

Usage: ``python -m tests.support.bridge_engine_exports OUT``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from torch import Tensor

SIZES: dict[str, dict[str, Any]] = {  # vLLM's CPU kernels: head sizes 32, 64, ...; MLA only with 512 + 64
    "deepseek_v3": dict(num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=512, q_lora_rank=64, qk_nope_head_dim=32,
                        qk_rope_head_dim=64, v_head_dim=32, moe_intermediate_size=64),
    "glm4_moe": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=64),
    "mimo": dict(num_attention_heads=4, num_key_value_heads=2),
}
CASES = {  # case: (family, MTP layers, draft of each MTP layer)
    "mimo": ("mimo", 1, ("copy",)),
    "deepseek_v3": ("deepseek_v3", 1, ("copy",)),
    "glm4_moe_depth2": ("glm4_moe", 2, ("copy", "random")),
    "glm4_moe": ("glm4_moe", 1, ("copy",)),
}
LAYOUTS = {"deepseek_v3": "deepseek_v3", "glm4_moe": "deepseek_v3", "mimo": "mimo"}


def _sizes(family: str) -> dict[str, Any]:
    from mtp_hooks.testing import engine_models as em

    return dict(hidden_size=em.HIDDEN, intermediate_size=2 * em.HIDDEN, rms_norm_eps=em.EPS, **SIZES[family])


def _as_dict(pairs: Iterable[tuple[str, Tensor]]) -> tuple[dict[str, Tensor], list[str]]:
    out: dict[str, Tensor] = {}
    repeated = []
    for name, tensor in pairs:
        if name in out:
            repeated.append(name)
        out[name] = tensor.detach().to(torch.bfloat16).contiguous().clone()
    return out, repeated


def _hf_config(bridge: Any, family: str) -> dict[str, Any]:
    config = bridge.hf_config.to_dict()
    config.pop("torch_dtype", None)
    config.update(dtype="bfloat16", bos_token_id=0, eos_token_id=1)
    if family == "deepseek_v3":  # the real config.json's fields transformers' class does not keep
        config.update(topk_method="noaux_tc", scoring_func="sigmoid")
    if family == "mimo":
        config["model_type"] = "qwen2"  # transformers has no "mimo"; vLLM picks the class by architectures
    return config


def export_case(case: str, out: Path) -> dict[str, Any]:
    from safetensors.torch import save_file

    from mtp_hooks.export import BridgeExportError, check_bridge_export, replace_mtp_weights
    from mtp_hooks.testing import moe_mla_on_cpu
    from mtp_hooks.testing import engine_models as em
    from tests.support.bridge_models import BridgeModel
    from tests.support.export_cases import mbridge_pairs

    family, depth, drafts = CASES[case]
    layout = LAYOUTS[family]
    shape = BridgeModel(family, depth, em.VOCAB, num_layers=em.LAYERS, sizes=_sizes(family))
    with moe_mla_on_cpu():
        model = shape.build(seed=0)
    em.set_count_weights(model, "copy")
    with torch.no_grad():
        for index, draft in enumerate(drafts):
            model.state_dict(keep_vars=True)[f"mtp.layers.{index}.eh_proj.weight"].copy_(em.draft_matrix(draft, seed=index))
    report: dict[str, Any] = {"family": family, "depth": depth, "drafts": list(drafts), "layout": layout}
    report["predicted"] = em.predicted_acceptance(model.state_dict()["mtp.layers.0.eh_proj.weight"], em.counting_prompts(), 64)
    bridge = shape.bridge()
    error: Optional[str] = None
    try:
        stream = list(mbridge_pairs(bridge, model, mtp_only=False))
    except AssertionError as raised:
        error = f"AssertionError: {raised}"
        bridge = BridgeModel(family, depth, em.VOCAB, num_layers=61, sizes=_sizes(family)).bridge()  # its mapping's L
        stream = list(mbridge_pairs(bridge, model, mtp_only=False))
    report["mbridge_error"] = error
    try:
        report["check"] = {"passes": check_bridge_export(iter(stream), model, layout)}
    except BridgeExportError as raised:
        report["check"] = {"kind": raised.kind, "name": raised.name, "defect": raised.defect}
    tensors, repeated = _as_dict(stream)
    report["repeated"] = repeated
    fixed, _ = _as_dict(replace_mtp_weights(iter(stream), model, layout))
    folder = out / case
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "bridge.safetensors"), metadata={"format": "pt"})
    save_file(fixed, str(folder / "fixed.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(_hf_config(shape.bridge(), family), indent=2))
    return report


def main(argv: list[str]) -> int:
    from mtp_hooks.testing import cuda_current_device_is_cpu, init_parallel

    out = Path(argv[0])
    with cuda_current_device_is_cpu():
        init_parallel()
        report = {case: export_case(case, out) for case in CASES}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
