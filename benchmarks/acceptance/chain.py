"""The draft chain in the acceptance benchmark: k draft steps from N MTP layers, as an engine drafts.

Variants ``<objective>[+tf|+chain]`` (``parse_variant``): plain, the N layers train teacher-forced
(mcore's own training); ``+tf``: ``attach(draft_steps=k, draft_inputs="labels")``, the chain of k
steps on the data's tokens; ``+chain``: ``draft_inputs="sample"`` at the rollout temperature, the
chain on its own sampled drafts. Every variant is evaluated the same way
(``benchmarks.acceptance.evaluate.evaluate_chain``):

* expected acceptance per step along the own-draft chain: a never-backpropagated forward under
  eval hooks ``attach(draft_steps=k, draft_inputs="sample", agreement_metrics=True, accept_rule="sampled")``, whose
  ``mtp_j/accept`` is ``sum_v min(p, q_j)`` with q_j fed step j - 1's own sampled draft;
* ``chain_speculative_sampling``: the k-step speculative sampling loop of
  ``mtp_hooks.testing.speculative`` with ``chain_drafter`` drafting as an engine does. From the last
  target token, step 1 is MTP layer 1 on the main hidden state and that token; steps 2..k call the
  last MTP layer again on the previous step's output hidden state and the previous step's own
  sampled draft. The drafts of steps 1..k-1 are the ones the eval hooks
  fed the next step (read at the embedding's calls), step k's is drawn here; one target forward
  verifies all k (accept with ``min(1, p/q)``, resample the first rejected from
  ``max(p - q, 0)``, or add the target's bonus token).

Each step's attention runs over that step's states at every earlier position (mcore's depth
geometry, as the hooks train it); an engine's cache would hold step 1's states there.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

import mtp_hooks
from benchmarks.acceptance.drafts import device_of, positions
from benchmarks.acceptance.task import next_token_targets
from mtp_hooks.testing.speculative import Drafter, Proposal, SpeculativeStats, speculative_sampling

OBJECTIVES = ("frozen", "ce", "distill", "tv", "accept")
CHAIN_MODES = {"": None, "+tf": "labels", "+chain": "sample"}


def parse_variant(name: str) -> tuple[str, Optional[str]]:
    """``"accept+chain"`` -> ``("accept", "sample")``; ``"ce+tf"`` -> ``("ce", "labels")``; ``"ce"`` -> ``("ce", None)``."""
    objective, plus, mode = name.partition("+")
    inputs = CHAIN_MODES.get(plus + mode, "bad")
    if objective not in OBJECTIVES or inputs == "bad" or (objective == "frozen" and inputs is not None):
        raise ValueError(f"variant {name!r}: expected <objective>[+tf|+chain] with an objective of {OBJECTIVES} (frozen plain only)")
    return objective, inputs


def training_options(name: str, temperature: float, steps: int) -> dict[str, Any]:
    """The ``mtp_hooks.attach`` options a variant trains with (``frozen``: those of ``ce``, never stepped)."""
    objective, inputs = parse_variant(name)
    # accept_rule="sampled": the benchmark's speculative loops sample their drafts (mtp_hooks.testing.speculative).
    options: dict[str, Any] = dict(detach_encoder=True, detach_head=True, objective="ce" if objective == "frozen" else objective,
                                   agreement_metrics=True, draft_temperature=temperature, accept_rule="sampled")
    if inputs is not None:
        options.update(draft_steps=steps, draft_inputs=inputs)
    return options


class ChainProbe:
    """Forward hooks keeping, per forward, each call's output hidden state ``[s, b, h]`` of the last
    MTP layer (once per step past N - 1) and each call's ``input_ids`` ``[b, s]`` of the embedding
    (call 0: the decoder's; call j: step j's: the rolled true ids for j = 1, the drafts after)."""

    def __init__(self, model: nn.Module) -> None:
        self.hidden: list[Tensor] = []
        self.ids: list[Tensor] = []
        self.handles = [
            model.mtp.layers[-1].register_forward_hook(self._keep_hidden),
            model.embedding.register_forward_pre_hook(self._keep_ids, with_kwargs=True),
        ]

    def _keep_hidden(self, module: nn.Module, args: Any, output: Any) -> None:
        self.hidden.append((output if isinstance(output, Tensor) else output[0]).detach())

    def _keep_ids(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.ids.append((kwargs["input_ids"] if "input_ids" in kwargs else args[0]).detach())

    def clear(self) -> None:
        self.hidden.clear()
        self.ids.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def chain_forward(model: nn.Module, hooks: mtp_hooks.MTPHooks, probe: ChainProbe, tokens: Tensor, prompt: int, steps: int) -> tuple[Tensor, dict[str, float]]:
    """A training-style micro-batch under the eval hooks (grad enabled so the MTP block runs, never
    backpropagated): main-head logits ``[b, s, V]`` and the hooks' metrics; ``probe`` holds the
    steps' hidden states and embedding ids. Step j at position t predicts token t + j + 1."""
    device = device_of(model)
    labels, mask = next_token_targets(tokens, prompt)
    tokens = tokens.to(device)
    probe.clear()
    with torch.enable_grad(), hooks.micro_batch(labels=labels.to(device), loss_mask=mask.to(device)):
        logits = model(tokens, positions(tokens), None)
    metrics = hooks.metrics()
    layers = model.config.mtp_num_layers
    if len(probe.hidden) != steps - layers + 1 or len(probe.ids) != steps + 1:
        raise AssertionError(f"chain forward: {len(probe.hidden)} last-layer calls and {len(probe.ids)} embedding calls, "
                             f"expected {steps - layers + 1} and {steps + 1} for {steps} steps of {layers} layers")
    return logits.detach(), metrics


