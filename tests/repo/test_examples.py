"""The examples in ``examples/`` run as a new user runs them (``python examples/<name>.py``) and print
finite MTP metrics for every depth (the draft's acceptance included), a verdict line, and exactly what
docs/quickstart.md shows (the README links there).

Each runs in its own interpreter: the examples start their own process group and mcore parallel
state, which this test session already holds. The repository root goes first on ``PYTHONPATH``
so that they import this checkout's ``mtp_hooks``; the rest of ``PYTHONPATH`` (the release
matrix puts a megatron-core release there) is kept.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megatron.core

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # a few seconds on 2 idle cores; generous for a loaded CI machine
METRIC = re.compile(r"(mtp(?:_\d+)?/\w+)=(\S+)")  # mtp_k/loss, ..., mtp/accept_len
NUMBER = re.compile(r"[-+]?\d[\d.e+-]*")


def run_example(name: str) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, f"examples/{name} exited with {result.returncode}:\n{result.stdout}\n{result.stderr[-4000:]}"
    return result.stdout


def shown_output(name: str) -> list[str]:
    """The output docs/quickstart.md shows for ``examples/<name>`` (a block indented in a list item)."""
    quickstart = (ROOT / "docs" / "quickstart.md").read_text()
    block = quickstart.split(f"$ .venv/bin/python examples/{name}\n", 1)[1].split("```", 1)[0]
    return [line[2:] if line.startswith("  ") else line for line in block.rstrip().splitlines()]


def on_default_stack() -> bool:
    """docs/quickstart.md shows the default stack's output: the pinned megatron-core, on the CPU."""
    pins = (ROOT / "requirements" / "py311.txt").read_text()
    return f"megatron-core=={megatron.core.__version__}" in pins and not torch.cuda.is_available()


def assert_quickstart_shows_the_output(name: str, output: str) -> None:
    """Line for line; elsewhere than the default stack (other init or kernels), with numbers masked and
    without the verdict, whose words follow the numbers."""
    shown, printed = shown_output(name), output.rstrip("\n").splitlines()
    if not on_default_stack():
        def mask(lines: list[str]) -> list[str]:
            return [NUMBER.sub("#", line) for line in lines if not line.startswith("verdict:")]

        shown, printed = mask(shown), mask(printed)
    assert shown == printed, f"docs/quickstart.md shows for examples/{name}:\n" + "\n".join(shown) + "\nbut it printed:\n" + "\n".join(printed)


def metrics_lines(output: str) -> list[dict[str, float]]:
    """The parsed ``MTP metrics:`` lines that report at least one depth."""
    parsed = []
    for line in output.splitlines():
        if "MTP metrics:" in line:
            values = {name: float(value) for name, value in METRIC.findall(line)}
            if values:
                parsed.append(values)
    return parsed


def assert_every_depth_trained(metrics: dict[str, float], depths: int) -> None:
    for k in range(1, depths + 1):
        assert metrics[f"mtp_{k}/tokens"] > 0, metrics
        assert math.isfinite(metrics[f"mtp_{k}/loss"]) and metrics[f"mtp_{k}/loss"] > 0, metrics
        assert 0.0 <= metrics[f"mtp_{k}/acc"] <= 1.0, metrics
        assert 0.0 <= metrics[f"mtp_{k}/agree"] <= 1.0 and 0.0 <= metrics[f"mtp_{k}/accept"] <= 1.0, metrics
    assert 0.0 <= metrics["mtp/accept_len"] <= depths, metrics  # expected accepted draft tokens of the N depths


def test_quickstart_trains_mtp_on_the_training_micro_batch_and_prints_its_metrics() -> None:
    output = run_example("quickstart.py")
    assert "training micro-batch:  logits [2, 16, 128]" in output, output
    assert "inference micro-batch: logits [2, 16, 128]" in output, output
    assert "hooks removed" in output, output
    trained = metrics_lines(output)
    assert len(trained) == 1, output
    assert_every_depth_trained(trained[0], depths=2)
    assert output.splitlines()[-1] == "verdict: logits, MTP gradients and acceptance metrics as expected, hooks removed cleanly", output
    assert_quickstart_shows_the_output("quickstart.py", output)


def test_rl_step_runs_grpo_iterations_through_mcores_schedule_with_mtp_metrics() -> None:
    output = run_example("rl_step.py")
    iterations = 3  # rl_step.ITERATIONS
    assert len(re.findall(r"^iteration \d+: mean reward [\d.]+, pg loss per epoch ", output, re.M)) == iterations, output
    trained = metrics_lines(output)
    assert len(trained) == iterations, output
    for metrics in trained:
        assert_every_depth_trained(metrics, depths=2)
    # Where the hooks feed mcore's MTP loss tracker, it agrees with the hooks' metrics (every
    # micro-batch of the example has the same token count, so mean of means = token mean).
    tracked = [dict(re.findall(r"(mtp_\d+) loss=(\S+)", line)) for line in output.splitlines() if "mcore MTP tracker:" in line]
    assert len(tracked) in (0, iterations), output
    for metrics, tracker in zip(trained, tracked):
        for k in (1, 2):
            assert float(tracker[f"mtp_{k}"]) == pytest.approx(metrics[f"mtp_{k}/loss"], rel=2e-3), output
    verdict = output.splitlines()[-1]
    assert verdict.startswith(f"verdict: every MTP depth trained in all {iterations} iterations"), output
    assert ("fell" in verdict) != ("did not fall" in verdict), verdict
    assert_quickstart_shows_the_output("rl_step.py", output)
