"""The draft chain in the acceptance benchmark: k draft steps from N MTP layers, as an engine drafts.

Variants ``<objective>[+tf|+chain]`` (``parse_variant``): plain, the N layers train teacher-forced
(mcore's own training); ``+tf``: ``attach(draft_steps=k, draft_inputs="labels")``, the chain of k
steps on the data's tokens; ``+chain``: ``draft_inputs="sample"`` at the rollout temperature, the
chain on its own sampled drafts. Every variant is evaluated the same way (``evaluate_chain``):

* expected acceptance per step along the own-draft chain: a never-backpropagated forward under
  eval hooks ``attach(draft_steps=k, draft_inputs="sample", agreement_metrics=True)``, whose
  ``mtp_j/accept`` is ``sum_v min(p, q_j)`` with q_j fed step j - 1's own sampled draft;
* ``chain_speculative_sampling``: a k-step speculative sampling loop that drafts as an engine
  does. From the last target token, step 1 is MTP layer 1 on the main hidden state and that
  token; steps 2..k call the last MTP layer again on the previous step's output hidden state and
  the previous step's own sampled draft. The drafts of steps 1..k-1 are the ones the eval hooks
  fed the next step (read at the embedding's calls), step k's is drawn here; one target forward
  verifies all k (accept with ``min(1, p/q)``, resample the first rejected from
  ``max(p - q, 0)``, or add the target's bonus token).

Each step's attention runs over that step's states at every earlier position (mcore's depth
geometry, as the hooks train it); an engine's cache would hold step 1's states there.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor, nn

import mtp_hooks
from benchmarks.acceptance.drafts import SpeculativeStats, _residual_sample, chain_tokens_per_step, device_of, expected_acceptance, positions
from benchmarks.acceptance.task import next_token_targets

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
    options: dict[str, Any] = dict(detach_encoder=True, detach_head=True, objective="ce" if objective == "frozen" else objective,
                                   agreement_metrics=True, draft_temperature=temperature)
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


def verify(p: Tensor, q: Tensor, drafts: Tensor, bonus: Tensor, gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Speculative sampling's verification of k drafts per row: ``p``, ``q`` ``[r, k, V]`` (target and
    draft at each drafted position), ``drafts`` ``[r, k]``, ``bonus`` ``[r, V]`` (the target after all k).

    Returns ``ok`` ``[r, k]`` (draft j accepted, all before it too), the tokens ``[r, k + 1]`` to
    append (the first ``1 + ok.sum(1)`` of each row count) and the exact acceptance ``sum_v min(p, q)`` ``[r, k]``.
    """
    rows, k = drafts.shape
    idx = torch.arange(rows)
    u = torch.rand(rows, k, generator=gen)
    ratio = torch.stack([(p[idx, j, drafts[:, j]] / q[idx, j, drafts[:, j]]).clamp(max=1) for j in range(k)], dim=1)
    ok = torch.cumprod((u < ratio).long(), dim=1).bool()
    fixes = torch.stack([_residual_sample(p[:, j], q[:, j], gen) for j in range(k)], dim=1)
    extra = torch.multinomial(bonus, 1, generator=gen).squeeze(-1)
    accepted = ok.sum(1)
    tokens = torch.cat([drafts, torch.zeros(rows, 1, dtype=drafts.dtype)], dim=1)
    tokens[idx, accepted] = torch.where(accepted == k, extra, fixes[idx, accepted.clamp(max=k - 1)])
    return ok, tokens, torch.minimum(p, q).sum(-1)


