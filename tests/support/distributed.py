"""Run test scenarios on a group of CPU processes, one mcore rank each (gloo).

Test-only support. ``SpawnedGroup(world_size)`` starts ``world_size`` processes once; each one
opens a gloo process group with ``RANK`` / ``WORLD_SIZE`` / ``MASTER_PORT`` in its environment
and then waits for work. ``group.run(scenario, layout, **kwargs)`` makes every rank call
``mtp_hooks.testing.init_parallel(**layout)`` (skipped when mcore's groups already have that
layout) and ``scenario(**kwargs)`` inside ``cuda_current_device_is_cpu()``, and returns the
per-rank results. A scenario that raises on
any rank fails the caller with that rank's traceback; since the other ranks may then wait
forever in a collective, the whole group is shut down and the next ``run`` starts a fresh one.

Scenarios are module-level functions (they travel by module and name). Process start-up
(importing torch and megatron) dominates, so one group serves many scenarios.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import time
import traceback
import warnings
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional

_START_TIMEOUT_S = 180.0
_START_ATTEMPTS = 3
_GRACE_AFTER_FAILURE_S = 5.0


class ScenarioFailed(AssertionError):
    """A scenario raised (or hung) on at least one rank; the message holds each rank's report."""


def _reset_process_state(seed: int) -> None:
    """What the single-process fixtures do around each test: clean MTP tracker and loss scale, seeds."""
    import torch
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    # Dropout is off in every test model; the inference flavour of mcore's RNG tracker makes its
    # ``fork()`` (sequence-parallel regions) a no-op instead of a CUDA RNG state swap.
    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(seed)


_LAYOUT_DEFAULTS = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "context_parallel_size": 1,
    "virtual_pipeline_model_parallel_size": None,
}


def _current_layout() -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    return {
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "context_parallel_size": ps.get_context_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": ps.get_virtual_pipeline_model_parallel_world_size(),
    }


def _release_model_parallel_groups() -> None:
    """Destroy the gloo groups mcore's ``parallel_state`` holds (it only forgets them itself).

    Each layout creates a few dozen groups with their own sockets; without this a long-lived
    rank runs out of file descriptors after a few dozen layouts.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    found: dict[int, Any] = {}
    pending: list[Any] = list(vars(ps).values())
    while pending:
        value = pending.pop()
        if isinstance(value, dist.ProcessGroup):
            found[id(value)] = value
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
        elif isinstance(value, dict):
            pending.extend(value.values())
    for group in found.values():
        if group is not dist.GroupMember.WORLD:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)


def _use_layout(layout: dict[str, Any]) -> None:
    """``init_parallel(**layout)``, unless mcore's groups already have that layout."""
    from mtp_hooks.testing import init_parallel

    if {**_LAYOUT_DEFAULTS, **layout} == _current_layout():
        return
    _release_model_parallel_groups()
    init_parallel(**layout)


def _worker(rank: int, world_size: int, port: int, conn: Connection) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    import torch

    torch.set_num_threads(1)
    from mtp_hooks.testing import cuda_current_device_is_cpu, init_parallel

    with cuda_current_device_is_cpu():
        try:
            init_parallel()
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            return
        conn.send(("ok", None))
        while True:
            try:
                message = conn.recv()
            except EOFError:
                break
            if message is None:
                break
            module_name, name, layout, kwargs, seed = message
            try:
                if name is None:  # import the scenarios' module only (``SpawnedGroup.run``'s first of a module)
                    importlib.import_module(module_name)
                    conn.send(("ok", None))
                    continue
                scenario = getattr(importlib.import_module(module_name), name)
                _use_layout(layout)
                _reset_process_state(seed)
                conn.send(("ok", scenario(**kwargs)))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
    # No destroy_process_group(): it waits for the other ranks; the process exit frees everything.


