"""Draft acceptance through an RL run: a frozen MTP draft against drafts trained with ce, distill, tv.

``python -m benchmarks.acceptance [--quick]`` (``make acceptance``). A tiny real mcore GPTModel
with N = 2 MTP layers is first trained jointly (main + MTP losses, gradients into the trunk, as
stock mcore trains) on a synthetic word language (``benchmarks/acceptance_task.py``) until the
draft's expected acceptance stops improving. Then one GRPO run, whose reward prefers some words,
is replayed in four variants that differ only in the draft:

* ``frozen``: the RL forward runs without labels (MTP block off); MTP parameters never change;
* ``ce`` / ``distill`` / ``tv``: ``mtp_hooks.attach(objective=...)`` with ``detach_encoder=True,
  detach_head=True``, so MTP trains on the rollouts while the policy's gradients stay its own.

Main and MTP parameters have separate Adam optimizers, rollouts come from one seeded generator,
and after every step the main parameters of all variants are checked to be bit-identical: the
policy trajectory is the same, only the draft differs.

Every few steps, on fresh rollouts of the current policy (their own generator, never trained on),
each variant reports per depth the expected acceptance ``sum_v min(p_main, q_mtp)`` and top-1
agreement (``mtp_k/accept``, ``mtp_k/agree`` of a training-style forward that is never
backpropagated), the expected tokens per verification step of the depth-N chain draft, and runs
a real speculative sampling loop (MTP chain as the draft, main head as the target) whose
realised acceptance is compared with the exact acceptance probability of the drafts it tried.

The whole experiment (language, pretraining, RL trajectory, evaluation rollouts) is repeated for
each of ``--seeds`` (default 0, 1, 2; quick mode too); the tables give the mean and the min–max over
seeds per variant and evaluation step, and the verdict counts the seeds in which a trained draft beats
the frozen one at the last step.

Output: ``bench-out/acceptance/`` (``acceptance.json`` with every seed's full run, ``acceptance.md``,
``acceptance.png``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import platform
import time
import warnings
from pathlib import Path
from typing import Any, Optional

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|tp_group is None|ffn_hidden_size|full scope).*")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler  # noqa: E402

import mtp_hooks  # noqa: E402
from benchmarks import models  # noqa: E402
from benchmarks.acceptance_task import (  # noqa: E402
    WordLanguage,
    group_advantages,
    next_token_targets,
    policy_gradient_loss,
    sample_rollouts,
)
from benchmarks.configs import Config, Shape  # noqa: E402

VARIANTS = ("frozen", "ce", "distill", "tv")
SEEDS = (0, 1, 2)
PROMPT = 2  # BOS and the first word's start token


@dataclasses.dataclass(frozen=True)
class Setting:
    """Sizes and schedule of one run."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    vocab: int = 32
    seq: int = 32
    mtp: int = 2
    sft_batch: int = 32
    sft_min_steps: int = 300  # at initialisation both heads are near uniform, so acceptance starts high and dips first
    sft_max_steps: int = 1000
    sft_window: int = 50  # plateau check: mean acceptance of consecutive windows of this many steps
    sft_tolerance: float = 0.005
    sft_lr: float = 3e-3
    rl_steps: int = 40
    prompts: int = 8
    group: int = 8
    rl_lr: float = 1e-3
    mtp_lr: float = 3e-3
    eval_every: int = 5
    eval_rollouts: int = 64
    seed: int = 0


SETTINGS: dict[str, Setting] = {
    "quick": Setting(sft_min_steps=200, sft_max_steps=400, rl_steps=20, eval_every=5, eval_rollouts=128),
    "full": Setting(sft_max_steps=2500, rl_steps=150, eval_every=10, eval_rollouts=256),
    "smoke": Setting(hidden=32, layers=1, seq=12, sft_batch=8, sft_min_steps=0, sft_max_steps=6, sft_window=3, rl_steps=2, prompts=2, group=4, eval_every=1, eval_rollouts=4),
}


