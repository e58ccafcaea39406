"""The cost benchmark's Markdown: base-shape tables, the goals, the draft chain, one table per sweep, the trainer.

``markdown(config, result)`` writes ``results.md`` (and BENCHMARKS.md's results block with ``--publish``) from
``verdicts.summarize``'s result; every figure goes through ``cells``, every verdict comes from ``verdicts``.
"""

from __future__ import annotations

from typing import Any, Optional

from benchmarks.cells import counted, gflop, load_range, mib, ms_range, number, ratio_range, x_stock
from benchmarks.configs import SWEEP_ATTRIBUTES, SWEEP_SYMBOLS, Config, sweep_title, sweeps
from benchmarks.headlines import headline
from benchmarks.variants import CHAIN_VARIANTS, DEFAULT_HOOKS, TRAINER_VARIANTS
from benchmarks.verdicts import NA, memory_verdict, time_key, time_ratio, verdict

GOALS = {
    "flops": "training FLOPs, lean ≤ stock",
    "detach_flops": "training FLOPs, lean + `detach_head` ≤ stock − N·2·T·h·V/tp",
    "memory": "training peak live memory ≤ stock − 0.9·N·T·V/tp·4 bytes (+ V/tp·h·4 accumulator on the fused path)",
    "inference": "inference micro-batch: FLOPs and peak equal the model without MTP layers",
    "syncs": "host syncs per training + inference micro-batch: 0",
    "h2d": "host-to-device tensors per training + inference micro-batch: lean ≤ stock",
    "time": "training time lean / stock ≤ 1.00 (per-round ratios of interleaved rounds)",
}


