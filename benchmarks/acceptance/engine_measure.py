"""The drafts of an RL run measured by vLLM: each variant's weights pushed into one running engine per k.

For each evaluation step of the run (a ``Snapshot``: held-out prompts and every variant's state) and
each k = 1..K, in one process, one engine at a time (an in-process vLLM engine's metrics belong to
the last one started):

* an engine without speculation takes the step's main weights (``VLLMSync.push(..., model="target")``,
  then ``check``) and generates the prompts greedily (the target's continuation, K tokens past the run's end, so
  the trainer can score the last drafts) and at the rollouts' temperature: the wall times without speculation;
* an engine with ``method="mtp", num_speculative_tokens=k`` takes the same main weights, then per
  variant its MTP layers (``push`` + ``check``), and generates the same prompts at the rollouts' temperature T
  (prompt i seeded ``seed + i``, the same seeds for every variant and k) and greedily, reporting per run its
  per-position acceptance, mean acceptance length and wall time;
* the trainer predicts that acceptance from the variant's weights on the engine's own tokens, with
  the hooks under the engine's rule and schedule (``attach(draft_steps=k, draft_inputs="argmax",
  accept_rule="argmax", draft_layers="first")``: vLLM 0.32 runs MTP layer 1 for every step), by
  ``mtp_hooks.predict``, with the hidden state vLLM's MiMo drafter reads (the target's
  before the final norm, ``predicted_accept_j``) and with the one mcore trains the MTP layers on (after
  it, ``predicted_as_trained_accept_j``): the MiMo layout's train / serve skew. At T > 0 the replay is as exact as
  at T = 0: vLLM drafts the argmax and keeps draft j with probability p_T(draft), and a rejected draft's replacement
  is drawn from p_T with the draft's token removed, so draft j was kept exactly where the engine's token there equals
  it. The T = 0 measurement is the ``greedy_`` fields;
* beside each sampled measurement, what bounds it (``ceiling_hits``): the acceptance a draft proposing the target's
  own argmax would get on the same tokens (``ceiling_accept_j``, ``ceiling_accept_len``; no draft does better in
  expectation under vLLM's argmax rule), and the standard error of the acceptance length over the prompts
  (``accept_len_se``, from the replay, which counts what the engine counts): how far apart two variants must be
  before one evaluation can tell them apart.

The checkpoint vLLM starts from is written in float32 (the engine computes in float32), so at T = 0
the engine and the fp32 trainer pick the same argmax. It declares one MTP layer, the trainer's layer
1: vLLM 0.32 runs only that layer whatever the count, and refuses a ``num_speculative_tokens`` the
declared count does not divide ("num_speculative_tokens:3 must be divisible by n_predict=2"), so a
2-layer checkpoint could not draft k = 3. The engine's drafts are the same either way (k = 2 on a
2-layer checkpoint runs layer 1 twice: ``tests/engine/test_engine_layer_schedule.py``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

import mtp_hooks
from benchmarks.acceptance.drafts import positions
from benchmarks.acceptance.settings import Setting, build_model
from mtp_hooks.engine import VLLMSync, generate_greedy, generate_sampled, start_vllm, stop_vllm
from mtp_hooks.export import mtp_hf_weights
from mtp_hooks.testing import engine_models as em
from mtp_hooks.predict import Replay, draft_hits, engine_sequences, replay

FAMILY, LAYOUT = "mimo", "mimo"
# vLLM 0.32's schedule and rule at T = 0: what the trainer predicts with.
ENGINE_RULE: dict[str, Any] = dict(draft_inputs="argmax", accept_rule="argmax", draft_layers="first", agreement_metrics=True)
# vLLM's MiMo drafter reads the target's hidden state before the final norm; mcore trains on it after the norm.
ENGINE_MTP_INPUT = "pre_final_norm"
# vLLM's drafters zero MTP layer 1's token embedding at each sequence's position 0; mcore trains with it.
ENGINE_START = "zeroed"


@dataclasses.dataclass
class Snapshot:
    """One evaluation step: held-out prompts ``[n, P]`` and every variant's state dict."""

    step: int
    prompts: Tensor
    states: dict[str, dict[str, Any]]


