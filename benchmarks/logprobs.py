"""Main-head output modes and draft objectives: time and peak memory of one training micro-batch.

``python -m benchmarks.logprobs`` compares, on one model shape (the config's base shape unless
overridden), a training micro-batch with hooks attached in two ways, the MTP layers training in
the same forward in both:

* ``logits``: ``output="logits"``; the user's loss takes ``log_softmax`` of the returned
  ``[b, s, V]`` logits (in fp32) and gathers the labels' log-probs (``--entropy``: and the entropy);
* ``logprobs``: ``output="logprobs"``; the model returns the labels' log-probs (and entropy)
  computed in chunks from the final hidden states, never ``[b, s, V]`` logits.

The user's loss is a masked policy-gradient loss with random advantages (plus an entropy bonus
with ``--entropy``). ``python -m benchmarks.logprobs --agreement`` instead times a training
micro-batch of the default benchmark (stock CE main loss on logits, as ``benchmarks.run``) with
``agreement_metrics`` off and on, and with the ``"distill"`` and ``"tv"`` objectives.

Method: one process, every variant's model built up front; warm-up, then ``--repeats`` timed
micro-batches with the variants interleaved (interference from other processes then hits all
alike; the median and the fastest are reported), then one peak-memory probe per variant
(``benchmarks.measure``: on CPU the growth of the resident set over what was live before the
call, on CUDA of the allocator's peak). The first micro-batch of each variant is checked to give
the same log-probs (or MTP losses) as the first variant's.

Examples::

    python -m benchmarks.logprobs                                    # cpu base: V 16384, s 256, h 128
    python -m benchmarks.logprobs --vocab 151552 --hidden 256 --seq 512
    python -m benchmarks.logprobs --config gpu --vocab 151552        # one CUDA device, bf16
    python -m benchmarks.logprobs --agreement                        # cost of agreement_metrics
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import sys
import warnings
from typing import Any, Callable, Optional

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|tp_group is None|ffn_hidden_size|full scope).*")

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import mtp_hooks  # noqa: E402
from benchmarks import models  # noqa: E402
from benchmarks.configs import CONFIGS, Config, Shape  # noqa: E402
from benchmarks.measure import Meter  # noqa: E402
from benchmarks.environment import environment  # noqa: E402
from benchmarks.variants import main_loss, masked_mean  # noqa: E402

MiB = 2**20


@dataclasses.dataclass
class Prepared:
    """A built, hooked model and its training step; ``step`` returns what is compared across variants."""

    name: str
    model: nn.Module
    hooks: mtp_hooks.MTPHooks
    step: Callable[[], Tensor]


def _policy_loss(logprobs: Tensor, entropy: Optional[Tensor], batch: models.Batch, advantages: Tensor) -> Tensor:
    loss = -masked_mean(advantages * logprobs, batch.loss_mask)
    if entropy is not None:
        loss = loss - 0.01 * masked_mean(entropy, batch.loss_mask)
    return loss


def prepare_output_mode(config: Config, shape: Shape, output: str, entropy: bool) -> Prepared:
    """A model returning logits (the user takes log-probs from them) or log-probs directly."""
    model = models.build(config, shape, shape.mtp)
    batch = models.make_batch(config, shape)
    gen = torch.Generator().manual_seed(1)
    advantages = torch.randn(shape.batch, shape.seq, generator=gen).to(config.device)
    hooks = mtp_hooks.attach(model, output=output, entropy=entropy and output == "logprobs", chunk_size=config.chunk_size)

    def logits_step() -> Tensor:
        with hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
            logits = model(*batch.model_args)
        log_p = torch.log_softmax(logits.float(), dim=-1)
        logprobs = log_p.gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)
        token_entropy = -(log_p.exp() * log_p).sum(-1) if entropy else None
        del logits, log_p  # as a user loss would: only the graph keeps them
        _policy_loss(logprobs, token_entropy, batch, advantages).backward()
        return logprobs.detach()

    def logprobs_step() -> Tensor:
        out = model(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
        _policy_loss(out.logprobs, out.entropy, batch, advantages).backward()
        return out.logprobs.detach()

    return Prepared(output, model, hooks, logits_step if output == "logits" else logprobs_step)


def prepare_draft(config: Config, shape: Shape, name: str, **options: Any) -> Prepared:
    """The default benchmark's training micro-batch (mcore CE on the logits) with these hooks options."""
    model = models.build(config, shape, shape.mtp)
    batch = models.make_batch(config, shape)
    hooks = mtp_hooks.attach(model, chunk_size=config.chunk_size, **options)

    def step() -> Tensor:
        with hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
            loss = main_loss(model(*batch.model_args), batch)
        loss.backward()
        metrics = hooks.metrics()
        return torch.tensor([metrics[f"mtp_{k}/loss"] for k in range(1, hooks.depth + 1)])

    return Prepared(name, model, hooks, step)


