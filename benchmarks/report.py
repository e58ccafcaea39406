"""From raw measurements to ratios, goal verdicts, Markdown tables and a plot.

Verdicts come from exact columns (FLOPs, peak live bytes, host syncs, host-to-device tensors) where the
goal is about them. The one time goal is judged on the per-round ratios of interleaved rounds (process CPU
time on CPU, wall time on a GPU): ``met`` when even the slowest round meets it, ``missed`` when even the
fastest does not, ``inconclusive`` when the spread straddles the threshold.

Floors: each training row also gives its ratio to the FLOPs that must happen (stock's count, where every
product runs once; minus one head weight-gradient product per depth, N·2·T·h·V, for a variant whose MTP
losses do not train the head) and to the memory that must be held (the model without MTP layers' training
peak: a lower bound, the MTP layers' own saved activations come on top).
"""

from __future__ import annotations

import statistics
from typing import Any, Optional

from megatron.core.transformer import multi_token_prediction as _mtp

from benchmarks.configs import Config, Shape
from benchmarks.variants import CHAIN_VARIANTS, DEFAULT_HOOKS, DETACH_HEAD, TRAINER_VARIANTS

MIB = 2**20
TP = 1  # the benchmarks run one rank
SWEEP_TITLES = {"vocab": "vocabulary size V", "seq": "sequence length s", "mtp": "MTP depth N",
                "realistic": "sequence length s at a real vocabulary"}
SWEEP_SYMBOLS = {"vocab": "V", "seq": "s", "mtp": "N", "realistic": "s"}
SWEEP_ATTRIBUTES = {"vocab": "vocab", "seq": "seq", "mtp": "mtp", "realistic": "seq"}  # the Shape field each varies


def sweep_title(config: Config, sweep: str) -> str:
    if sweep == "realistic":
        return f"sequence length s at V = {config.realistic_vocab:,}"
    return SWEEP_TITLES[sweep]


def sweeps(config: Config) -> list[str]:
    """The sweeps ``config`` has points in, in ``SWEEP_TITLES`` order."""
    present = {name for name, _ in config.points()}
    return [sweep for sweep in SWEEP_TITLES if sweep in present]
GOALS = {
    "flops": "training FLOPs, lean ≤ stock",
    "detach_flops": "training FLOPs, lean + `detach_head` ≤ stock − N·2·T·h·V/tp",
    "memory": "training peak live memory ≤ stock − 0.9·N·T·V/tp·4 bytes (+ V/tp·h·4 accumulator on the fused path)",
    "inference": "inference micro-batch: FLOPs and peak equal the model without MTP layers",
    "syncs": "host syncs per training + inference micro-batch: 0",
    "h2d": "host-to-device tensors per training + inference micro-batch: lean ≤ stock",
    "time": "training time lean / stock ≤ 1.00 (per-round ratios of interleaved rounds)",
}
MET, MISSED, NOISE, NA = "met", "**missed**", "inconclusive", "n/a"
UNJUDGED = "not measured at smoke shapes"  # the memory goal where ``Config.memory_goal`` is off
# Variants whose MTP losses do not train the output layer: their FLOP floor lacks N head weight gradients.
# verl's patch detaches the head only in its legacy loop, on megatron-core without ``process_mtp_loss``.
HEAD_DETACHED = {DETACH_HEAD} | (set() if hasattr(_mtp, "process_mtp_loss") else {"verl"})


def time_key(config: Config, kind: str = "train") -> str:
    """The timing series verdicts use: process CPU time on CPU (less sensitive to other processes), wall on GPU."""
    return f"{kind}_cpu_s" if config.device == "cpu" else f"{kind}_s"


def verdict(ok: Optional[bool]) -> str:
    return NA if ok is None else (MET if ok else MISSED)


def time_ratio(numerator: list[float], denominator: list[float]) -> Optional[dict[str, float]]:
    """Median, min and max of per-round ratios (round i of one variant over round i of the other)."""
    ratios = [a / b for a, b in zip(numerator, denominator) if b > 0]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "rounds": len(ratios)}