def _config() -> Config:
    base = Shape(vocab=32, seq=32, mtp=2, hidden=64, layers=2, heads=4)
    return Config(
        name="acceptance", device="cpu", dtype=torch.float32, base=base, vocab_sweep=(), seq_sweep=(), mtp_sweep=(),
        rounds=1, warmup=0, position_embedding="learned_absolute",
    )


def _shape(setting: Setting) -> Shape:
    # Room for the speculative loop's two draft tokens past the rollout length.
    return Shape(vocab=setting.vocab, seq=setting.seq + 2, mtp=setting.mtp, hidden=setting.hidden, layers=setting.layers, heads=setting.heads)


def _positions(tokens: Tensor) -> Tensor:
    return torch.arange(tokens.shape[1]).expand_as(tokens).contiguous()


def _is_mtp(name: str) -> bool:
    return name.startswith("mtp.")


def main_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if not _is_mtp(name)]


def mtp_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if _is_mtp(name)]


class DraftCapture:
    """Forward hooks on the MTP layers keeping each depth's output hidden states ``[s, b, h]``.

    The layers return a tensor (mcore 0.14) or a tuple whose first item is the hidden state
    (0.15+); either way it is the layer's normalised output, the input of the shared head.
    """

    def __init__(self, model: nn.Module) -> None:
        self.hidden: list[Tensor] = []
        self.handles = [layer.register_forward_hook(self._keep) for layer in model.mtp.layers]

    def _keep(self, module: nn.Module, args: Any, output: Any) -> None:
        self.hidden.append((output if isinstance(output, Tensor) else output[0]).detach())

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def draft_forward(model: nn.Module, hooks: mtp_hooks.MTPHooks, capture: DraftCapture, tokens: Tensor) -> tuple[Tensor, list[Tensor], dict[str, float]]:
    """Main-head log-probs ``[b, s, V]``, per-depth MTP log-probs ``[b, s, V]`` and the hooks' metrics.

    A training-style micro-batch (grad enabled, so the MTP block runs) that is never
    backpropagated: nothing trains. Depth k at position t predicts token t + k + 1.
    """
    labels, mask = next_token_targets(tokens, PROMPT)
    capture.hidden.clear()
    with torch.enable_grad(), hooks.micro_batch(labels=labels, loss_mask=mask):
        logits = model(tokens, _positions(tokens), None)
    metrics = hooks.metrics()
    with torch.no_grad():
        weight = model.output_layer.weight
        drafts = [torch.log_softmax((h @ weight.t()).transpose(0, 1).float(), dim=-1) for h in capture.hidden]
        main = torch.log_softmax(logits.detach().float(), dim=-1)
    if len(drafts) != model.config.mtp_num_layers:
        raise AssertionError(f"captured {len(drafts)} MTP depths, expected {model.config.mtp_num_layers}")
    return main, drafts, metrics


def expected_acceptance(main: Tensor, drafts: list[Tensor], mask: Tensor) -> list[float]:
    """Per depth, masked mean of ``sum_v min(p_main[t + k], q_k[t])`` (the hooks' alignment)."""
    out = []
    p = main.exp()
    for k, q in enumerate(drafts, start=1):
        overlap = torch.minimum(p[:, k:], q.exp()[:, :-k]).sum(-1)
        m = mask[:, k:]
        out.append(float((overlap * m).sum() / m.sum()))
    return out


def chain_tokens_per_step(accepts: list[float]) -> float:
    """Expected tokens per verification step of a depth-N chain draft, counting the target's own
    token: ``1 + sum_j prod_{i<=j} a_i`` (depths treated as independent)."""
    total, running = 1.0, 1.0
    for a in accepts:
        running *= a
        total += running
    return total


def _residual_sample(p: Tensor, q: Tensor, gen: torch.Generator) -> Tensor:
    """Speculative sampling's correction: a draw from ``max(p - q, 0)`` normalised (``p`` if empty)."""
    residual = (p - q).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p)
    return torch.multinomial(residual, 1, generator=gen).squeeze(-1)


