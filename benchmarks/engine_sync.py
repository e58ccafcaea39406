"""What a live weight sync costs: seconds and bytes per ``VLLMSync`` push, MTP layers against the whole model.

``python -m benchmarks.engine_sync`` (``make engine-sync-bench``, in ``.vllm``) builds a DeepSeek-V3-style
mcore model (MLA, a dense then MoE layers, one MoE MTP layer; ``mtp_hooks.testing.engine_models``) with
random weights, starts vLLM on it in this process (MTP speculative decoding, k = 1), and times, over
``--repeats`` rounds:

* pushing the MTP layers into the draft (what an RL step must sync), then checking them;
* pushing the main model into the target and the MTP layers into the draft (a whole-model sync).

Bytes are those of the pushed tensors (the trainer's fp32 here; bf16 tensors would halve them).
Prints a Markdown table and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable


def _timed(call: Callable[[], Any], repeats: int) -> tuple[list[float], Any]:
    seconds, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = call()
        seconds.append(time.perf_counter() - start)
    return seconds, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (default 512)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers of the main model (default 8)")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary (default 32768)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench-out/engine-sync.json")
    args = parser.parse_args(argv)

    import torch

    from mtp_hooks.engine import VLLMSync, start_vllm
    from mtp_hooks.export import mtp_hf_weights
    from mtp_hooks.testing import cuda_current_device_is_cpu, init_parallel
    from mtp_hooks.testing import engine_models as em

    family = "deepseek_v3"
    with cuda_current_device_is_cpu():
        init_parallel()
        from mtp_hooks.testing import moe_mla_on_cpu

        with moe_mla_on_cpu():
            model = em.shape(family, hidden_size=args.hidden, num_layers=args.layers, vocab_size=args.vocab).build()
    main_pairs = list(em.main_hf_pairs(model, family))
    mtp_pairs = list(mtp_hf_weights(model, em.LAYOUTS[family]))
    with tempfile.TemporaryDirectory() as folder:
        em.write_folder(Path(folder), family, model.config, [*main_pairs, *mtp_pairs], args.vocab)
        start = time.perf_counter()
        llm = start_vllm(folder, 1)
        startup = time.perf_counter() - start
        sync = VLLMSync(llm)
        push_mtp, report_mtp = _timed(lambda: sync.push(mtp_pairs), args.repeats)
        check_mtp, _ = _timed(lambda: sync.check(mtp_pairs), args.repeats)
        push_main, report_main = _timed(lambda: sync.push(main_pairs, model="target"), args.repeats)

    def row(what: str, seconds: list[float], tensors: int, size: int) -> dict[str, Any]:
        return {"what": what, "tensors": tensors, "bytes": size, "median_s": statistics.median(seconds), "seconds": seconds}

    rows = [
        row("push MTP layers (draft)", push_mtp, report_mtp.tensors, report_mtp.bytes),
        row("check MTP layers", check_mtp, report_mtp.tensors, report_mtp.bytes),
        row("push main model (target)", push_main, report_main.tensors, report_main.bytes),
    ]
    whole = rows[0]["median_s"] + rows[2]["median_s"]
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "model": {"family": family, "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "mtp_layers": 1},
        "versions": {"torch": torch.__version__, "vllm": __import__("vllm").__version__, "python": platform.python_version()},
        "engine_startup_s": startup,
        "rows": rows,
        "whole_model": {"bytes": report_mtp.bytes + report_main.bytes, "median_s": whole},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(f"\n{family}, hidden {args.hidden}, {args.layers} layers + 1 MTP layer, vocabulary {args.vocab} (engine startup {startup:.1f} s)\n")
    print("| sync | tensors | MB | median s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['what']} | {r['tensors']} | {r['bytes'] / 1e6:.1f} | {r['median_s']:.3f} |")
    print(f"| whole model (both pushes) | {report_mtp.tensors + report_main.tensors} | {record['whole_model']['bytes'] / 1e6:.1f} | {whole:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