def time_verdict(ratio: Optional[dict[str, float]], goal: float = 1.0) -> str:
    if ratio is None:
        return NA
    if ratio["max"] <= goal:
        return MET
    if ratio["min"] > goal:
        return MISSED
    return NOISE


def _seconds(samples: list[float]) -> Optional[dict[str, float]]:
    if not samples:
        return None
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def floors_at(shape: Shape, variants: dict[str, Any]) -> None:
    """Each training row's FLOP and memory floors and its ratios to them (module docstring), in place."""
    stock, plain = variants.get("stock"), variants.get("no_mtp")
    head_wgrad = shape.mtp * 2 * shape.seq * shape.batch * shape.hidden * (shape.vocab // TP)
    for name, v in variants.items():
        if name in TRAINER_VARIANTS or name == "no_mtp":
            continue
        if stock:
            v["flops_floor"] = stock["train"]["flops"] - (head_wgrad if name in HEAD_DETACHED else 0)
            v["flops_vs_floor"] = v["train"]["flops"] / v["flops_floor"]
        if plain:
            v["memory_floor"] = plain["train"]["peak_bytes"]
            v["memory_vs_floor"] = v["train"]["peak_bytes"] / v["memory_floor"]


def goals_at(shape: Shape, variants: dict[str, Any], key: str = "train_cpu_s", memory_goal: bool = True) -> dict[str, Any]:
    """Every goal's measured figure and verdict at one shape, for the default hooks variant; without
    ``memory_goal`` the peak is reported but the memory goal is not judged (``memory_ok`` is None)."""
    stock, lean = variants.get("stock"), variants.get(DEFAULT_HOOKS)
    detach, floor = variants.get(DETACH_HEAD), variants.get("no_mtp")
    tokens, n = shape.seq * shape.batch, shape.mtp
    out: dict[str, Any] = {"shape": shape.key}
    if stock:
        out["flops_stock"] = stock["train"]["flops"]
    if stock and lean:
        out["flops_ratio"] = lean["train"]["flops"] / stock["train"]["flops"]
        out["flops_ok"] = lean["train"]["flops"] <= stock["train"]["flops"]
        accumulator = (shape.vocab // TP) * shape.hidden * 4 if lean.get("loss_path") == "fused" else 0
        out["memory"] = lean["train"]["peak_bytes"]
        out["memory_stock"] = stock["train"]["peak_bytes"]
        out["memory_ratio"] = out["memory"] / out["memory_stock"]
        out["memory_target"] = stock["train"]["peak_bytes"] - 0.9 * n * shape.logits_bytes(TP) + accumulator
        out["memory_accumulator"] = accumulator
        out["memory_ok"] = out["memory"] <= out["memory_target"] if memory_goal else None
        out["time"] = time_ratio(lean[key], stock[key])
        out["time_verdict"] = time_verdict(out["time"])
        out["wall"] = time_ratio(lean["train_s"], stock["train_s"])
        out["h2d"] = lean["train"]["h2d"] + lean["infer"]["h2d"]
        out["h2d_stock"] = stock["train"]["h2d"] + stock["infer"]["h2d"]
        out["h2d_ok"] = out["h2d"] <= out["h2d_stock"]
    if stock and detach:
        bound = stock["train"]["flops"] - n * 2 * tokens * shape.hidden * (shape.vocab // TP)
        out["detach_flops"] = detach["train"]["flops"]
        out["detach_flops_bound"] = bound
        out["detach_flops_ok"] = detach["train"]["flops"] <= bound
    if lean:
        out["syncs"] = lean["train"]["syncs"] + lean["infer"]["syncs"]
        out["syncs_ok"] = out["syncs"] == 0
    if lean and floor:
        out["infer_flops_ok"] = lean["infer"]["flops"] == floor["infer"]["flops"]
        out["infer_flops"], out["infer_flops_floor"] = lean["infer"]["flops"], floor["infer"]["flops"]
        out["infer_peak"], out["infer_peak_floor"] = lean["infer"]["peak_bytes"], floor["infer"]["peak_bytes"]
        out["inference_ok"] = out["infer_flops"] == out["infer_flops_floor"] and out["infer_peak"] == out["infer_peak_floor"]
    return out


def summarize(config: Config, raw: dict[str, Any]) -> dict[str, Any]:
    """Per shape: every variant's counts and timing summaries, and the goals with their verdicts."""
    by_key: dict[str, Any] = {}
    for point in raw["points"]:
        shape = Shape(**point["shape"])
        variants = point["variants"]
        key = time_key(config)
        for v in variants.values():
            v.setdefault("train_cpu_s", [])
            v.setdefault("infer_cpu_s", [])
            v.setdefault("load", [])
            v["train_time"] = _seconds(v["train_s"])
            v["infer_time"] = _seconds(v["infer_s"])
            v["train_cpu_time"] = _seconds(v["train_cpu_s"])
            v["infer_cpu_time"] = _seconds(v["infer_cpu_s"])
        stock = variants.get("stock")
        for v in variants.values():
            v["train_time_vs_stock"] = time_ratio(v[key], stock[key]) if stock else None
        floors_at(shape, variants)
        loads = [x for v in variants.values() for x in v["load"]]
        by_key[shape.key] = {"shape": point["shape"], "variants": variants, "goals": goals_at(shape, variants, key, config.memory_goal),
                             "load": _seconds(loads)}
    return {
        "config": config.name,
        "env": raw["env"],
        "variants": raw["variants"],
        "refused": raw["refused"],
        "rounds": config.rounds,
        "time_basis": "process CPU time" if config.device == "cpu" else "wall time",
        "complete": raw.get("complete", True),
        "seconds": raw.get("seconds"),
        "points": by_key,
    }


# ------------------------------------------------------------------------------ Markdown


def _mib(nbytes: Optional[float]) -> str:
    return "–" if nbytes is None else f"{nbytes / MIB:,.1f}"


def _gflop(flops: Optional[float]) -> str:
    return "–" if flops is None else f"{flops / 1e9:,.2f}"


def _ms_range(t: Optional[dict[str, float]]) -> str:
    if t is None:
        return "–"
    return f"{t['median'] * 1e3:,.0f} ({t['min'] * 1e3:,.0f}–{t['max'] * 1e3:,.0f})"


def ratio_range(r: Optional[dict[str, float]]) -> str:
    if r is None:
        return "–"
    return f"{r['median']:.2f} ({r['min']:.2f}–{r['max']:.2f})"


def _syncs(counts: dict[str, Any]) -> str:
    """Host syncs of one micro-batch, with the ops behind them."""
    ops = ", ".join(f"`{op.replace('aten::', '')}` × {n}" for op, n in sorted(counts["syncs_by_op"].items()))
    return str(counts["syncs"]) + (f" ({ops})" if ops else "")


def headline(config: Config, result: dict[str, Any]) -> str:
    """The one bold line, lean against stock at the base shape: the first line of the results, and the README's."""
    g = result["points"].get(config.base.key, {}).get("goals", {})
    if "flops_ratio" not in g:
        return "lean vs stock: not measured (stock or lean missing)."
    t = g.get("time")
    basis = result.get("time_basis", "wall time")
    time_part = "–× time" if t is None else f"{t['median']:.2f}× {basis} ({g['time_verdict']})"
    spread = "" if t is None else f"; time = median of {t['rounds']} interleaved rounds, range {t['min']:.2f}–{t['max']:.2f}"
    return (f"**lean vs stock: {g['flops_ratio']:.2f}× FLOPs, {g['memory_ratio']:.2f}× memory, {g['syncs']} host syncs, {time_part}** "
            f"(training micro-batch at the base shape; FLOPs, peak live memory and host syncs counted exactly{spread}).")


def _load(env: dict[str, Any]) -> str:
    start, end = env.get("load_start"), env.get("load_end")
    if not start:
        return "load not recorded"
    text = f"load average {start[0]:.2f} at the start"
    if end:
        text += f", {end[0]:.2f} at the end"
    return text + f" (1-minute, {env.get('cpu_count')} CPUs)"


def _ratio(value: Optional[float], digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


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
            f"| {v['label']} | {v.get('loss_path') or '–'} | {_gflop(tr['flops'])} | {flops_x} | {_ratio(v.get('flops_vs_floor'))} | "
            f"{_mib(tr['peak_bytes'])} | {peak_x} | {_ratio(v.get('memory_vs_floor'), 2)} | {_syncs(tr)} | {_h2d(tr)} | "
            f"{_ms_range(main_time)} | {ratio_range(v['train_time_vs_stock'])} | {_ms_range(v['train_time'])} |"
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
        d_flops = _gflop(inf["flops"] - floor["infer"]["flops"]) if floor else "–"
        d_peak = _mib(inf["peak_bytes"] - floor["infer"]["peak_bytes"]) if floor else "–"
        lines.append(f"| {v['label']} | {_gflop(inf['flops'])} | {d_flops} | {_mib(inf['peak_bytes'])} | {d_peak} | "
                     f"{_syncs(inf)} | {_h2d(inf)} | {_ms_range(v['infer_cpu_time'] if cpu else v['infer_time'])} |")
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


def _h2d(counts: dict[str, Any]) -> str:
    if "h2d" not in counts:
        return "–"
    ops = ", ".join(f"`{op.replace('aten::', '')}` × {n}" for op, n in sorted(counts["h2d_by_op"].items()))
    return str(counts["h2d"]) + (f" ({ops})" if ops else "")


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
        lines.append(f"| {shape_key} | {_gflop(a['train']['flops'])} | {_gflop(b['train']['flops'])} | "
                     f"{_mib(a['train']['peak_bytes'])} | {_mib(b['train']['peak_bytes'])} | "
                     f"{b['train']['peak_bytes'] / a['train']['peak_bytes']:.2f} | "
                     f"{_mib(a['infer']['peak_bytes'])} / {_mib(b['infer']['peak_bytes'])} | {ratio_range(t) if t else NA} |")
    return lines


def trainer_summary(config: Config, result: dict[str, Any]) -> str:
    """One paragraph for docs/api.md: what ``output="logprobs"`` saves against the trainer's own log-softmax."""
    rows = []
    for shape_key, point in result["points"].items():
        a, b = point["variants"].get("trainer_logits"), point["variants"].get("trainer_logprobs")
        if a and b:
            rows.append((shape_key, a, b, point["shape"]))
    if not rows:
        return ""
    ratios = [(b["train"]["peak_bytes"] / a["train"]["peak_bytes"], key, a, b, shape) for key, a, b, shape in rows]
    best = min(ratios, key=lambda r: r[0])
    worst = max(ratios, key=lambda r: r[0])
    flops = [b["train"]["flops"] / a["train"]["flops"] for _, a, b, _ in rows]
    base = result["points"].get(config.base.key, {}).get("variants", {})
    t = time_ratio(base["trainer_logprobs"][time_key(config)], base["trainer_logits"][time_key(config)]) if (
        "trainer_logprobs" in base and "trainer_logits" in base) else None
    env = result["env"]
    shape = best[4]
    text = (f'Measured by `make bench` ({env.get("date", "")[:10]}, {env.get("cpu_model", "CPU")}, fp32; exact counts): an RL '
            f'trainer\'s policy-gradient + entropy loss from `output="logprobs", entropy=True` peaks at '
            f'{best[0]:.2f}–{worst[0]:.2f}× the memory of the same loss computed from the returned logits '
            f'(`log_softmax`, `gather`, entropy), MTP training in both; the largest saving at V = {shape["vocab"]:,}, '
            f's = {shape["seq"]:,}, N = {shape["mtp"]} ({_mib(best[3]["train"]["peak_bytes"])} vs {_mib(best[2]["train"]["peak_bytes"])} MiB), '
            f'for {min(flops):.2f}–{max(flops):.2f}× the FLOPs')
    if t:
        text += f"; {result.get('time_basis', 'time')} {ratio_range(t)}× at the base shape ({t['rounds']} interleaved rounds, {time_verdict(t)} against 1.00)"
    text += ". "
    if worst[0] < 1.0:
        text += 'When the RL loss needs only per-token log-probs and entropy, use `output="logprobs"`.'
    else:
        text += f'At {worst[1]} it holds more than the logits path: there keep `output="logits"`.'
    return text + "\n"


def _goal_lines(config: Config, g: dict[str, Any]) -> list[str]:
    lines = [f"Goals for `mtp_hooks` lean (`attach(model)`, the default), base shape; every sweep point below.", "",
             "| goal | measured | verdict |", "|---|---|---|"]
    if "flops_ratio" in g:
        lines.append(f"| {GOALS['flops']} | {g['flops_ratio']:.3f} × stock | {verdict(g['flops_ok'])} |")
    if "detach_flops" in g:
        lines.append(f"| {GOALS['detach_flops']} | {_x_stock(g['detach_flops'], g)} vs bound {_x_stock(g['detach_flops_bound'], g)} "
                     f"({g['detach_flops']:,} vs {g['detach_flops_bound']:,} FLOPs) | {verdict(g['detach_flops_ok'])} |")
    if "memory" in g:
        acc = f" (accumulator {_mib(g['memory_accumulator'])} MiB included)" if g["memory_accumulator"] else ""
        lines.append(f"| {GOALS['memory']} | {_mib(g['memory'])} MiB vs target {_mib(g['memory_target'])} MiB{acc}; "
                     f"stock {_mib(g['memory_stock'])} MiB | {memory_verdict(g)} |")
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
        lines.append(f"| {v['label']} | {extra} | {_gflop(d_flops)} | {d_flops / mtp_flops:.3f} | {_mib(d_peak)} | "
                     f"{v['train']['peak_bytes'] / floor['train']['peak_bytes']:.2f} |")
    return lines


def _x_stock(flops: float, g: dict[str, Any]) -> str:
    return f"{flops / g['flops_stock']:.4f} × stock"


def _verl_cell(variants: dict[str, Any]) -> str:
    verl, plain = variants.get("verl"), variants.get("no_mtp")
    if verl is None:
        return "–"
    floor = f" ({_gflop(plain['infer']['flops'])})" if plain else ""
    return f"{_mib(verl['train']['peak_bytes'])}, {verl['train']['syncs']} + {verl['infer']['syncs']}, {_gflop(verl['infer']['flops'])}{floor}"


def _load_cell(load: Optional[dict[str, float]]) -> str:
    return "–" if not load else f"{load['median']:.1f} ({load['min']:.1f}–{load['max']:.1f})"


def memory_verdict(g: dict[str, Any]) -> str:
    """The memory goal's verdict; ``UNJUDGED`` where the configuration does not judge it."""
    return UNJUDGED if g["memory_ok"] is None else verdict(g["memory_ok"])


def _cell(text: str, ok: Optional[bool]) -> str:
    return f"{text} {verdict(ok)}" if ok is not None else text


def _sweep_lines(config: Config, result: dict[str, Any], sweep: str, title: str) -> list[str]:
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
        detach = (_cell(f"{_x_stock(g['detach_flops'], g)} / {_x_stock(g['detach_flops_bound'], g)}", g["detach_flops_ok"])
                  if "detach_flops" in g else "–")
        memory = f"{_mib(g['memory'])} / {_mib(g['memory_target'])} {memory_verdict(g)}" if "memory" in g else "–"
        syncs = _cell(str(g["syncs"]), g["syncs_ok"]) if "syncs" in g else "–"
        infer = verdict(g.get("inference_ok"))
        time_cell = f"{ratio_range(g.get('time'))} {g.get('time_verdict', NA)}" if g.get("time") else NA
        lines.append(f"| {getattr(shape, SWEEP_ATTRIBUTES[sweep]):,} | {_gflop(stock['train']['flops']) if stock else '–'} | {flops} | {detach} | "
                     f"{memory} | {syncs} | {infer} | {time_cell} | {_ratio(lean.get('memory_vs_floor'), 2) if lean else '–'} | "
                     f"{_verl_cell(point['variants'])} | {_load_cell(point.get('load'))} |")
    return lines


# ---------------------------------------------------------------------------------- plot


MARKERS = "osD^vP*Xh<>"


def plot(config: Config, result: dict[str, Any], path: str) -> None:
    """3 x 3 grid: training GFLOP, training peak live MiB, time / stock, by vocab / sequence / N.

    Every variant has its own marker and a small horizontal offset, so equal values stay visible; time is
    on a log scale, median with min–max bars over the interleaved rounds. Lower is better on every panel.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = time_key(config)
    basis = result.get("time_basis", "wall time")
    columns = sweeps(config)
    fig, axes = plt.subplots(3, len(columns), figsize=(5 * len(columns), 11), squeeze=False)
    names = [n for n in result["variants"] if n not in TRAINER_VARIANTS]
    for col, sweep in enumerate(columns):
        title = sweep_title(config, sweep)
        shapes = [shape for name, shape in config.points() if name == sweep and shape.key in result["points"]]
        xs = [getattr(shape, SWEEP_ATTRIBUTES[sweep]) for shape in shapes]
        points = [result["points"][shape.key] for shape in shapes]
        log_x = sweep != "mtp"
        for index, name in enumerate(names):
            label = next((p["variants"][name]["label"] for p in points if name in p["variants"]), name)
            offset = (index - (len(names) - 1) / 2) * 0.025
            shifted = [x * 2 ** offset if log_x else x + offset * 4 for x in xs]
            style = dict(marker=MARKERS[index % len(MARKERS)], color=f"C{index % 10}", label=label, alpha=0.85, markersize=6)
            flops = [p["variants"][name]["train"]["flops"] / 1e9 if name in p["variants"] else float("nan") for p in points]
            peaks = [p["variants"][name]["train"]["peak_bytes"] / MIB if name in p["variants"] else float("nan") for p in points]
            axes[0][col].plot(shifted, flops, **style)
            axes[1][col].plot(shifted, peaks, **style)
            ratios = [p["variants"][name].get("train_time_vs_stock") if name in p["variants"] else None for p in points]
            if any(ratios) and name != "stock":
                med = [r["median"] if r else float("nan") for r in ratios]
                low = [r["median"] - r["min"] if r else 0.0 for r in ratios]
                high = [r["max"] - r["median"] if r else 0.0 for r in ratios]
                axes[2][col].errorbar(shifted, med, yerr=[low, high], capsize=3, **style)
        axes[2][col].axhline(1.0, color="k", linestyle="--", label="stock (goal: ≤ 1)")
        axes[2][col].set_yscale("log")
        for row, ylabel in enumerate(("training GFLOP", "training peak live MiB", f"training {basis} / stock")):
            ax = axes[row][col]
            ax.set_xlabel(title)
            ax.set_ylabel(f"{ylabel} (lower is better)")
            if log_x:
                ax.set_xscale("log", base=2)
                ax.minorticks_off()
            if row < 2:
                ax.set_yscale("log")
            ax.set_xticks(xs)
            ax.set_xticklabels([f"{x:,}" for x in xs], rotation=30 if log_x else 0)
            ax.grid(alpha=0.3)
    for row in range(3):
        axes[row][0].legend(fontsize=7)
    fig.suptitle(f"mtp_hooks vs stock mcore and verl: config {config.name} "
                 f"({result['env'].get('gpu') or 'CPU'}); lower is better everywhere; time: median, min–max bars")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
