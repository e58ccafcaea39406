"""The MTP loss and the log-prob head at realistic vocabulary shapes, against stock's dense loss (CPU, fp32).

    .venv/bin/python -m benchmarks.loss_shapes [--vocab 129280] [--tokens 1024] [--hidden 128] [--rounds 3]

One MTP depth's loss on ``tokens`` hidden states of size ``hidden`` with an output weight
``[vocab, hidden]``, forward and backward:

* ``stock``: what stock mcore computes per depth: ``hidden @ W.T`` logits, mcore's
  ``vocab_parallel_cross_entropy``, the masked sum times the depth's coefficient; plain autograd.
* ``fused`` / ``recompute``: ``mtp_hooks.loss.lean_mtp_loss`` with mcore's gradient-accumulation
  protocol in effect (the weight carries an fp32 ``main_grad`` and ``grad_added_to_main_grad``,
  as under mcore DDP with ``gradient_accumulation_fusion=True``), chunk size from
  ``heads.auto_chunk_size``.
* ``logprobs``: ``mtp_hooks.logprobs.lean_logprobs`` (``output="logprobs"``) with entropy.

Reported per variant: FLOPs (``FlopCounterMode``), peak live bytes above what was live before
(``benchmarks.counters.LiveBytes``), host syncs and tensors made from host data, and CPU time as
the median of interleaved rounds with their spread. The derived floor of an exact chunked
implementation is what the call must hold at its peak: its outputs (the hidden gradient; under
the protocol mcore's ``[V, h]`` placeholder gradient, which DDP drops; without it the weight
gradient) plus one chunk's fp32 logits ``[chunk, V]`` and the per-token statistics.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.counters import HostSyncs, LiveBytes, count_flops
from mtp_hooks.heads import auto_chunk_size
from mtp_hooks.logprobs import lean_logprobs
from mtp_hooks.loss import lean_mtp_loss


class HostData(TorchDispatchMode):
    """Tensors lifted from Python data (``torch.tensor`` / ``as_tensor`` / ``new_tensor``): a
    host-to-device copy each on a GPU. The same counter as ``tests.test_host_syncs.HostData``."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func._schema.name in ("aten::lift_fresh", "aten::lift_fresh_copy"):
            self.count += 1
        return func(*args, **(kwargs or {}))


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
        out = lean_mtp_loss(
            x["hidden"], x["weight"], x["labels"], x["mask"] * coef, None, chunk, weight_grad=weight_grad,
            main_grad_protocol=hasattr(x["weight"], "main_grad"),
        )
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
}


def floor_bytes(name: str, vocab: int, tokens: int, hidden: int, chunk: int) -> int:
    """Outputs + one chunk's fp32 logits + per-token statistics (see the module docstring)."""
    outputs = tokens * hidden * 4 + vocab * hidden * 4  # hidden gradient; placeholder (protocol) or weight gradient
    return outputs + min(chunk, tokens) * vocab * 4 + 8 * tokens * 4


def _fresh(vocab: int, tokens: int, hidden: int, protocol: bool) -> dict[str, Any]:
    gc.collect()
    return _inputs(vocab, tokens, hidden, protocol)


def measure(vocab: int, tokens: int, hidden: int, rounds: int) -> dict[str, dict[str, Any]]:
    chunk = auto_chunk_size(vocab, tokens)
    results: dict[str, dict[str, Any]] = {}
    for name, (run, protocol) in VARIANTS.items():
        x = _fresh(vocab, tokens, hidden, protocol)
        flops, _ = count_flops(lambda: run(x, chunk))
        x = _fresh(vocab, tokens, hidden, protocol)
        live = LiveBytes()
        with live:
            run(x, chunk)
        x = _fresh(vocab, tokens, hidden, protocol)
        with HostSyncs() as syncs, HostData() as host_data:
            run(x, chunk)
        results[name] = {
            "flops": flops,
            "peak": live.peak,
            "floor": floor_bytes(name, vocab, tokens, hidden, chunk),
            "syncs": syncs.count,
            "host_data": host_data.count,
            "times": [],
        }
    for _ in range(rounds):  # interleaved: each round times every variant once
        for name, (run, protocol) in VARIANTS.items():
            x = _fresh(vocab, tokens, hidden, protocol)
            start = time.process_time()
            run(x, chunk)
            results[name]["times"].append(time.process_time() - start)
    results["_chunk"] = {"chunk": chunk}
    return results


def report(vocab: int, tokens: int, hidden: int, results: dict[str, dict[str, Any]]) -> str:
    stock = results["stock"]
    lines = [
        f"V={vocab:,}, tokens={tokens:,}, h={hidden}, chunk={results['_chunk']['chunk']} (fp32, CPU, torch threads {torch.get_num_threads()})",
        "| variant | FLOPs / stock | peak MiB | peak / floor | CPU s median [min, max] | time / stock | host syncs | host-data tensors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    stock_time = statistics.median(stock["times"])
    for name, r in results.items():
        if name.startswith("_"):
            continue
        t = r["times"]
        lines.append(
            f"| {name} | {r['flops'] / stock['flops']:.3f} | {r['peak'] / 2**20:,.1f} | {r['peak'] / r['floor']:.3f} | "
            f"{statistics.median(t):.2f} [{min(t):.2f}, {max(t):.2f}] | {statistics.median(t) / stock_time:.2f} | {r['syncs']} | {r['host_data']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=129_280)
    parser.add_argument("--tokens", type=int, default=1_024)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from tests.mcore_cpu import init_parallel  # mcore's CE reads the (one-rank) TP group

    init_parallel()
    print(report(args.vocab, args.tokens, args.hidden, measure(args.vocab, args.tokens, args.hidden, args.rounds)))


if __name__ == "__main__":
    main()
