"""Versions and machine, recorded with every benchmark result."""

from __future__ import annotations

import datetime
import platform
from typing import Any

import torch

import megatron.core
import mtp_hooks
from benchmarks.configs import Config


def environment(config: Config) -> dict[str, Any]:
    """Date, Python / torch / megatron-core / mtp_hooks versions, CPU threads, GPU name if any."""
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron_core": megatron.core.__version__,
        "mtp_hooks": mtp_hooks.__version__,
        "machine": platform.machine(),
        "cpu_threads": torch.get_num_threads(),
    }
    if config.device != "cpu":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    return env