def markdown(config: Config, result: dict[str, Any], plot_name: Optional[str] = None) -> str:
    """Headline, base-shape tables (training, inference), goals, one table per sweep, the trainer table."""
    env, base = result["env"], config.base
    point = result["points"].get(base.key, {"variants": {}, "goals": {}})
    where = env.get("gpu") or f"{env.get('cpu_model', 'CPU')}, {env.get('cpu_threads')} threads"
    memory_how = "LiveBytes: bytes of live tensor storages" if config.device == "cpu" else "torch.cuda.max_memory_allocated"
    basis = result.get("time_basis", "wall time")
    verl = env.get("verl")
    lines = [
        headline(config, result),
        "",
        f"Config `{config.name}` ({where}; torch {env.get('torch')}, megatron-core {env.get('megatron_core')}, "
        f"mtp_hooks {env.get('mtp_hooks')}, verl {verl or 'not installed'}, {str(config.dtype).replace('torch.', '')}, "
        f"{env.get('date', '')[:10]}; {_load(env)}). "
        f"Base shape: V = {base.vocab:,}, s = {base.seq:,}, b = {base.batch}, h = {base.hidden:,}, "
        f"transformer layers = {base.layers}, N = {base.mtp}. FLOPs: `FlopCounterMode` with in-place matmuls and CPU "
        f"attention added; peak: the most bytes live above those live before the micro-batch "
        f"({memory_how}); host syncs: `_local_scalar_dense` / `is_nonzero` / `nonzero` / `item` / device→host copies; "
        f"H2D: tensors made from host data (`lift_fresh`) or copied host→device; "
        f"time: median (min–max) of {config.rounds} interleaved rounds, verdicts on {basis}."
        + ("" if result.get("seconds") is None else f" Whole run: {result['seconds']:.0f} s.")
        + ("" if result.get("complete", True) else
           f" **Partial run**: {len(result['points'])} of {len(config.shapes())} shapes measured before it was stopped "
           "(the seconds are those of the measured shapes)."),
    ]
    for name, why in result["refused"].items():
        lines += ["", f"Variant `{name}` skipped: {why}."]
    lines += ["", "Training micro-batch (forward + main loss + backward), base shape. Floors: FLOPs that must happen, "
              "memory that must be held (see [Method](docs/benchmarks.md#method)).", "",
              "| variant | loss path | GFLOP | × stock | × floor | peak MiB | × stock | × floor | host syncs | H2D | "
              f"{basis} ms | × stock (per round) | wall ms |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    stock = point["variants"].get("stock")
    cpu = config.device == "cpu"
    for name in result["variants"]:
        v = point["variants"].get(name)
        if v is None or name in TRAINER_VARIANTS:
            continue
        tr = v["train"]
        flops_x = f"{tr['flops'] / stock['train']['flops']:.3f}" if stock else "–"
        peak_x = f"{tr['peak_bytes'] / stock['train']['peak_bytes']:.3f}" if stock else "–"
        main_time = v["train_cpu_time"] if cpu else v["train_time"]
        lines.append(
            f"| {v['label']} | {v.get('loss_path') or '–'} | {gflop(tr['flops'])} | {flops_x} | {number(v.get('flops_vs_floor'))} | "
            f"{mib(tr['peak_bytes'])} | {peak_x} | {number(v.get('memory_vs_floor'), 2)} | {counted(tr, 'syncs')} | {counted(tr, 'h2d')} | "
            f"{ms_range(main_time)} | {ratio_range(v['train_time_vs_stock'])} | {ms_range(v['train_time'])} |"
        )
    lines += ["", "Inference micro-batch (forward under `no_grad`), base shape:", "",
              f"| variant | GFLOP | − no-MTP GFLOP | peak MiB | − no-MTP MiB | host syncs | H2D | {basis} ms |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    floor = point["variants"].get("no_mtp")
    for name in result["variants"]:
        v = point["variants"].get(name)
        if v is None or name in TRAINER_VARIANTS:
            continue
        inf = v["infer"]
        d_flops = gflop(inf["flops"] - floor["infer"]["flops"]) if floor else "–"
        d_peak = mib(inf["peak_bytes"] - floor["infer"]["peak_bytes"]) if floor else "–"
        lines.append(f"| {v['label']} | {gflop(inf['flops'])} | {d_flops} | {mib(inf['peak_bytes'])} | {d_peak} | "
                     f"{counted(inf, 'syncs')} | {counted(inf, 'h2d')} | {ms_range(v['infer_cpu_time'] if cpu else v['infer_time'])} |")
    lines += ["", "Stock mcore cannot run a forward without labels, so its inference row runs with labels under "
              "`torch.no_grad` (MTP block, MTP heads and cross-entropy included) and returns losses, not logits. "
              "verl's engine passes labels to its `no_grad` log-prob passes too, so its patch runs the MTP block and "
              "heads there as well, and returns logits."]
    lines += ["", *_goal_lines(config, point["goals"])]
    lines += _chain_lines(config, point["variants"])
    for sweep in sweeps(config):
        lines += ["", *_sweep_lines(config, result, sweep, sweep_title(config, sweep))]
    lines += ["", *_trainer_lines(config, result)]
    if plot_name:
        lines += ["", f"![training FLOPs, peak live memory and time by variant; lower is better]({plot_name})"]
    return "\n".join(lines) + "\n"


def _load(env: dict[str, Any]) -> str:
    """The machine's 1-minute load average at the start and end of the run, in words."""
    start, end = env.get("load_start"), env.get("load_end")
    if not start:
        return "load not recorded"
    text = f"load average {start[0]:.2f} at the start"
    if end:
        text += f", {end[0]:.2f} at the end"
    return text + f" (1-minute, {env.get('cpu_count')} CPUs)"


def _goal_lines(config: Config, g: dict[str, Any]) -> list[str]:
    """The goals table at the base shape: each goal, lean's measured figure and the verdict."""
    lines = [f"Goals for `mtp_hooks` lean (`attach(model)`, the default), base shape; every sweep point below.", "",
             "| goal | measured | verdict |", "|---|---|---|"]
    if "flops_ratio" in g:
        lines.append(f"| {GOALS['flops']} | {g['flops_ratio']:.3f} × stock | {verdict(g['flops_ok'])} |")
    if "detach_flops" in g:
        lines.append(f"| {GOALS['detach_flops']} | {x_stock(g['detach_flops'], g)} vs bound {x_stock(g['detach_flops_bound'], g)} "
                     f"({g['detach_flops']:,} vs {g['detach_flops_bound']:,} FLOPs) | {verdict(g['detach_flops_ok'])} |")
    if "memory" in g:
        acc = f" (accumulator {mib(g['memory_accumulator'])} MiB included)" if g["memory_accumulator"] else ""
        lines.append(f"| {GOALS['memory']} | {mib(g['memory'])} MiB vs target {mib(g['memory_target'])} MiB{acc}; "
                     f"stock {mib(g['memory_stock'])} MiB | {memory_verdict(g)} |")
    if "inference_ok" in g:
        lines.append(f"| {GOALS['inference']} | {g['infer_flops']:,} vs {g['infer_flops_floor']:,} FLOPs; "
                     f"{g['infer_peak']:,} vs {g['infer_peak_floor']:,} bytes | {verdict(g['inference_ok'])} |")
    if "syncs" in g:
        lines.append(f"| {GOALS['syncs']} | {g['syncs']} | {verdict(g['syncs_ok'])} |")
    if "h2d" in g:
        lines.append(f"| {GOALS['h2d']} | {g['h2d']} vs stock {g['h2d_stock']} | {verdict(g['h2d_ok'])} |")
    if "time" in g:
        wall = f"; wall {ratio_range(g['wall'])}" if g.get("wall") else ""
        lines.append(f"| {GOALS['time']} | {ratio_range(g['time'])}{wall} | {g['time_verdict']} |")
    return lines


def _chain_lines(config: Config, variants: dict[str, Any]) -> list[str]:
    """The draft chain's training cost per step past N: against ``draft_steps`` = N (the default
    hooks) and against the no-MTP floor, in FLOPs and peak live memory."""
    base, floor = variants.get(DEFAULT_HOOKS), variants.get("no_mtp")
    rows = [(name, variants[name], options) for name, (_label, options) in CHAIN_VARIANTS.items() if name in variants]
    if base is None or floor is None or not rows:
        return []
    depth = config.base.mtp
    lines = ["", f"The draft chain (`draft_steps` past the model's N = {depth} layers), training micro-batch, base shape: "
             "the cost of each step past N, against `draft_steps` = N (`attach(model)`) and the no-MTP floor. A teacher-forced "
             "step costs what one of today's depths costs; fed drafts add one no-grad head matmul per step after the first "
             "(steps 2..N included), spread here over the steps past N.", "",
             "| variant | steps past N | GFLOP per step past N | × N-step MTP GFLOP per step | peak MiB per step past N | peak × floor |",
             "|---|---:|---:|---:|---:|---:|"]
    mtp_flops = (base["train"]["flops"] - floor["train"]["flops"]) / depth  # one depth of today's MTP work
    for _name, v, options in rows:
        extra = options["draft_steps"] - depth
        d_flops = (v["train"]["flops"] - base["train"]["flops"]) / extra
        d_peak = (v["train"]["peak_bytes"] - base["train"]["peak_bytes"]) / extra
        lines.append(f"| {v['label']} | {extra} | {gflop(d_flops)} | {d_flops / mtp_flops:.3f} | {mib(d_peak)} | "
                     f"{v['train']['peak_bytes'] / floor['train']['peak_bytes']:.2f} |")
    return lines


def _sweep_lines(config: Config, result: dict[str, Any], sweep: str, title: str) -> list[str]:
    """One sweep's table: a row per point, lean's figure and verdict for every goal, verl's figures, the load."""
    symbol = SWEEP_SYMBOLS[sweep]
    lines = [
        f"Sweep over {title} (other dimensions at the base shape); each cell: lean's figure and its verdict.",
        "",
        f"| {symbol} | stock GFLOP | lean FLOPs × stock | detach_head FLOPs / bound | lean peak / target MiB | host syncs "
        "| inference = no-MTP | time lean / stock | lean peak × floor | verl: peak MiB, host syncs, inference GFLOP (no-MTP) | load |",
        "|---:|---:|---|---|---|---|---|---|---:|---|---:|",
    ]
    for name, shape in config.points():
        if name != sweep:
            continue
        point = result["points"].get(shape.key)
        if point is None:
            continue
        g, stock, lean = point["goals"], point["variants"].get("stock"), point["variants"].get(DEFAULT_HOOKS)
        flops = _cell(f"{g['flops_ratio']:.3f}", g["flops_ok"]) if "flops_ratio" in g else "–"
        detach = (_cell(f"{x_stock(g['detach_flops'], g)} / {x_stock(g['detach_flops_bound'], g)}", g["detach_flops_ok"])
                  if "detach_flops" in g else "–")
        memory = f"{mib(g['memory'])} / {mib(g['memory_target'])} {memory_verdict(g)}" if "memory" in g else "–"
        syncs = _cell(str(g["syncs"]), g["syncs_ok"]) if "syncs" in g else "–"
        infer = verdict(g.get("inference_ok"))
        time_cell = f"{ratio_range(g.get('time'))} {g.get('time_verdict', NA)}" if g.get("time") else NA
        lines.append(f"| {getattr(shape, SWEEP_ATTRIBUTES[sweep]):,} | {gflop(stock['train']['flops']) if stock else '–'} | {flops} | {detach} | "
                     f"{memory} | {syncs} | {infer} | {time_cell} | {number(lean.get('memory_vs_floor'), 2) if lean else '–'} | "
                     f"{_verl_cell(point['variants'])} | {load_range(point.get('load'))} |")
    return lines


def _cell(text: str, ok: Optional[bool]) -> str:
    """A figure with its verdict, where the goal was judged."""
    return f"{text} {verdict(ok)}" if ok is not None else text


def _verl_cell(variants: dict[str, Any]) -> str:
    """verl's training peak, host syncs (training + inference) and inference GFLOP (the no-MTP model's in brackets)."""
    verl, plain = variants.get("verl"), variants.get("no_mtp")
    if verl is None:
        return "–"
    floor = f" ({gflop(plain['infer']['flops'])})" if plain else ""
    return f"{mib(verl['train']['peak_bytes'])}, {verl['train']['syncs']} + {verl['infer']['syncs']}, {gflop(verl['infer']['flops'])}{floor}"


def _trainer_lines(config: Config, result: dict[str, Any]) -> list[str]:
    """An RL trainer's own loss on logits vs on ``output="logprobs"``, at every measured shape."""
    lines = ['An RL trainer\'s loss (policy gradient + entropy bonus from per-token log-probs and entropies), MTP '
             'training in the same forward: from the returned logits (`log_softmax` in fp32, `gather`, entropy) or '
             'from `output="logprobs", entropy=True`. Training micro-batch; the inference column is the old-policy '
             'pass (same log-probs under `no_grad`).', "",
             '| shape | logits GFLOP | logprobs GFLOP | logits peak MiB | logprobs peak MiB | logprobs / logits peak | '
             'inference peak MiB logits / logprobs | logprobs / logits time |',
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    key = time_key(config)
    for shape_key, point in result["points"].items():
        a, b = point["variants"].get("trainer_logits"), point["variants"].get("trainer_logprobs")
        if not (a and b):
            continue
        t = time_ratio(b[key], a[key])
        lines.append(f"| {shape_key} | {gflop(a['train']['flops'])} | {gflop(b['train']['flops'])} | "
                     f"{mib(a['train']['peak_bytes'])} | {mib(b['train']['peak_bytes'])} | "
                     f"{b['train']['peak_bytes'] / a['train']['peak_bytes']:.2f} | "
                     f"{mib(a['infer']['peak_bytes'])} / {mib(b['infer']['peak_bytes'])} | {ratio_range(t) if t else NA} |")
    return lines