ENGINE_LAYER = "model.mtp_layers.0."  # the one MTP layer vLLM 0.32 runs (MiMo's names)


def engine_pairs(model: nn.Module, main: bool) -> list[tuple[str, Tensor]]:
    """The main model's tensors, or MTP layer 1's: what the engine holds (module docstring)."""
    if main:
        return list(em.main_hf_pairs(model, FAMILY))
    return [(name, tensor) for name, tensor in mtp_hf_weights(model, LAYOUT) if name.startswith(ENGINE_LAYER)]


def write_checkpoint(folder: Path, model: nn.Module, vocab: int) -> Path:
    """The float32 HF folder the engines start from: main model and MTP layer 1, declared as one MTP layer."""
    em.write_folder(folder, FAMILY, model.config, engine_pairs(model, True) + engine_pairs(model, False), vocab, torch.float32)
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def push_checked(sync: VLLMSync, model: nn.Module, main: bool) -> None:
    """``model``'s main tensors (or MTP layer 1's) pushed into the engine, then checked there."""
    pairs = engine_pairs(model, main)
    role = "target" if main else "draft"
    sync.push(pairs, model=role)
    sync.check(pairs, model=role)


def _plain(folder: Path, model: nn.Module, snapshots: list[Snapshot], tokens: int, extra: int,
           temperature: float, seeds: list[int]) -> tuple[list[Any], list[float], list[float]]:
    """Per snapshot the target's greedy tokens (``tokens + extra``), and the wall seconds of ``tokens`` without
    speculation greedily and at ``temperature`` (the snapshot's seeds)."""
    llm = start_vllm(str(folder), 0, dtype="float32")
    truth, greedy_seconds, sampled_seconds = [], [], []
    try:
        sync = VLLMSync(llm)
        for snap, seed in zip(snapshots, seeds):
            model.load_state_dict(next(iter(snap.states.values())))  # the main weights are every variant's
            push_checked(sync, model, main=True)
            prompts = snap.prompts.tolist()
            greedy_seconds.append(generate_greedy(llm, prompts, tokens).seconds)
            truth.append(generate_greedy(llm, prompts, tokens + extra).token_ids)
            sampled_seconds.append(generate_sampled(llm, prompts, tokens, temperature, seed).seconds)
    finally:
        stop_vllm(llm)
    return truth, greedy_seconds, sampled_seconds


def ceiling_hits(model: nn.Module, sequences: Tensor, k: int) -> Tensor:
    """``draft_hits``' ``[k, b, s]`` for a draft proposing the target's own argmax: step j at t proposes the token the
    target would pick at t + j + 1 after the true prefix, so it hits where ``sequences`` holds the target's argmax there.
    Under vLLM's rule (keep draft j with probability p_T(draft)) no draft is kept more often: the ceiling."""
    device = next(model.parameters()).device
    hooks = mtp_hooks.attach(model)  # a forward without labels: the main head's logits, the MTP block skipped
    try:
        with torch.no_grad():
            ids = sequences.to(device)
            logits = model(ids, positions(ids), None)
    finally:
        hooks.remove()
    own = (logits[:, :-1].argmax(-1).cpu() == sequences[:, 1:])  # [b, s - 1]: token t + 1 is the argmax after t
    b, s = sequences.shape
    hits = torch.zeros(k, b, s, dtype=torch.bool)
    for j in range(1, k + 1):
        hits[j - 1, :, : s - j - 1] = own[:, j : s - 1]
    return hits


def length_se(hits: Tensor, prompt: int, tokens: int) -> float:
    """The standard error over prompts of the mean acceptance length ``replay`` counts from ``hits`` (a ratio of sums:
    accepted drafts over verification steps, prompt by prompt; the delta method)."""
    rows = [replay(hits[:, r : r + 1], prompt, tokens) for r in range(hits.shape[1])]
    if len(rows) < 2:
        return float("nan")
    drafts = torch.tensor([float(row.drafts) for row in rows])
    accepted = torch.tensor([float(sum(row.accepted_per_position)) for row in rows])
    ratio = accepted.sum() / drafts.sum()
    n = len(rows)
    return float(((accepted - ratio * drafts).pow(2).sum() / (n * (n - 1))).sqrt() / drafts.mean())