@dataclasses.dataclass
class SpeculativeStats:
    """Counts of a speculative sampling run: per depth drafts tried and accepted, and the summed exact
    acceptance probability ``sum_v min(p, q)`` of the drafts tried; verification steps and tokens."""

    tried: list[int]
    accepted: list[int]
    expected: list[float]
    steps: int = 0
    tokens: int = 0

    def summary(self) -> dict[str, Any]:
        return {
            "realised_accept": [a / t if t else math.nan for a, t in zip(self.accepted, self.tried)],
            "expected_at_tried": [e / t if t else math.nan for e, t in zip(self.expected, self.tried)],
            "tried": list(self.tried),
            "realised_tokens_per_step": self.tokens / self.steps if self.steps else math.nan,
            "steps": self.steps,
        }


def speculative_sampling(
    model: nn.Module, hooks: mtp_hooks.MTPHooks, capture: DraftCapture, prompts: Tensor, length: int, gen: torch.Generator
) -> SpeculativeStats:
    """Generate from the main head with the MTP chain as the draft (standard speculative sampling).

    Each verification step: the last token came from the target; depth 1 drafts the next token
    from it, depth 2 the one after from depth 1's draft; the target accepts draft j with
    probability ``min(1, p/q)`` while all before it were accepted, replaces the first rejected
    one by a draw from ``max(p - q, 0)``, or adds its own next token when all are accepted.
    Full recompute per forward (tiny models). Two-depth chains only.
    """
    if model.config.mtp_num_layers != 2:
        raise ValueError(f"speculative_sampling: expected a model with 2 MTP layers, got {model.config.mtp_num_layers}")
    rows = prompts.shape[0]
    buffer = torch.zeros(rows, length + 2, dtype=torch.long)
    buffer[:, : prompts.shape[1]] = prompts
    n = torch.full((rows,), prompts.shape[1])
    stats = SpeculativeStats([0, 0], [0, 0], [0.0, 0.0])
    idx = torch.arange(rows)
    while True:
        active = n <= length - 2  # room for d1, d2 and the target's token within the rollout length
        if not bool(active.any()):
            return stats
        at = torch.where(active, n, prompts.shape[1])  # finished rows: any in-range position, results unused
        _, drafts, _ = draft_forward(model, hooks, capture, buffer)
        q1 = drafts[0][idx, at - 2].exp()
        d1 = torch.multinomial(q1, 1, generator=gen).squeeze(-1)
        with_d1 = buffer.clone()
        with_d1[idx, at] = d1
        main, drafts, _ = draft_forward(model, hooks, capture, with_d1)
        q2 = drafts[1][idx, at - 2].exp()
        p1, p2 = main[idx, at - 1].exp(), main[idx, at].exp()
        d2 = torch.multinomial(q2, 1, generator=gen).squeeze(-1)
        with_d2 = with_d1.clone()
        with_d2[idx, at + 1] = d2
        with torch.no_grad():
            p3 = torch.softmax(model(with_d2, _positions(with_d2), None)[idx, at + 1].float(), dim=-1)
        u = torch.rand(rows, 2, generator=gen)
        ok1 = u[:, 0] < (p1[idx, d1] / q1[idx, d1]).clamp(max=1)
        ok2 = ok1 & (u[:, 1] < (p2[idx, d2] / q2[idx, d2]).clamp(max=1))
        fix1, fix2 = _residual_sample(p1, q1, gen), _residual_sample(p2, q2, gen)
        bonus = torch.multinomial(p3, 1, generator=gen).squeeze(-1)
        a1, a2 = torch.minimum(p1, q1).sum(-1), torch.minimum(p2, q2).sum(-1)
        tried2 = active & ok1
        stats.tried[0] += int(active.sum())
        stats.accepted[0] += int((active & ok1).sum())
        stats.expected[0] += float(a1[active].sum())
        stats.tried[1] += int(tried2.sum())
        stats.accepted[1] += int((tried2 & ok2).sum())
        stats.expected[1] += float(a2[tried2].sum())
        new_tokens = torch.where(ok1, torch.where(ok2, 3, 2), 1)
        stats.steps += int(active.sum())
        stats.tokens += int(new_tokens[active].sum())
        for r in idx[active].tolist():
            start = int(n[r])
            seq = [int(fix1[r])] if not ok1[r] else ([int(d1[r]), int(fix2[r])] if not ok2[r] else [int(d1[r]), int(d2[r]), int(bonus[r])])
            buffer[r, start : start + len(seq)] = torch.tensor(seq)
            buffer[r, start + len(seq) :] = 0
            n[r] = start + len(seq)