class SpawnedGroup:
    """``world_size`` long-lived worker processes forming one gloo group."""

    def __init__(self, world_size: int = 2) -> None:
        self.world_size = world_size
        self._processes: list[Any] = []
        self._conns: list[Connection] = []
        self._imported: set[str] = set()  # scenario modules the live ranks have imported

    @property
    def alive(self) -> bool:
        return bool(self._processes) and all(p.is_alive() for p in self._processes)

    def start(self) -> None:
        """Spawn the ranks; retried on a fresh port, since another process may take the free port
        between choosing it and binding it."""
        from mtp_hooks.testing import free_port

        context = multiprocessing.get_context("spawn")
        for attempt in range(_START_ATTEMPTS):
            port = free_port()
            for rank in range(self.world_size):
                parent, child = context.Pipe()
                process = context.Process(target=_worker, args=(rank, self.world_size, port, child), daemon=True)
                process.start()
                child.close()
                self._processes.append(process)
                self._conns.append(parent)
            reports = self._collect(_START_TIMEOUT_S)
            if all(status == "ok" for status, _ in reports):
                return
            self.close()
            if attempt + 1 == _START_ATTEMPTS or "EADDRINUSE" not in self._format("", reports):
                raise ScenarioFailed(self._format(f"starting the process group (attempt {attempt + 1})", reports))

    def run(
        self,
        scenario: Callable[..., Any],
        layout: Optional[dict[str, Any]] = None,
        /,
        *,
        timeout_s: float = 120.0,
        seed: int = 0,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``scenario(**kwargs)`` on every rank after ``init_parallel(**layout)``; per-rank results."""
        if not self.alive:
            self.close()
            self.start()
        if scenario.__module__ not in self._imported:  # the imports (megatron's, the scenarios') on the start's clock
            for conn in self._conns:
                conn.send((scenario.__module__, None, {}, {}, seed))
            reports = self._collect(_START_TIMEOUT_S)
            if any(status != "ok" for status, _ in reports):
                self.close()
                raise ScenarioFailed(self._format(f"importing {scenario.__module__}", reports))
            self._imported.add(scenario.__module__)
        message = (scenario.__module__, scenario.__qualname__, dict(layout or {}), kwargs, seed)
        for conn in self._conns:
            conn.send(message)
        reports = self._collect(timeout_s)
        if any(status != "ok" for status, _ in reports):
            self.close()
            raise ScenarioFailed(self._format(f"{scenario.__qualname__}(layout={layout}, kwargs={kwargs})", reports))
        return [value for _, value in reports]

    def __enter__(self) -> "SpawnedGroup":
        """The ranks start on the first ``run``; leaving the block closes them, also after an error."""
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.send(None)
        deadline = time.monotonic() + 1.0
        for process in self._processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():  # nothing to lose: the ranks keep no state worth a clean exit
                process.kill()
                process.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
        self._imported.clear()
        self._processes.clear()
        self._conns.clear()

    def _collect(self, timeout_s: float) -> list[tuple[str, Any]]:
        """One report per rank; once a rank failed, the others get a short grace period."""
        reports: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(reports) < self.world_size:
            pending = {rank: conn for rank, conn in enumerate(self._conns) if rank not in reports}
            sentinels = {self._processes[rank].sentinel: rank for rank in pending}
            ready = wait([*pending.values(), *sentinels], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                for rank in pending:
                    reports[rank] = ("error", f"rank {rank}: no answer after {timeout_s:.0f} s (waiting in a collective?)")
                break
            for rank, conn in pending.items():
                if conn in ready:
                    try:
                        reports[rank] = conn.recv()
                    except (EOFError, OSError):
                        reports[rank] = ("error", f"rank {rank}: process exited (exit code {self._processes[rank].exitcode})")
            for sentinel in ready:
                rank = sentinels.get(sentinel)  # type: ignore[call-overload]
                if rank is not None and rank not in reports and not self._conns[rank].poll():
                    reports[rank] = ("error", f"rank {rank}: process exited (exit code {self._processes[rank].exitcode})")
            if any(status != "ok" for status, _ in reports.values()):
                timeout_s = _GRACE_AFTER_FAILURE_S
                deadline = min(deadline, time.monotonic() + timeout_s)
        return [reports[rank] for rank in range(self.world_size)]

    @staticmethod
    def _format(what: str, reports: list[tuple[str, Any]]) -> str:
        lines = [f"{what} failed:"]
        for rank, (status, value) in enumerate(reports):
            if status != "ok":
                lines.append(f"--- rank {rank} ---\n{value}")
        return "\n".join(lines)
