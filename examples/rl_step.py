"""GRPO-style iterations through Megatron-Core's schedule, with the MTP layers training alongside.

    python examples/rl_step.py           # after `make venv`: .venv/bin/python examples/rl_step.py

Each iteration:

1. rollout: sample ``GROUP`` completions per prompt from the current policy (inference forwards:
   no labels, no gradients, so the MTP block does not run) and score them with a rule;
2. advantages: rewards normalised within each prompt's group (GRPO);
3. old-policy log-probs: ``get_forward_backward_func()`` with ``forward_only=True`` under
   ``torch.no_grad()``; inference micro-batches, no MTP work;
4. ``EPOCHS`` policy updates: the same schedule with training micro-batches; each forward runs
   inside ``hooks.micro_batch(labels, loss_mask)`` and returns logits, the clipped surrogate loss
   is computed from them, and the MTP layers train on the sampled completions in the same forward
   and backward (the schedule sets ``MTPLossAutoScaler``'s scale); then an optimizer step;
5. the MTP metrics of the iteration, with the draft's expected acceptance (``agreement_metrics=True``:
   ``mtp_k/accept``, ``mtp/accept_len``), and mcore's own MTP loss tracker once something feeds it.

Simplified, to stay tiny: random prompts; the reward is a rule (the share of even token ids in the
completion); sampling re-runs the whole sequence per new token (no KV cache); no KL penalty; plain
``torch.optim.Adam`` instead of mcore's distributed optimizer; TP = PP = 1.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Iterator

# mcore's own notices about optional fused kernels (Transformer Engine, Apex) and its config defaults
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).* not installed", category=UserWarning)
warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper  # noqa: E402

import mtp_hooks  # noqa: E402
from mtp_hooks.testing import runtime  # noqa: E402  (only the CPU needs more than stock mcore)
from quickstart import VOCAB, acceptance_problems, format_metrics, tiny_gpt_with_mtp, token_logprobs  # noqa: E402

PROMPTS = 2
GROUP = 4  # completions per prompt
PROMPT_LEN = 4
COMPLETION_LEN = 8
SEQ = PROMPT_LEN + COMPLETION_LEN
MICRO_BATCH = 2  # sequences per micro-batch
NUM_MICRO_BATCHES = PROMPTS * GROUP // MICRO_BATCH
ITERATIONS = 3
EPOCHS = 2  # policy updates per rollout; from the second on the ratio to the old policy moves
CLIP = 0.2
LEARNING_RATE = 3e-3

MicroBatch = dict[str, Tensor]


@torch.no_grad()
def rollout(model: nn.Module, prompts: Tensor) -> Tensor:
    """``GROUP`` sampled completions per prompt: ``[PROMPTS * GROUP, SEQ]`` token ids."""
    tokens = prompts.repeat_interleave(GROUP, dim=0)
    for _ in range(COMPLETION_LEN):
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        logits = model(tokens, positions, None)  # no labels, no grad: inference, the MTP block does not run
        next_token = torch.multinomial(torch.softmax(logits[:, -1].float(), dim=-1), 1)
        tokens = torch.cat([tokens, next_token], dim=1)
    return tokens


def reward(tokens: Tensor) -> Tensor:
    """The rule being optimised: the share of even token ids in each completion."""
    return (tokens[:, PROMPT_LEN:] % 2 == 0).float().mean(dim=1)


def group_advantages(rewards: Tensor) -> Tensor:
    """GRPO: each reward minus its group's mean, over its group's standard deviation."""
    grouped = rewards.view(PROMPTS, GROUP)
    return ((grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + 1e-6)).flatten()


def micro_batches(tokens: Tensor, advantages: Tensor) -> list[MicroBatch]:
    """Next-token labels with a loss mask on the completion's tokens, split into micro-batches."""
    labels = torch.roll(tokens, -1, dims=1)
    loss_mask = torch.zeros_like(tokens, dtype=torch.float)
    loss_mask[:, PROMPT_LEN - 1 : SEQ - 1] = 1  # positions whose next token is a completion token
    positions = torch.arange(SEQ, device=tokens.device).expand_as(tokens)
    full = {"input_ids": tokens, "position_ids": positions, "labels": labels, "loss_mask": loss_mask, "advantages": advantages}
    return [{name: value[i : i + MICRO_BATCH] for name, value in full.items()} for i in range(0, len(tokens), MICRO_BATCH)]


def run_schedule(model: nn.Module, step: Callable[[Iterator[MicroBatch], nn.Module], Any], batches: list[MicroBatch], forward_only: bool) -> list[Any]:
    return get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iter(batches),
        model=model,
        num_microbatches=len(batches),
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        forward_only=forward_only,
        collect_non_loss_data=forward_only,
    )


def old_logprobs_step(data: Iterator[MicroBatch], model: nn.Module) -> tuple[Tensor, Callable[..., Tensor]]:
    """Inference micro-batch: logits without labels; the schedule collects the label log-probs."""
    batch = next(data)
    logits = model(batch["input_ids"], batch["position_ids"], None)
    return logits, lambda logits, non_loss_data: token_logprobs(logits, batch["labels"])