def _probs(hidden: Tensor, weight: Tensor, rows: Tensor, at: Tensor, temperature: float) -> Tensor:
    """``softmax(h[at, rows] @ W^T / T)`` ``[r, V]`` fp32 on the CPU, as the hooks' draft sampler scores it."""
    h = hidden[at.to(hidden.device), rows.to(hidden.device)]
    return torch.softmax((h @ weight.t()).float() / temperature, dim=-1).cpu()


def chain_drafter(model: nn.Module, hooks: mtp_hooks.MTPHooks, probe: ChainProbe, prompt: int, gen: torch.Generator,
                  temperature: float, steps: int, seed: int) -> Drafter:
    """A ``steps``-step draft chain of an N = 1 model drafting as an engine does (module docstring), as the
    draft of ``speculative_sampling``; ``hooks`` are the eval hooks. Their own draws use torch's default
    generator, seeded per verification step from ``seed`` (restored after); step k's draft comes from ``gen``."""
    device = device_of(model)
    weight = model.output_layer.weight.detach()
    devices = [device.index or 0] if device.type == "cuda" else []

    def draft(buffer: Tensor, at: Tensor, step: int) -> Proposal:
        idx = torch.arange(buffer.shape[0])
        t = at - 2  # step j at t embeds the token at t + 1 (the last target token) and predicts t + j + 1
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed * 100_003 + step)
            chain_forward(model, hooks, probe, buffer, prompt, steps)
        q = torch.stack([_probs(h, weight, idx, t, temperature) for h in probe.hidden], dim=1)
        fed = [probe.ids[j][idx.to(device), t.to(device)].cpu() for j in range(2, steps + 1)]
        drafts = torch.stack(fed + [torch.multinomial(q[:, -1], 1, generator=gen).squeeze(-1)], dim=1)
        proposed = buffer.clone()
        for j in range(steps):
            proposed[idx, at + j] = drafts[:, j]
        with torch.no_grad():
            ids = proposed.to(device)
            logits = model(ids, positions(ids), None)
        picked = torch.stack([logits[idx.to(device), (at - 1 + j).to(device)].float().cpu() for j in range(steps + 1)], dim=1)
        return Proposal(drafts, q, torch.softmax(picked / temperature, dim=-1))

    return draft


def chain_speculative_sampling(
    model: nn.Module, hooks: mtp_hooks.MTPHooks, probe: ChainProbe, prompts: Tensor, length: int, gen: torch.Generator,
    temperature: float, steps: int, seed: int,
) -> SpeculativeStats:
    """Generate from the main head at ``temperature`` with ``chain_drafter``'s ``steps`` drafts per
    verification step, until no row has room for them and the target's token within ``length`` tokens."""
    if model.config.mtp_num_layers != 1:
        raise ValueError(f"chain_speculative_sampling: expected an N = 1 model (every step a call of its one MTP layer), got N = {model.config.mtp_num_layers}")
    drafter = chain_drafter(model, hooks, probe, prompts.shape[1], gen, temperature, steps, seed)
    return speculative_sampling(drafter, prompts, length, steps, gen)[1]


__all__ = ["ChainProbe", "chain_drafter", "chain_forward", "chain_speculative_sampling", "parse_variant", "training_options"]
