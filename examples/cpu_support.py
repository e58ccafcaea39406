"""Start Megatron-Core for the examples; the CPU part is only needed on a machine without a GPU.

With a GPU visible, ``megatron_runtime()`` does what any mcore program does (an NCCL process group,
``parallel_state.initialize_model_parallel``, mcore's CUDA RNG tracker) and ``layer_spec()`` is
mcore's own local GPT layer spec, untouched.

Without a GPU, stock mcore assumes CUDA in a few places a tiny run reaches. Everything that works
around them is in this module, is used only when ``torch.cuda.is_available()`` is false, and is
no part of ``mtp_hooks`` (the library patches nothing):

1. mcore's local ``DotProductAttention`` builds its causal mask on CUDA: ``layer_spec()`` swaps
   ``CpuCoreAttention`` (causal scaled-dot-product attention) into the spec's core attention.
2. mcore asks ``torch.cuda.current_device()`` for the device of a few buffers (RoPE frequencies,
   its MTP loss tracker): while ``megatron_runtime()`` is open it answers ``"cpu"``.
3. mcore's pipeline schedule creates its token counter with ``device="cuda"``: while
   ``megatron_runtime()`` is open, tensor factories asked for ``"cuda"`` make CPU tensors.
4. NCCL needs GPUs: the process group is gloo.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig


@contextlib.contextmanager
def megatron_runtime(seed: int = 0) -> Iterator[torch.device]:
    """A one-process torch.distributed group and mcore's parallel state (TP = PP = CP = 1).

    Yields the device to build the model on: the current GPU, or the CPU (with the CPU
    accommodations of this module open until the context closes).
    """
    address = f"tcp://127.0.0.1:{_free_port()}"  # one process: its own rendezvous, whatever MASTER_PORT says
    torch.manual_seed(seed)
    with contextlib.ExitStack() as stack:
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
            torch.distributed.init_process_group("nccl", init_method=address, rank=0, world_size=1)
            device = torch.device("cuda", 0)
        else:
            stack.enter_context(_cuda_current_device_is_cpu())
            stack.enter_context(_CudaFactoriesOnCpu())
            torch.distributed.init_process_group("gloo", init_method=address, rank=0, world_size=1)
            device = torch.device("cpu")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        if device.type == "cuda":
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
        try:
            yield device
        finally:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()


def layer_spec(device: torch.device) -> ModuleSpec:
    """mcore's local (no Transformer Engine) GPT layer spec; on CPU with ``CpuCoreAttention``."""
    spec = get_gpt_layer_local_spec()
    if device.type == "cpu":
        spec.submodules.self_attention.submodules.core_attention = CpuCoreAttention
    return spec


class CpuCoreAttention(MegatronModule):
    """Causal attention with the call signature of mcore's ``DotProductAttention`` (CPU only).

    Covers what the examples use: ``[s, b, heads, d]`` inputs, a causal mask, no packed
    sequences, no context parallelism, no attention dropout.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        **_: Any,  # process groups, cp_comm_type: not used on one CPU process
    ) -> None:
        super().__init__(config=config)
        self.softmax_scale = softmax_scale

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Any = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("CpuCoreAttention: packed sequences are not supported")
        s, b, heads, d = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)


@contextlib.contextmanager
def _cuda_current_device_is_cpu() -> Iterator[None]:
    """``torch.cuda.current_device()`` answers ``"cpu"`` while open (mcore asks it for buffer devices)."""
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = original  # type: ignore[assignment]


class _CudaFactoriesOnCpu(TorchFunctionMode):
    """Tensor factories called with ``device="cuda"`` (mcore's schedule token counter) make CPU tensors."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
