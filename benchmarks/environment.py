"""Versions and machine, recorded with every benchmark result."""

from __future__ import annotations

import datetime
import os
import platform
from typing import Any

import torch

import megatron.core
import mtp_hooks
from benchmarks.configs import Config


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (``platform.processor()`` where there is none)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> str:
    """The CPU model and the core count, as the engine benchmarks' records head them."""
    return f"{cpu_model()}, {os.cpu_count()} cores"


def load_average() -> str:
    """The 1, 5 and 15-minute load averages, as the engine benchmarks' records write them."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def environment(config: Config) -> dict[str, Any]:
    """Date, Python / torch / megatron-core / mtp_hooks / verl versions, CPU model, cores, threads, load, GPU if any."""
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron_core": megatron.core.__version__,
        "mtp_hooks": mtp_hooks.__version__,
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_threads": torch.get_num_threads(),
        "load_start": list(os.getloadavg()),  # 1, 5 and 15-minute load averages when the run began
    }
    from benchmarks import verl_baseline

    env["verl"] = verl_baseline.version()
    if config.device != "cpu":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    return env
