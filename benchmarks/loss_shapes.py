"""The MTP loss and the log-prob head at realistic vocabulary shapes, against stock's dense loss (CPU, fp32).

    .venv/bin/python -m benchmarks.loss_shapes [--vocab 129280] [--tokens 1024] [--hidden 128] [--rounds 5]

``make bench`` (the ``cpu`` config's ``loss_shapes``) runs it at realistic shapes and publishes its tables.

One MTP depth's loss on ``tokens`` hidden states of size ``hidden`` with an output weight
``[vocab, hidden]``, forward and backward:

* ``stock``: what stock mcore computes per depth: ``hidden @ W.T`` logits, mcore's
  ``vocab_parallel_cross_entropy``, the masked sum times the depth's coefficient; plain autograd.
* ``fused`` / ``recompute``: ``mtp_hooks.ops.lean_loss.lean_mtp_loss`` with mcore's gradient-accumulation
  protocol in effect (the weight carries an fp32 ``main_grad`` and ``grad_added_to_main_grad``,
  as under mcore DDP with ``gradient_accumulation_fusion=True``), chunk size from
  ``ops.chunking.auto_chunk_size``.
* ``logprobs``: ``mtp_hooks.ops.logprobs.lean_logprobs`` (``output="logprobs"``) with entropy.
* ``accept``, ``accept_T0.7``: the fused path with ``objective="accept"`` against a teacher (the main
  head's input at the matching position) at temperature 1 and 0.7: stock's FLOPs plus the
  teacher's logits (one head matmul in forward, its weight detached), and one more chunk of fp32
  logits (the teacher's softmax) in the floor.

Reported per variant: FLOPs (``FlopCounterMode``), peak live bytes above what was live before
(``benchmarks.counters.LiveBytes``), host syncs and tensors made from host data, and process CPU
time from interleaved rounds: the median with its spread, and the per-round ratios to stock. The derived floor of an exact chunked
implementation is what the call must hold at its peak: its outputs (the hidden gradient; under
the protocol mcore's ``[V, h]`` placeholder gradient, which DDP drops; without it the weight
gradient) plus one chunk's fp32 logits ``[chunk, V]`` and the per-token statistics.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any, Callable

import torch

from benchmarks.counters import HostSyncs, HostToDevice, LiveBytes, count_flops
from benchmarks.cells import ratio_range
from benchmarks.verdicts import time_ratio, time_verdict, verdict
from mtp_hooks.ops.chunking import auto_chunk_size
from mtp_hooks.ops.logprobs import lean_logprobs
from mtp_hooks.ops.draft_rule import DraftRule
from mtp_hooks.ops.lean_loss import KernelSpec, lean_mtp_loss


def _inputs(vocab: int, tokens: int, hidden: int, protocol: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(vocab, hidden, generator=gen) * 0.02).requires_grad_(True)
    if protocol:
        weight.main_grad = torch.zeros(vocab, hidden)  # type: ignore[attr-defined]
        weight.grad_added_to_main_grad = False  # type: ignore[attr-defined]
    return {
        "hidden": torch.randn(tokens, hidden, generator=gen).requires_grad_(True),
        "weight": weight,
        "labels": torch.randint(0, vocab, (tokens,), generator=gen),
        "mask": (torch.rand(tokens, generator=gen) > 0.1).float(),
        "teacher": torch.randn(tokens, hidden, generator=gen),
    }


def stock_step(x: dict[str, Any], chunk: int) -> None:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = (x["hidden"] @ x["weight"].t()).unsqueeze(1)  # [s, b=1, V]
    ce = vocab_parallel_cross_entropy(logits, x["labels"].unsqueeze(1)).squeeze(1)
    coef = 0.1 / x["mask"].sum().clamp(min=1)
    ((ce * x["mask"]).sum() * coef).backward()


def lean_step(weight_grad: str) -> Callable[[dict[str, Any], int], None]:
    def run(x: dict[str, Any], chunk: int) -> None:
        coef = 0.1 / x["mask"].sum().clamp(min=1)
        spec = KernelSpec(None, chunk, weight_grad, main_grad_protocol=hasattr(x["weight"], "main_grad"))
        out = lean_mtp_loss(x["hidden"], x["weight"], x["labels"], x["mask"] * coef, spec)
        out.objective.backward()

    return run


def draft_step(objective: str, temperature: float) -> Callable[[dict[str, Any], int], None]:
    def run(x: dict[str, Any], chunk: int) -> None:
        coef = 0.1 / x["mask"].sum().clamp(min=1)
        spec = KernelSpec(None, chunk, "fused", main_grad_protocol=hasattr(x["weight"], "main_grad"))
        # The rejection-sampling rule the recorded figures were measured with (BENCHMARKS.md).
        rule = DraftRule(objective, temperature, "sampled")
        out = lean_mtp_loss(x["hidden"], x["weight"], x["labels"], x["mask"] * coef, spec, rule, x["teacher"])
        out.objective.backward()

    return run


def logprobs_step(x: dict[str, Any], chunk: int) -> None:
    out = lean_logprobs(x["hidden"], x["weight"], x["labels"], None, chunk, 1.0, True)
    assert out.entropy is not None
    (out.logprobs * x["mask"]).sum().add(out.entropy.mean()).backward()


VARIANTS: dict[str, tuple[Callable[[dict[str, Any], int], None], bool]] = {
    "stock": (stock_step, False),
    "fused": (lean_step("fused"), True),
    "recompute": (lean_step("recompute"), True),
    "logprobs": (logprobs_step, False),
    "accept": (draft_step("accept", 1.0), True),
    "accept_T0.7": (draft_step("accept", 0.7), True),
}
DRAFT_VARIANTS = ("accept", "accept_T0.7")


def floor_bytes(name: str, vocab: int, tokens: int, hidden: int, chunk: int) -> int:
    """Outputs + one chunk's fp32 logits + per-token statistics (see the module docstring)."""
    outputs = tokens * hidden * 4 + vocab * hidden * 4  # hidden gradient; placeholder (protocol) or weight gradient
    logits = (2 if name in DRAFT_VARIANTS else 1) * min(chunk, tokens) * vocab * 4  # the draft's and the teacher's
    return outputs + logits + 8 * tokens * 4