def measure(prepared: list[Prepared], meter: Meter, repeats: int, warmup: int) -> dict[str, dict[str, Any]]:
    """Warm-up, interleaved timed runs, then one peak-memory probe per variant."""
    results: dict[str, dict[str, Any]] = {p.name: {"train_s": []} for p in prepared}
    first: dict[str, Tensor] = {}
    for i in range(warmup):
        for p in prepared:
            p.model.zero_grad(set_to_none=True)
            out = p.step()
            if i == 0:
                first[p.name] = out.float().cpu()
    reference = prepared[0].name
    for p in prepared:
        # The variants compute the same quantities on the same weights and batch.
        diff = float((first[p.name] - first[reference]).abs().max())
        results[p.name]["max_abs_diff_vs_" + reference] = diff
    for _ in range(repeats):
        for p in prepared:
            p.model.zero_grad(set_to_none=True)  # outside the timed call: gradients are allocated inside it
            results[p.name]["train_s"].append(meter.time(p.step))
    meter.exact_cpu_memory()
    for p in prepared:
        p.model.zero_grad(set_to_none=True)
        gc.collect()
        growth, absolute = meter.peak_growth(p.step)
        results[p.name]["train_mem"] = growth
        results[p.name]["train_mem_abs"] = absolute
    return results


def _table(results: dict[str, dict[str, Any]], baseline: str) -> str:
    base_time = statistics.median(results[baseline]["train_s"])
    base_mem = results[baseline]["train_mem"]
    lines = [
        f"| variant | train median (s) | fastest (s) | time vs {baseline} | peak memory (MiB) | memory vs {baseline} | max abs diff |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        median = statistics.median(r["train_s"])
        diff = next(v for k, v in r.items() if k.startswith("max_abs_diff"))
        lines.append(
            f"| {name} | {median:.3f} | {min(r['train_s']):.3f} | {median / base_time:.2f}x | "
            f"{r['train_mem'] / MiB:.0f} | {r['train_mem'] / max(base_mem, 1):.2f}x | {diff:.1e} |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="cpu", choices=sorted(CONFIGS), help="device, dtype and base shape (default: cpu)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size (e.g. 151552)")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--mtp", type=int, default=None, help="number of MTP layers N")
    parser.add_argument("--repeats", type=int, default=None, help="timed micro-batches per variant (default: the config's)")
    parser.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (default: the library's)")
    parser.add_argument("--entropy", action="store_true", help="also compute the per-token entropy")
    parser.add_argument("--agreement", action="store_true", help="time agreement_metrics and draft objectives instead")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's); 1 is steadier on a shared CPU")
    parser.add_argument("--out", default=None, help="also write the results as JSON to this file")
    args = parser.parse_args(argv)
    config = CONFIGS[args.config]
    given = dict(vocab=args.vocab, hidden=args.hidden, seq=args.seq, batch=args.batch, layers=args.layers, mtp=args.mtp)
    overrides = {k: v for k, v in given.items() if v is not None}
    shape = dataclasses.replace(config.base, **overrides)
    if args.chunk_size is not None:
        config = dataclasses.replace(config, chunk_size=args.chunk_size)
    repeats = config.rounds if args.repeats is None else args.repeats
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    meter = Meter(config.device)
    with contextlib.ExitStack() as stack:
        models.setup(config, stack)
        if args.agreement:
            prepared = [
                prepare_draft(config, shape, "ce"),
                prepare_draft(config, shape, "ce + agreement_metrics", agreement_metrics=True),
                prepare_draft(config, shape, "distill", objective="distill"),
                prepare_draft(config, shape, "tv", objective="tv"),
            ]
        else:
            prepared = [prepare_output_mode(config, shape, output, args.entropy) for output in ("logits", "logprobs")]
        results = measure(prepared, meter, repeats, max(config.warmup, 1))
        env = environment(config)
    baseline = prepared[0].name
    what = "agreement metrics and objectives" if args.agreement else f"output modes{' with entropy' if args.entropy else ''}"
    print(f"{what}: {shape} on {config.device} ({config.dtype}, {env['cpu_threads']} threads), {repeats} timed micro-batches each")
    print(_table(results, baseline))
    if not args.agreement:
        logits_bytes = shape.seq * shape.batch * shape.vocab * 4
        print(f"(one fp32 [b, s, V] logits tensor: {logits_bytes / MiB:.0f} MiB)")
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"shape": dataclasses.asdict(shape), "config": config.name, "env": env, "results": results}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