def _predict(model: nn.Module, k: int, prompts: list[list[int]], truth: Any, tokens: int,
             diagnostics: bool) -> tuple[Replay, dict[str, Replay], Tensor]:
    """The prediction as vLLM drafts: the hidden state its MiMo drafter reads (before the final norm), the token
    embedding zeroed at position 0, steps 2..k one token at a time over the draft's cache (``geometry="engine"``), and
    its hits (``draft_hits``). With ``diagnostics`` also, by record prefix, the same with one of those left as the
    hooks train it: the MTP input after the norm (``as_trained``: the layout's skew), the embedding kept at position 0
    (``kept_start``), and the hooks' own chain geometry (``chain``: every step over the whole sequence, as
    ``mtp_j/accept`` measures)."""
    hooks = mtp_hooks.attach(model, draft_steps=k, **ENGINE_RULE)
    sequences, prompt = engine_sequences(prompts, truth, tokens)

    def predict(mtp_input: str = ENGINE_MTP_INPUT, geometry: str = "engine", start: str = ENGINE_START) -> tuple[Replay, Tensor]:
        hits, agreement = draft_hits(model, hooks, sequences, prompt, mtp_input, geometry, "normed", start)
        return replay(hits, prompt, tokens, agreement), hits

    try:
        predicted, hits = predict()
        if not diagnostics:
            return predicted, {}, hits
        others = {"as_trained": predict(mtp_input="decoder_output")[0], "kept_start": predict(start="kept")[0],
                  "chain": predict(geometry="chain")[0]}
        return predicted, others, hits
    finally:
        hooks.remove()