def policy_loss(batch: MicroBatch, logits: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Clipped surrogate summed over the completion tokens, with the token count (mcore divides)."""
    ratio = torch.exp(token_logprobs(logits, batch["labels"]) - batch["old_logprobs"])
    advantage = batch["advantages"][:, None]
    surrogate = torch.minimum(ratio * advantage, torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * advantage)
    total = -(surrogate * batch["loss_mask"]).sum()
    tokens = batch["loss_mask"].sum().to(torch.int)
    return total, tokens, {"pg loss": (total / tokens).detach()}


def training_step(hooks: mtp_hooks.MTPHooks, data: Iterator[MicroBatch], model: nn.Module) -> tuple[Tensor, Callable[..., Any]]:
    """Training micro-batch: the model returns logits and the MTP layers train on the same labels."""
    batch = next(data)
    with hooks.micro_batch(labels=batch["labels"], loss_mask=batch["loss_mask"]):
        logits = model(batch["input_ids"], batch["position_ids"], None)
    return logits, functools.partial(policy_loss, batch)


def track_mcore_mtp_losses(iteration: int, logged: dict[str, Tensor]) -> None:
    """Move mcore's MTP loss tracker into ``logged`` after an optimizer step, as Megatron-LM's
    training loop does (per-depth mean over the step's micro-batches); adds nothing when unfed."""
    MTPLossLoggingHelper.track_mtp_metrics(
        loss_scale=1 / NUM_MICRO_BATCHES, iteration=iteration, writer=None, total_loss_dict=logged
    )


def _signed(value: float) -> str:
    """``+0.1225`` / ``-0.1225``; a value that rounds to zero prints as ``+0.0000``, never ``-0.0000``."""
    return f"{0.0 if abs(value) < 5e-5 else value:+.4f}"


def main() -> None:
    with runtime() as device:
        model = tiny_gpt_with_mtp(device)
        # agreement_metrics: the draft's acceptance at draft_temperature=1.0, the rollout's sampling temperature,
        # as vLLM and SGLang verify drafts by default (accept_rule="argmax")
        hooks = mtp_hooks.attach(model, detach_encoder=True, detach_head=True, agreement_metrics=True)
        optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
        prompts = torch.randint(0, VOCAB, (PROMPTS, PROMPT_LEN), device=device)
        history: list[dict[str, float]] = []
        problems: list[str] = []
        for iteration in range(1, ITERATIONS + 1):
            tokens = rollout(model, prompts)
            rewards = reward(tokens)
            batches = micro_batches(tokens, group_advantages(rewards))
            with torch.no_grad():
                old = run_schedule(model, old_logprobs_step, batches, forward_only=True)
            for batch, logprobs in zip(batches, old):
                batch["old_logprobs"] = logprobs
            losses = []
            tracked: dict[str, Tensor] = {}
            for _ in range(EPOCHS):
                optimizer.zero_grad(set_to_none=True)
                stored = run_schedule(model, functools.partial(training_step, hooks), batches, forward_only=False)
                optimizer.step()
                losses.append(torch.stack([d["pg loss"] for d in stored]).mean().item())
                track_mcore_mtp_losses(iteration, tracked)
            print(f"iteration {iteration}: mean reward {rewards.mean().item():.3f}, "
                  f"pg loss per epoch {', '.join(_signed(loss) for loss in losses)}")
            if iteration == 1:
                print("  (epoch 1's loss is 0 up to rounding: the policy still is the old one, so every ratio is 1,\n"
                      "   and GRPO's advantages sum to 0 within each group of equally long completions)")
            metrics = hooks.metrics()
            history.append(metrics)
            print(f"  MTP metrics: {format_metrics(metrics)}")
            if tracked:  # mean over the iteration's optimizer steps
                print("  mcore MTP tracker: " + "  ".join(f"{name}={value.item() / EPOCHS:.4g}" for name, value in tracked.items()))
                for name, value in tracked.items():  # "mtp_1 loss" against the hooks' token mean (equal counts per micro-batch)
                    depth = name.split()[0]
                    if not abs(value.item() / EPOCHS - metrics.get(f"{depth}/loss", float("nan"))) <= 2e-3 * abs(value.item() / EPOCHS):
                        problems.append(f"iteration {iteration}: mcore's tracker {name}={value.item() / EPOCHS:.4g} differs from the hooks' metrics")
        hooks.remove()
        depths = range(1, model.config.mtp_num_layers + 1)
        for iteration, metrics in enumerate(history, 1):
            if not all(metrics.get(f"mtp_{k}/tokens", 0) > 0 and float(metrics[f"mtp_{k}/loss"]) < float("inf") for k in depths):
                problems.append(f"iteration {iteration}: not every MTP depth trained: {metrics}")
            problems += [f"iteration {iteration}: {problem}" for problem in acceptance_problems(metrics, len(depths))]
        if problems:
            print("verdict: NOT as expected: " + "; ".join(problems))
            raise SystemExit(1)
        first, last = (sum(float(m[f"mtp_{k}/loss"]) for k in depths) / len(depths) for m in (history[0], history[-1]))
        print(f"verdict: every MTP depth trained in all {ITERATIONS} iterations through mcore's schedule, acceptance metrics in range"
              + (", mcore's tracker equals the hooks' losses" if tracked else "")
              + f"; mean MTP loss {first:.4g} -> {last:.4g} ({'fell' if last < first else 'did not fall'}: "
              f"on random prompts each iteration trains on new completions of a changing policy, so over {ITERATIONS} "
              "iterations it need not fall)")


if __name__ == "__main__":
    main()