def _fresh(vocab: int, tokens: int, hidden: int, protocol: bool) -> dict[str, Any]:
    gc.collect()
    return _inputs(vocab, tokens, hidden, protocol)


def measure(vocab: int, tokens: int, hidden: int, rounds: int, log: Any = None) -> dict[str, Any]:
    """Every variant's exact counts (one call each) and ``rounds`` interleaved timed calls."""
    chunk = auto_chunk_size(vocab, tokens)
    variants: dict[str, dict[str, Any]] = {}
    for name, (run, protocol) in VARIANTS.items():
        x = _fresh(vocab, tokens, hidden, protocol)
        flops, _ = count_flops(lambda: run(x, chunk))
        x = _fresh(vocab, tokens, hidden, protocol)
        live = LiveBytes()
        with live:
            run(x, chunk)
        x = _fresh(vocab, tokens, hidden, protocol)
        with HostSyncs() as syncs, HostToDevice() as host_data:
            run(x, chunk)
        variants[name] = {
            "flops": flops,
            "peak": live.peak,
            "floor": floor_bytes(name, vocab, tokens, hidden, chunk),
            "syncs": syncs.count,
            "h2d": host_data.count,
            "cpu_s": [],
        }
    for index in range(rounds):  # interleaved, each round in an order rotated by its index
        names = list(VARIANTS)
        for name in names[index % len(names):] + names[: index % len(names)]:
            run, protocol = VARIANTS[name]
            x = _fresh(vocab, tokens, hidden, protocol)
            start = time.process_time()
            run(x, chunk)
            variants[name]["cpu_s"].append(time.process_time() - start)
        if log is not None:
            print(f"loss V={vocab:,} tokens={tokens:,}: round {index + 1}/{rounds}", file=log, flush=True)
    return {"vocab": vocab, "tokens": tokens, "hidden": hidden, "chunk": chunk, "rounds": rounds,
            "threads": torch.get_num_threads(), "variants": variants}


# Memory goals against the derived floor (issue: within 5% with gradient-accumulation fusion on, within
# 30% for the log-probs output); the time goal is the fused path's (the default where it is chosen).
PEAK_GOALS = {"fused": 1.05, "logprobs": 1.30}
TIMED_GOAL = "fused"