def record_row(k: int, measured: Any, predicted: Any, wall_plain: float, same: bool, diagnostics: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """One (variant, k, step) measurement under the record's fixed names (``diagnostics``: ``_predict``'s other
    predictions by name, as ``predicted_<name>_accept_j``)."""
    engine = measured.per_position or (0.0,) * k
    drafts = measured.counts.drafts
    return {
        **{f"engine_accept_{j}": engine[j - 1] for j in range(1, k + 1)},
        **{f"predicted_accept_{j}": predicted.per_position[j - 1] for j in range(1, k + 1)},
        **{f"predicted_{name}_accept_{j}": other.per_position[j - 1] for name, other in (diagnostics or {}).items() for j in range(1, k + 1)},
        "engine_accept_len": measured.mean_length,
        "predicted_accept_len": predicted.mean_length,
        "accepted_per_target_forward": measured.counts.accepted / drafts if drafts else float("nan"),
        "wall_s_spec": measured.seconds,
        "wall_s_plain": wall_plain,
        "drafts": drafts,
        "predicted_drafts": predicted.drafts,
        "trainer_target_agreement": predicted.target_agreement,
        "spec_equals_plain": same,
    }


def _seed(setting: Setting, snap: Snapshot) -> int:
    """The engine's sampling seed of one evaluation (prompt i: this + i), the same for every variant and k."""
    return 1_000_000 * (setting.seed + 1) + 10_000 * snap.step


def _sampled_row(llm: Any, model: nn.Module, k: int, prompts: list[list[int]], tokens: int, temperature: float, seed: int,
                 plain: float, same: bool) -> dict[str, Any]:
    """What the engine accepts generating ``tokens`` per prompt at ``temperature``, and the trainer's prediction on the
    engine's own tokens. The replay needs the k tokens past the end (the last step's drafts are counted against them):
    the same requests with the same seeds run k tokens longer draw the same numbers step by step, so their first
    ``tokens`` tokens are the run's (``replay_prefix_equal``: the share of prompts where they are)."""
    measured = generate_sampled(llm, prompts, tokens, temperature, seed)
    longer = generate_sampled(llm, prompts, tokens + k, temperature, seed).token_ids
    predicted, diagnostics, hits = _predict(model, k, prompts, longer, tokens, diagnostics=True)
    row = record_row(k, measured, predicted, plain, same, diagnostics)
    row["replay_prefix_equal"] = sum(a == b[:tokens] for a, b in zip(measured.token_ids, longer)) / len(prompts)
    sequences, prompt = engine_sequences(prompts, longer, tokens)
    bound = ceiling_hits(model, sequences, k)
    ceiling = replay(bound, prompt, tokens)
    row.update({f"ceiling_accept_{j}": ceiling.per_position[j - 1] for j in range(1, k + 1)})
    row["ceiling_accept_len"] = ceiling.mean_length
    row["accept_len_se"] = length_se(hits, prompt, tokens)
    return row


def measure(setting: Setting, snapshots: list[Snapshot], folder: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every variant of every snapshot measured by vLLM for k = 1..``setting.chain`` and predicted by the trainer, at the
    rollouts' temperature (``setting.temperatures[0]``) and, as the ``greedy_`` fields, at T = 0.

    Returns ``{"variants": {name: {"k<k>": {field: [value per snapshot]}}}, "wall_s_plain": [...], "greedy_examples": ...}``
    (per snapshot the first two prompts with the target's greedy continuation, token ids)."""
    steps = setting.chain or setting.mtp
    tokens = setting.seq - setting.prompt
    temperature = setting.temperatures[0]
    model = build_model(setting)
    model.load_state_dict(next(iter(snapshots[0].states.values())))
    write_checkpoint(folder, model, setting.vocab)
    seeds = [_seed(setting, snap) for snap in snapshots]
    truth, greedy_seconds, sampled_seconds = _plain(folder, model, snapshots, tokens, steps, temperature, seeds)
    names = list(snapshots[0].states)
    variants: dict[str, dict[str, dict[str, list[Any]]]] = {name: {} for name in names}
    for k in range(1, steps + 1):
        llm = start_vllm(str(folder), k, dtype="float32")
        try:
            sync = VLLMSync(llm)
            for snap, seed, full, greedy_plain, sampled_plain in zip(snapshots, seeds, truth, greedy_seconds, sampled_seconds):
                prompts = snap.prompts.tolist()
                model.load_state_dict(snap.states[names[0]])
                push_checked(sync, model, main=True)
                for name in names:
                    model.load_state_dict(snap.states[name])
                    push_checked(sync, model, main=False)
                    greedy = generate_greedy(llm, prompts, tokens)
                    same = greedy.token_ids == tuple(t[:tokens] for t in full)
                    greedy_predicted = _predict(model, k, prompts, full, tokens, diagnostics=False)[0]
                    row = _sampled_row(llm, model, k, prompts, tokens, temperature, seed, sampled_plain, same)
                    row.update({f"greedy_{field}": value for field, value in record_row(k, greedy, greedy_predicted, greedy_plain, same).items()
                                if field != "spec_equals_plain"})
                    for field, value in row.items():
                        variants[name].setdefault(f"k{k}", {}).setdefault(field, []).append(value)
                log(f"  engine k = {k}, step {snap.step:>3}, T = {temperature} (T = 0): accept length " + ", ".join(
                    f"{name} {_last(variants, name, k, 'engine_accept_len')} (pred {_last(variants, name, k, 'predicted_accept_len')}; "
                    f"{_last(variants, name, k, 'greedy_engine_accept_len')})" for name in names))
        finally:
            stop_vllm(llm)
    examples = [[list(p) + list(t[:tokens]) for p, t in zip(snap.prompts.tolist()[:2], full[:2])] for snap, full in zip(snapshots, truth)]
    return {"variants": variants, "wall_s_plain": sampled_seconds, "greedy_wall_s_plain": greedy_seconds, "greedy_examples": examples}


def _last(variants: dict[str, Any], name: str, k: int, field: str) -> str:
    return f"{variants[name][f'k{k}'][field][-1]:.2f}"