# ------------------------------------------------------------------------------------ phases


def pretrain(model: nn.Module, language: WordLanguage, setting: Setting, log: Any) -> dict[str, Any]:
    """Joint main + MTP training (MTP gradients reach the trunk, as stock mcore trains) until the
    mean expected acceptance of a window of steps improves by less than ``sft_tolerance``."""
    gen = torch.Generator().manual_seed(setting.seed + 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=setting.sft_lr)
    history: list[list[float]] = []
    windows: list[float] = []
    with mtp_hooks.attached(model, agreement_metrics=True) as hooks:
        for step in range(1, setting.sft_max_steps + 1):
            tokens = language.sample(setting.sft_batch, setting.seq, gen)
            labels = torch.roll(tokens, -1, 1)
            labels[:, -1] = 0
            mask = torch.ones_like(tokens, dtype=torch.float32)
            mask[:, -1] = 0
            with hooks.micro_batch(labels=labels, loss_mask=mask):
                logits = model(tokens, _positions(tokens), None)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
            ((loss * mask.flatten()).sum() / mask.sum()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            metrics = hooks.metrics()
            history.append([metrics[f"mtp_{k}/accept"] for k in range(1, setting.mtp + 1)])
            if step % setting.sft_window == 0:
                windows.append(sum(map(sum, history[-setting.sft_window :])) / (setting.sft_window * setting.mtp))
                log(f"  pretrain step {step:>5}: main CE {float(loss.detach().mean()):.3f}, window mean acceptance {windows[-1]:.3f}")
                if step >= setting.sft_min_steps and len(windows) >= 2 and windows[-1] - windows[-2] < setting.sft_tolerance:
                    break
    return {"steps": step, "plateau": len(windows) >= 2 and windows[-1] - windows[-2] < setting.sft_tolerance, "window_accept": windows}


@dataclasses.dataclass
class Arm:
    """One variant of the RL phase: its model, hooks, capture and optimizers."""

    name: str
    model: nn.Module
    hooks: mtp_hooks.MTPHooks
    capture: DraftCapture
    main_opt: torch.optim.Optimizer
    mtp_opt: Optional[torch.optim.Optimizer]


def _make_arm(name: str, state: dict[str, Tensor], setting: Setting) -> Arm:
    model = models.build(_config(), _shape(setting), setting.mtp)
    model.load_state_dict(state)
    objective = "ce" if name == "frozen" else name
    hooks = mtp_hooks.attach(model, detach_encoder=True, detach_head=True, objective=objective, agreement_metrics=True)
    mtp_opt = None if name == "frozen" else torch.optim.Adam(mtp_parameters(model), lr=setting.mtp_lr)
    return Arm(name, model, hooks, DraftCapture(model), torch.optim.Adam(main_parameters(model), lr=setting.rl_lr), mtp_opt)


def _rl_step(arm: Arm, tokens: Tensor, advantages: Tensor) -> None:
    labels, mask = next_token_targets(tokens, PROMPT)
    if arm.mtp_opt is None:  # frozen draft: a forward without labels, the MTP block does not run
        logits = arm.model(tokens, _positions(tokens), None)
    else:
        with arm.hooks.micro_batch(labels=labels, loss_mask=mask):
            logits = arm.model(tokens, _positions(tokens), None)
    policy_gradient_loss(logits, labels, mask, advantages).backward()
    arm.main_opt.step()
    if arm.mtp_opt is not None:
        arm.mtp_opt.step()
    arm.model.zero_grad(set_to_none=True)
    arm.hooks.metrics()  # training-batch metrics are not the held-out ones reported


def assert_same_policy(arms: list[Arm], step: int) -> None:
    """Every variant's main parameters bit-identical to the first's (the controlled experiment)."""
    reference = dict(arms[0].model.named_parameters())
    for arm in arms[1:]:
        for name, p in arm.model.named_parameters():
            if not _is_mtp(name) and not torch.equal(p, reference[name]):
                raise AssertionError(f"step {step}: main parameter {name} of {arm.name!r} differs from {arms[0].name!r}")


def evaluate(arm: Arm, rollouts: Tensor, setting: Setting, seed: int) -> dict[str, Any]:
    """Held-out draft quality of one variant on the current policy's rollouts."""
    labels, mask = next_token_targets(rollouts, PROMPT)
    main, drafts, metrics = draft_forward(arm.model, arm.hooks, arm.capture, rollouts)
    accepts = [metrics[f"mtp_{k}/accept"] for k in range(1, setting.mtp + 1)]
    own = expected_acceptance(main, drafts, mask)
    spec = speculative_sampling(arm.model, arm.hooks, arm.capture, rollouts[:, :PROMPT], setting.seq, torch.Generator().manual_seed(seed))
    return {
        "accept": accepts,
        "agree": [metrics[f"mtp_{k}/agree"] for k in range(1, setting.mtp + 1)],
        "accept_recomputed_max_diff": max(abs(a - b) for a, b in zip(accepts, own)),
        "tokens_per_step": chain_tokens_per_step(accepts),
        **spec.summary(),
    }


def run(setting: Setting, log: Any = print) -> dict[str, Any]:
    """Pretrain, then the RL phase in every variant; returns everything ``acceptance.json`` holds."""
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    language = WordLanguage.build(vocab=setting.vocab, seed=setting.seed)
    started = time.perf_counter()
    base = models.build(_config(), _shape(setting), setting.mtp, seed=1234 + setting.seed)
    log(f"pretraining (joint main + MTP, stock-style) on the word language, batch {setting.sft_batch} x {setting.seq}")
    sft = pretrain(base, language, setting, log)
    state = {k: v.clone() if isinstance(v, Tensor) else v for k, v in base.state_dict().items()}
    arms = [_make_arm(name, state, setting) for name in VARIANTS]
    frozen_mtp = [p.detach().clone() for p in mtp_parameters(arms[0].model)]
    rollout_gen = torch.Generator().manual_seed(setting.seed + 2)
    eval_gen = torch.Generator().manual_seed(setting.seed + 3)
    steps: list[int] = []
    results: dict[str, list[dict[str, Any]]] = {arm.name: [] for arm in arms}
    rewards: list[float] = []
    eval_rewards: list[float] = []
    grammatical: list[float] = []
    examples: dict[int, list[list[int]]] = {}
    policy = lambda tokens: arms[0].model(tokens, _positions(tokens), None)  # noqa: E731  (same main params in all)

    def evaluate_all(step: int) -> None:
        prompts = language.sample(setting.eval_rollouts, PROMPT, eval_gen)
        rollouts = sample_rollouts(policy, prompts, setting.seq, eval_gen)
        steps.append(step)
        eval_rewards.append(float(language.reward(rollouts, PROMPT).mean()))
        grammatical.append(language.grammatical_share(rollouts, PROMPT))
        examples[step] = rollouts[:3].tolist()
        line = []
        for arm in arms:
            out = evaluate(arm, rollouts, setting, seed=setting.seed + 1000 + step)
            results[arm.name].append(out)
            line.append(f"{arm.name} {out['accept'][0]:.3f}/{out['accept'][1]:.3f}")
        log(f"  step {step:>4}: held-out reward {eval_rewards[-1]:.3f}, grammatical {grammatical[-1]:.3f}; accept_1/accept_2: " + ", ".join(line))

    log(f"RL (GRPO, {setting.prompts} prompts x {setting.group} rollouts per step, {setting.rl_steps} steps), variants {', '.join(VARIANTS)}")
    evaluate_all(0)
    for step in range(1, setting.rl_steps + 1):
        prompts = language.sample(setting.prompts, PROMPT, rollout_gen).repeat_interleave(setting.group, dim=0)
        rollouts = sample_rollouts(policy, prompts, setting.seq, rollout_gen)
        reward = language.reward(rollouts, PROMPT)
        rewards.append(float(reward.mean()))
        advantages = group_advantages(reward, setting.group)
        for arm in arms:
            _rl_step(arm, rollouts, advantages)
        assert_same_policy(arms, step)
        if step % setting.eval_every == 0 or step == setting.rl_steps:
            evaluate_all(step)
    for before, after in zip(frozen_mtp, mtp_parameters(arms[0].model)):
        if not torch.equal(before, after):
            raise AssertionError("the frozen variant's MTP parameters changed")
    for arm in arms:
        arm.capture.remove()
        arm.hooks.remove()
    variants = {
        name: {
            **{f"accept_{k}": [r["accept"][k - 1] for r in rows] for k in range(1, setting.mtp + 1)},
            **{f"agree_{k}": [r["agree"][k - 1] for r in rows] for k in range(1, setting.mtp + 1)},
            "tokens_per_step": [r["tokens_per_step"] for r in rows],
            **{f"realised_accept_{k}": [r["realised_accept"][k - 1] for r in rows] for k in range(1, setting.mtp + 1)},
            **{f"expected_at_tried_{k}": [r["expected_at_tried"][k - 1] for r in rows] for k in range(1, setting.mtp + 1)},
            **{f"tried_{k}": [r["tried"][k - 1] for r in rows] for k in range(1, setting.mtp + 1)},
            "realised_tokens_per_step": [r["realised_tokens_per_step"] for r in rows],
            "accept_recomputed_max_diff": max(r["accept_recomputed_max_diff"] for r in rows),
        }
        for name, rows in results.items()
    }
    return {
        "steps": steps,
        "variants": variants,
        "reward": {"train_mean_per_step": rewards, "held_out_mean": eval_rewards},
        "grammatical_share": grammatical,
        "example_rollouts": examples,
        "pretrain": sft,
        "main_parameters_identical_across_variants": True,  # assert_same_policy raised otherwise
        "setting": dataclasses.asdict(setting),
        "language": {"words": language.words, "preferred": sorted(language.preferred), "spellings": [list(s) for s in language.spellings]},
        "seconds": time.perf_counter() - started,
        "versions": _versions(),
    }


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {"torch": torch.__version__, "megatron-core": version("megatron-core"), "python": platform.python_version()}


# ------------------------------------------------------------------------------------ report


def _fmt(x: float) -> str:
    return "nan" if x != x else f"{x:.3f}"


def _spread(values: list[float]) -> dict[str, float]:
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return {"mean": mean, "sd": sd, "min": min(values), "max": max(values), "n": len(values)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant, series and step: mean, sd, min and max over the seeds' runs (same evaluation steps)."""
    steps = runs[0]["steps"]
    if any(r["steps"] != steps for r in runs):
        raise ValueError("the seeds' runs were evaluated at different steps")
    series = [k for k in runs[0]["variants"]["frozen"] if isinstance(runs[0]["variants"]["frozen"][k], list) and not k.startswith("tried")]
    out: dict[str, Any] = {"steps": steps, "seeds": [r["setting"]["seed"] for r in runs], "variants": {}}
    for name in runs[0]["variants"]:
        out["variants"][name] = {
            key: [_spread([r["variants"][name][key][i] for r in runs]) for i in range(len(steps))] for key in series
        }
    out["reward"] = [_spread([r["reward"]["held_out_mean"][i] for r in runs]) for i in range(len(steps))]
    out["grammatical_share"] = [_spread([r["grammatical_share"][i] for r in runs]) for i in range(len(steps))]
    last = {name: [r["variants"][name]["accept_1"][-1] + r["variants"][name]["accept_2"][-1] for r in runs] for name in runs[0]["variants"]}
    out["verdict"] = {
        name: {"seeds_above_frozen": sum(a > f for a, f in zip(last[name], last["frozen"])),
               "mean_gain_over_frozen": _spread([(a - f) / 2 for a, f in zip(last[name], last["frozen"])])}
        for name in last if name != "frozen"
    }
    return out


def _ms(d: dict[str, float]) -> str:
    """mean (min–max) over seeds."""
    return f"{_fmt(d['mean'])} ({_fmt(d['min'])}–{_fmt(d['max'])})"


def markdown(result: dict[str, Any]) -> str:
    """Tables over seeds: per variant at the last evaluation, the verdict, and per step."""
    summary, runs = result["summary"], result["runs"]
    steps, last = summary["steps"], len(summary["steps"]) - 1
    v, s = runs[0]["versions"], runs[0]["setting"]
    n = len(runs)
    lines = [
        f"CPU, fp32; torch {v['torch']}, megatron-core {v['megatron-core']}. GPTModel h={s['hidden']}, {s['layers']} layers, "
        f"V={s['vocab']}, N={s['mtp']}, rollouts of {s['seq']} tokens. {n} seeds ({', '.join(map(str, summary['seeds']))}): each its "
        f"own word language, pretraining ({', '.join(str(r['pretrain']['steps']) for r in runs)} steps), GRPO trajectory and "
        f"evaluation rollouts. RL: {s['rl_steps']} GRPO steps of {s['prompts']}x{s['group']} rollouts; evaluated on "
        f"{s['eval_rollouts']} fresh rollouts every {s['eval_every']} steps. Main parameters bit-identical across variants at "
        f"every step of every seed. Runs took {', '.join(str(round(r['seconds'])) for r in runs)} s.",
        "",
        f"Mean (min–max) over the {n} seeds, at RL step {steps[last]}:",
        "",
        f"| variant | accept_1 step 0 → {steps[last]} | accept_2 step 0 → {steps[last]} | agree_1 / agree_2 | "
        "expected tokens/step | realised tokens/step | realised accept_1 / accept_2 (expected at the tried drafts) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, d in summary["variants"].items():
        lines.append(
            f"| {name} | {_fmt(d['accept_1'][0]['mean'])} → **{_ms(d['accept_1'][last])}** | "
            f"{_fmt(d['accept_2'][0]['mean'])} → **{_ms(d['accept_2'][last])}** | "
            f"{_fmt(d['agree_1'][last]['mean'])} / {_fmt(d['agree_2'][last]['mean'])} | {_ms(d['tokens_per_step'][last])} | "
            f"{_ms(d['realised_tokens_per_step'][last])} | {_fmt(d['realised_accept_1'][last]['mean'])} "
            f"({_fmt(d['expected_at_tried_1'][last]['mean'])}) / {_fmt(d['realised_accept_2'][last]['mean'])} "
            f"({_fmt(d['expected_at_tried_2'][last]['mean'])}) |"
        )
    lines += ["", f"Verdict from the seeds (mean expected acceptance over both depths at step {steps[last]}, trained draft − frozen):", "",
              "| variant | seeds above frozen | gain: mean ± sd (min–max) |", "|---|---:|---:|"]
    for name, d in summary["verdict"].items():
        g = d["mean_gain_over_frozen"]
        lines.append(f"| {name} | {d['seeds_above_frozen']} of {n} | {g['mean']:+.3f} ± {g['sd']:.3f} ({g['min']:+.3f} to {g['max']:+.3f}) |")
    tried = {k: sum(sum(r["variants"][m][f"tried_{k}"]) for r in runs for m in r["variants"]) for k in (1, 2)}
    realised = {k: sum(sum(a * t for a, t in zip(r["variants"][m][f"realised_accept_{k}"], r["variants"][m][f"tried_{k}"]))
                       for r in runs for m in r["variants"]) / max(tried[k], 1) for k in (1, 2)}
    expected = {k: sum(sum(a * t for a, t in zip(r["variants"][m][f"expected_at_tried_{k}"], r["variants"][m][f"tried_{k}"]))
                       for r in runs for m in r["variants"]) / max(tried[k], 1) for k in (1, 2)}
    worst = max(r["variants"][m]["accept_recomputed_max_diff"] for r in runs for m in r["variants"])
    lines += [
        "",
        "Expected tokens per verification step: `1 + a_1 + a_1·a_2` (the target's own token included; depths treated as "
        "independent). Speculative sampling over all seeds, evaluations and variants: depth 1 accepted "
        f"{realised[1]:.4f} of {tried[1]} drafts against an expected {expected[1]:.4f}; depth 2 {realised[2]:.4f} of {tried[2]} "
        f"against {expected[2]:.4f}. Largest difference between the hooks' `mtp_k/accept` and the same quantity recomputed "
        f"from the captured distributions: {worst:.1e}.",
        "",
        f"Expected acceptance `a1 / a2` by RL step on held-out rollouts, mean over the {n} seeds (min–max of a1 in brackets), "
        "with the policy's held-out reward and grammatical share (means):",
        "",
        "| step | reward | grammatical | " + " | ".join(f"{m} a1 / a2" for m in summary["variants"]) + " |",
        "|---:|---:|---:|" + "---:|" * len(summary["variants"]),
    ]
    for i, step in enumerate(steps):
        cells = [f"{_fmt(d['accept_1'][i]['mean'])} / {_fmt(d['accept_2'][i]['mean'])} ({_fmt(d['accept_1'][i]['min'])}–{_fmt(d['accept_1'][i]['max'])})"
                 for d in summary["variants"].values()]
        lines.append(f"| {step} | {_fmt(summary['reward'][i]['mean'])} | {_fmt(summary['grammatical_share'][i]['mean'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Mean expected acceptance per variant and depth over the seeds, with the min–max band; the policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    steps = summary["steps"]
    colours = {"frozen": "tab:gray", "ce": "tab:blue", "distill": "tab:orange", "tv": "tab:green"}
    fig, (ax, ax_r) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1.4]})
    for name, d in summary["variants"].items():
        for k, style in ((1, "-"), (2, "--")):
            series = d[f"accept_{k}"]
            ax.plot(steps, [x["mean"] for x in series], style, color=colours.get(name), marker="o", ms=3, label=f"{name}, depth {k}")
            ax.fill_between(steps, [x["min"] for x in series], [x["max"] for x in series], color=colours.get(name), alpha=0.12)
    ax.set_xlabel("RL step")
    ax.set_ylabel("expected acceptance  Σ min(p, q)  (higher is better)")
    ax.set_title(f"MTP draft acceptance on fresh rollouts: mean of {len(summary['seeds'])} seeds, band = min–max")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax_r.plot(steps, [x["mean"] for x in summary["reward"]], color="black", marker="o", ms=3, label="reward")
    ax_r.plot(steps, [x["mean"] for x in summary["grammatical_share"]], color="tab:red", marker="o", ms=3, label="grammatical share")
    ax_r.set_xlabel("RL step")
    ax_r.set_title("policy (held-out rollouts, mean)")
    ax_r.legend(fontsize=7)
    ax_r.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_seeds(setting: Setting, seeds: tuple[int, ...], log: Any = print) -> dict[str, Any]:
    """``run`` once per seed; every run and the summary over them."""
    runs = []
    for seed in seeds:
        log(f"seed {seed}")
        runs.append(run(dataclasses.replace(setting, seed=seed), log))
    return {"seeds": list(seeds), "runs": runs, "summary": summarize(runs)}


def write_outputs(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "acceptance.json").write_text(json.dumps(result, indent=1))
    (out / "acceptance.md").write_text(markdown(result))
    plot(result, out / "acceptance.png")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the short schedule (3 seeds in a few minutes on 2 cores)")
    parser.add_argument("--setting", choices=sorted(SETTINGS), help="named schedule (default: full, or quick with --quick)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/acceptance"))
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (tiny matmuls: 1 is fastest)")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated seeds (default: 0,1,2; at least 1)")
    args = parser.parse_args(argv)
    setting = SETTINGS[args.setting or ("quick" if args.quick else "full")]
    seeds = tuple(int(x) for x in args.seeds.split(",") if x.strip())
    if not seeds:
        parser.error("--seeds needs at least one seed")
    torch.set_num_threads(args.threads)
    with contextlib.ExitStack() as stack:
        models.setup(_config(), stack)
        result = run_seeds(setting, seeds)
    write_outputs(result, args.out)
    print(markdown(result))
    print(f"written: {args.out}/acceptance.json, acceptance.md, acceptance.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