def summarize(measured: dict[str, Any]) -> dict[str, Any]:
    """Ratios to stock and to the floor, per-round time ratios, and every goal's verdict."""
    stock = measured["variants"]["stock"]
    rows = {}
    for name, v in measured["variants"].items():
        ratio = None if name == "stock" else time_ratio(v["cpu_s"], stock["cpu_s"])
        rows[name] = {
            **v,
            "flops_vs_stock": v["flops"] / stock["flops"],
            "peak_vs_floor": v["peak"] / v["floor"],
            "peak_ok": v["peak"] / v["floor"] <= PEAK_GOALS[name] if name in PEAK_GOALS else None,
            "time_vs_stock": ratio,
            "time_verdict": time_verdict(ratio) if name == TIMED_GOAL else None,
            "counts_ok": v["syncs"] == 0 and v["h2d"] == 0 if name != "stock" else None,
        }
    fused = rows[TIMED_GOAL]
    teacher_matmul = 2 * measured["tokens"] * measured["vocab"] * measured["hidden"]
    drafts_ok = all(rows[name]["flops"] == stock["flops"] + teacher_matmul for name in DRAFT_VARIANTS if name in rows)
    return {**{k: measured[k] for k in ("vocab", "tokens", "hidden", "chunk", "rounds", "threads")},
            "variants": rows, "flops_ok": fused["flops"] <= stock["flops"] and drafts_ok}


def markdown(summaries: list[dict[str, Any]]) -> str:
    """One table per shape: every variant's counts, ratios and the goals' verdicts."""
    lines = [
        "The MTP loss alone (`benchmarks/loss_shapes.py`): one depth's loss, forward and "
        "backward, fp32, mcore's gradient-accumulation protocol on for `fused` and `recompute` (the weight carries "
        "`main_grad`, as under mcore DDP with `gradient_accumulation_fusion=True`). Floor: the outputs (hidden "
        "gradient, mcore's `[V, h]` placeholder or the weight gradient) + one chunk's fp32 logits + per-token "
        f"statistics (`accept`, `accept_T0.7`: `objective=\"accept\"` at T = 1 and 0.7, fused, one more chunk of "
        f"logits for the teacher's softmax). Goals: FLOPs = stock (`accept*`: stock + the teacher's head matmul); peak ≤ {PEAK_GOALS['fused']:.2f} × floor (`fused`), ≤ "
        f"{PEAK_GOALS['logprobs']:.2f} × floor (`logprobs`); time ≤ 1.00 × stock (`fused`, per-round ratios of "
        "process CPU time); 0 host syncs, 0 host-to-device tensors.",
    ]
    for summary in summaries:
        lines += [
            "",
            f"V = {summary['vocab']:,}, tokens = {summary['tokens']:,}, h = {summary['hidden']}, chunk = "
            f"{summary['chunk']:,} tokens, {summary['rounds']} interleaved rounds, {summary['threads']} threads; "
            f"FLOPs = stock (`accept*`: + the teacher's matmul): {verdict(summary['flops_ok'])}",
            "",
            "| variant | FLOPs × stock | peak MiB | peak × floor | CPU s median (min–max) | time × stock, per round | "
            "host syncs, H2D |",
            "|---|---:|---:|---|---:|---|---|",
        ]
        for name, r in summary["variants"].items():
            t = r["cpu_s"]
            peak = f"{r['peak_vs_floor']:.3f}" + (f" {verdict(r['peak_ok'])}" if r["peak_ok"] is not None else "")
            ratio = "1.00" if r["time_vs_stock"] is None else ratio_range(r["time_vs_stock"])
            if r["time_verdict"]:
                ratio += f" {r['time_verdict']}"
            counts = f"{r['syncs']}, {r['h2d']}" + (f" {verdict(r['counts_ok'])}" if r["counts_ok"] is not None else "")
            lines.append(f"| {name} | {r['flops_vs_stock']:.3f} | {r['peak'] / 2**20:,.1f} | {peak} | "
                         f"{statistics.median(t):.2f} ({min(t):.2f}–{max(t):.2f}) | {ratio} | {counts} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=129_280)
    parser.add_argument("--tokens", type=int, default=1_024)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from mtp_hooks.testing import init_parallel  # mcore's CE reads the (one-rank) TP group

    init_parallel()
    print(markdown([summarize(measure(args.vocab, args.tokens, args.hidden, args.rounds))]))


if __name__ == "__main__":
    main()