def chain_speculative_sampling(
    model: nn.Module, hooks: mtp_hooks.MTPHooks, probe: ChainProbe, prompts: Tensor, length: int, gen: torch.Generator,
    temperature: float, steps: int, seed: int,
) -> SpeculativeStats:
    """Generate from the main head at ``temperature`` with a ``steps``-step draft chain drafting as an
    engine does (module docstring); ``hooks`` are the eval hooks. The hooks' own draws use torch's
    default generator, seeded per verification step from ``seed`` (restored after), the loop's
    from ``gen``. Full recompute per forward (small models)."""
    if model.config.mtp_num_layers != 1:
        raise ValueError(f"chain_speculative_sampling: expected an N = 1 model (every step a call of its one MTP layer), got N = {model.config.mtp_num_layers}")
    rows, start = prompts.shape
    buffer = torch.zeros(rows, length + 1, dtype=torch.long)
    buffer[:, :start] = prompts
    n = torch.full((rows,), start)
    stats = SpeculativeStats([0] * steps, [0] * steps, [0.0] * steps)
    idx = torch.arange(rows)
    device = device_of(model)
    weight = model.output_layer.weight.detach()
    devices = [device.index or 0] if device.type == "cuda" else []
    for step in range(length):
        active = n <= length - steps  # room for the k drafts and the target's token
        if not bool(active.any()):
            return stats
        at = torch.where(active, n, start)  # finished rows: any in-range position, results unused
        t = at - 2  # step j at t embeds the token at t + 1 (the last target token) and predicts t + j + 1
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed * 100_003 + step)
            chain_forward(model, hooks, probe, buffer, start, steps)
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
        p = torch.softmax(picked / temperature, dim=-1)
        ok, tokens, overlap = verify(p[:, :steps], q, drafts, p[:, steps], gen)
        tried = torch.cat([active[:, None], active[:, None] & ok[:, :-1]], dim=1)
        for j in range(steps):
            stats.tried[j] += int(tried[:, j].sum())
            stats.accepted[j] += int((tried[:, j] & ok[:, j]).sum())
            stats.expected[j] += float(overlap[:, j][tried[:, j]].sum())
        new = 1 + ok.sum(1)
        stats.steps += int(active.sum())
        stats.tokens += int(new[active].sum())
        for r in idx[active].tolist():
            s, count = int(n[r]), int(new[r])
            buffer[r, s : s + count] = tokens[r, :count]
            n[r] = s + count
    return stats


def evaluate_chain(arm: Any, rollouts: Tensor, setting: Any, seed: int, temperature: float) -> dict[str, Any]:
    """Held-out draft quality of one variant drafting ``setting.chain`` steps: the hooks' own-draft
    chain metrics and the engine-style loop. The arm's training hooks are swapped for eval hooks
    for the evaluation and re-attached after (its optimizers hold the parameters: unaffected)."""
    steps, model = setting.chain, arm.model
    arm.hooks.remove()
    hooks = mtp_hooks.attach(model, draft_steps=steps, draft_inputs="sample", draft_temperature=temperature, agreement_metrics=True)
    probe = ChainProbe(model)
    try:
        _, mask = next_token_targets(rollouts, setting.prompt)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            logits, metrics = chain_forward(model, hooks, probe, rollouts, setting.prompt, steps)
        weight = model.output_layer.weight.detach()
        with torch.no_grad():
            main = torch.log_softmax(logits.float() / temperature, dim=-1)
            drafts = [torch.log_softmax((h @ weight.t()).transpose(0, 1).float() / temperature, dim=-1) for h in probe.hidden]
        accepts = [metrics[f"mtp_{j}/accept"] for j in range(1, steps + 1)]
        own = expected_acceptance(main, drafts, mask)
        del main, drafts, logits
        spec = chain_speculative_sampling(model, hooks, probe, rollouts[:, : setting.prompt], setting.seq,
                                          torch.Generator().manual_seed(seed), temperature, steps, seed)
    finally:
        probe.remove()
        hooks.remove()
        arm.hooks = mtp_hooks.attach(model, **training_options(arm.name, temperature, steps))
    return {
        "accept": accepts,
        "agree": [metrics[f"mtp_{j}/agree"] for j in range(1, steps + 1)],
        "accept_len": metrics.get("mtp/accept_len", math.nan),
        "accept_recomputed_max_diff": max(abs(a - b) for a, b in zip(accepts, own)),
        "tokens_per_step": chain_tokens_per_step(accepts),
        **spec.summary(),
    }


__all__ = ["ChainProbe", "chain_forward", "chain_speculative_sampling", "evaluate_chain", "parse_variant", "training_options", "verify"]
