"""Process groups for mcore models on CPU: gloo, one process or spawned ranks, and mcore's parallel state.

``init_parallel()`` opens a gloo group (world size 1 by default; spawned ranks pass ``RANK``,
``WORLD_SIZE`` and ``MASTER_PORT`` in their environment) and (re)builds mcore's
``parallel_state`` for a TP / PP / CP / VPP layout. ``runtime()`` is the whole single-process
setup of an example or benchmark as one context manager: on the GPU when one is visible (NCCL,
mcore's CUDA RNG), else on the CPU with the shims of ``mtp_hooks.testing.devices`` open, and
everything torn down on exit.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Iterator, Optional

import torch

from megatron.core import parallel_state, tensor_parallel

from mtp_hooks.testing.devices import cuda_calls_on_cpu, cuda_current_device_is_cpu

__all__ = ["free_port", "init_parallel", "runtime"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a process group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
) -> None:
    """Start a gloo process group, unless one is open, and (re)build mcore's parallel state.

    The group has ``RANK`` / ``WORLD_SIZE`` from the environment (default: one process, rank 0)
    and meets at ``MASTER_ADDR:MASTER_PORT`` (default: 127.0.0.1 and a free port). mcore's groups
    are destroyed and built again for the layout given, so a process may change layouts.
    """
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        torch.distributed.init_process_group(
            "gloo",
            rank=int(os.environ.get("RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
        )
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
    )


@contextlib.contextmanager
def runtime(seed: int = 0, device: Optional[str] = None) -> Iterator[torch.device]:
    """A one-process torch.distributed group and mcore's parallel state (TP = PP = CP = 1).

    Args:
        seed: ``torch.manual_seed`` (and, on the GPU, mcore's CUDA RNG tracker).
        device: ``"cuda"`` or ``"cpu"``; default the GPU when one is visible, else the CPU.

    Yields:
        The device to build the model on. On the CPU, ``cuda_current_device_is_cpu()`` and
        ``cuda_calls_on_cpu()`` are open until the context closes; the process group and
        mcore's parallel state are destroyed on exit.
    """
    address = f"tcp://127.0.0.1:{free_port()}"  # one process: its own rendezvous, whatever MASTER_PORT says
    torch.manual_seed(seed)
    on_gpu = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    with contextlib.ExitStack() as stack:
        if on_gpu:
            torch.cuda.set_device(0)
            torch.distributed.init_process_group("nccl", init_method=address, rank=0, world_size=1)
            where = torch.device("cuda", 0)
        else:
            stack.enter_context(cuda_current_device_is_cpu())
            stack.enter_context(cuda_calls_on_cpu())
            torch.distributed.init_process_group("gloo", init_method=address, rank=0, world_size=1)
            where = torch.device("cpu")
        try:
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
            if on_gpu:
                tensor_parallel.model_parallel_cuda_manual_seed(seed)
            yield where
        finally:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()
