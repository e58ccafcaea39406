"""The bridges' MTP defects as the engine shows them, and as ``check_bridge_export`` names them.

mbridge 0.15.1 (verl's bridge) exports the bridge-built families (``tests/support/bridge_models.py``,
at vLLM's CPU kernel sizes, counting target, copy drafts) in a separate process, in the bridges
environment (``tests/support/bridge_engine_exports.py``: mbridge's transformers 4.57.1 cannot share a
process with vLLM's 5.19). Each export is loaded by vLLM as a whole-model checkpoint, then the fix
(its MTP pairs replaced by ``mtp_hf_weights``', ``replace_mtp_weights``) is pushed into the same engine:

| case | mbridge's MTP pairs | the check | engine, mbridge's | engine, fixed |
|---|---|---|---|---|
| MiMo | ``input_proj`` halves not swapped | different / swapped | 0.000 | 1.000 |
| DeepSeek-V3 | asserts 61 layers; at a 61-layer config, ``model.layers.61`` | misnamed / 61 | refused (``KeyError`` from a folder; streamed, ``ValueError``: layer 2 missing) | 1.000 |
| GLM-4.5, 2 MTP layers | both layers under layer L's names | repeated / same | refused from a folder; streamed, drafts with layer 2's weights | 1.000 |
| GLM-4.5, 1 MTP layer | right | passes | 1.000 | 1.000 |

Each mbridge row is a pinned defect: its test fails once mbridge fixes it (then drop the pin).
Needs ``.venv`` and ``.bridges/py311`` (``make test-engine`` builds them); fails without them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from mtp_hooks.engine import VLLMSync, generate_greedy
from mtp_hooks.errors import MTPHooksError
from mtp_hooks.export import LAYOUTS
from mtp_hooks.testing import engine_models as em

ROOT = Path(__file__).resolve().parents[2]
BRIDGES_PYTHON = ROOT / ".venv" / "bin" / "python"
BRIDGES_OVERLAY = ROOT / ".bridges" / "py311"
PROMPTS = em.counting_prompts(16)
TOKENS = 64


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Run the exports in the bridges environment once; ``(folder, report)``."""
    missing = [str(p) for p in (BRIDGES_PYTHON, BRIDGES_OVERLAY) if not p.exists()]
    assert not missing, f"the bridges environment is missing ({', '.join(missing)}): make bridges-env BRIDGES_VERSIONS=0.16.1"
    out = tmp_path_factory.mktemp("bridges")
    # its own process group (not this one's port), no preloaded OpenMP, none of the NVTE_* attention
    # variables that building mcore models here set
    dropped = ("LD_PRELOAD", "PYTHONHOME", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in dropped and not k.startswith("NVTE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(BRIDGES_OVERLAY), str(ROOT)])
    done = subprocess.run([str(BRIDGES_PYTHON), "-m", "tests.support.bridge_engine_exports", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads((out / "report.json").read_text())


def _folder(exports: tuple[Path, dict[str, Any]], case: str, which: str) -> Path:
    """An HF folder of ``case`` holding mbridge's export (``which="bridge"``) or the fixed one."""
    out, _ = exports
    folder = out / f"{case}-{which}"
    if not folder.exists():
        folder.mkdir()
        shutil.copy(out / case / "config.json", folder / "config.json")
        shutil.copy(out / case / f"{which}.safetensors", folder / "model.safetensors")
        em.write_tokenizer(folder)
    return folder


def _mtp_pairs(exports: tuple[Path, dict[str, Any]], case: str) -> list[tuple[str, torch.Tensor]]:
    """The fixed stream's MTP pairs: what ``mtp_hf_weights`` gives for this model."""
    from safetensors.torch import load_file

    out, report = exports
    layout = LAYOUTS[report[case]["layout"]]
    fixed = load_file(str(out / case / "fixed.safetensors"))
    return [(name, tensor) for name, tensor in fixed.items() if layout.mtp_layer_of(name, em.LAYERS) is not None]


def _served_fixed(exports: tuple[Path, dict[str, Any]], case: str, llm: Any) -> float:
    """Push the fixed MTP pairs into ``llm``, check them, and measure the first draft position."""
    sync = VLLMSync(llm)
    pairs = _mtp_pairs(exports, case)
    sync.push(pairs)
    sync.check(pairs)
    return generate_greedy(llm, PROMPTS, TOKENS).per_position[0]


def test_mbridge_mimo_draft_is_never_accepted_by_the_engine_and_the_check_names_it(exports: Any, engines: Callable[..., Any]) -> None:
    report = exports[1]["mimo"]
    assert report["predicted"] == 1.0 and report["mbridge_error"] is None
    assert report["check"] == {"kind": "different", "name": "model.mtp_layers.0.input_proj.weight", "defect": "swapped"}
    llm = engines(_folder(exports, "mimo", "bridge"), 1)
    assert generate_greedy(llm, PROMPTS, TOKENS).per_position[0] <= 0.01  # the perfect draft, halves swapped
    assert _served_fixed(exports, "mimo", llm) == 1.0


def test_mbridge_deepseek_v3_mtp_mapping_needs_61_layers_the_engine_refuses_it_and_the_check_names_it(exports: Any, engines: Callable[..., Any]) -> None:
    report = exports[1]["deepseek_v3"]
    assert report["predicted"] == 1.0
    assert "only support 61 layers" in report["mbridge_error"]
    assert report["check"] == {"kind": "misnamed", "name": "model.layers.2.enorm.weight", "defect": "61"}  # ours, found at 61
    with pytest.raises(KeyError, match=r"layers\.61\."):
        engines(_folder(exports, "deepseek_v3", "bridge"), 1)  # the target model has no layer 61
    llm = engines(_folder(exports, "deepseek_v3", "fixed"), 1)
    assert generate_greedy(llm, PROMPTS, TOKENS).per_position == (1.0,)
    # streamed into the running engine: the draft's loader refuses a stream without its layer
    from safetensors.torch import load_file

    out, _ = exports
    streamed = [(n, t) for n, t in load_file(str(out / "deepseek_v3" / "bridge.safetensors")).items() if n.startswith("model.layers.61.")]
    # (vLLM's ValueError; on a CPU with AMX the push's own MTPHooksError first, before anything changes)
    with pytest.raises(ValueError, match=r"MTP speculative decoding layer 2 weights missing|MLA layers without kv_b_proj"):
        VLLMSync(llm).push(streamed)
    assert generate_greedy(llm, PROMPTS, TOKENS).per_position == (1.0,)  # the refused push left the draft as it was
    assert _served_fixed(exports, "deepseek_v3", llm) == 1.0


def test_mbridge_glm4_moe_writes_both_mtp_layers_under_the_first_the_engine_refuses_or_drafts_with_the_second(exports: Any, engines: Callable[..., Any]) -> None:
    from safetensors.torch import load_file

    report = exports[1]["glm4_moe_depth2"]
    assert report["predicted"] == 1.0 and report["drafts"] == ["copy", "random"]
    assert report["check"] == {"kind": "repeated", "name": "model.layers.2.enorm.weight", "defect": "same"}
    assert report["repeated"] == [f"model.layers.2.{leaf}.weight" for leaf in ("enorm", "hnorm", "eh_proj", "shared_head.norm")]
    with pytest.raises(ValueError, match=r"not initialized from checkpoint: .*model\.layers\.3\."):
        engines(_folder(exports, "glm4_moe_depth2", "bridge"), 1)  # loaded from a folder: refused
    llm = engines(_folder(exports, "glm4_moe_depth2", "fixed"), 1)
    assert generate_greedy(llm, PROMPTS, TOKENS).per_position == (1.0,)
    # streamed into the running engine (as verl streams it): layer 1 would take layer 2's tensors, layer 2 none
    out, _ = exports
    layout = LAYOUTS["deepseek_v3"]
    streamed = [(n, t) for n, t in load_file(str(out / "glm4_moe_depth2" / "bridge.safetensors")).items() if layout.mtp_layer_of(n, em.LAYERS) is not None]
    with pytest.raises(MTPHooksError, match=r"(?s)nothing was written.*would leave unwritten \['model\.layers\.3\."):
        VLLMSync(llm).push(streamed)
    assert generate_greedy(llm, PROMPTS, TOKENS).per_position == (1.0,)  # refused before writing: the draft is as it was
    assert _served_fixed(exports, "glm4_moe_depth2", llm) == 1.0


def test_mbridge_glm4_moe_with_one_mtp_layer_is_accepted_as_ours(exports: Any, engines: Callable[..., Any]) -> None:
    report = exports[1]["glm4_moe"]
    assert report["mbridge_error"] is None and report["repeated"] == []
    assert report["check"] == {"passes": len(_mtp_pairs(exports, "glm4_moe"))}
    llm = engines(_folder(exports, "glm4_moe", "bridge"), 1)
    assert generate_greedy(llm, PROMPTS, TOKENS).per_position == (1.0,)
    assert _served_fixed(exports, "glm4_moe", llm) == 1.0
