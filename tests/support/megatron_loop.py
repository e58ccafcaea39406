"""Megatron's own training loop on CPU, for tests: Float16Module (bf16), mcore DDP, mcore's optimizer,
``get_forward_backward_func`` and ``dist_checkpointing``.

Test-only support. Besides the shims of ``mtp_hooks.testing`` (``cuda_current_device_is_cpu`` is open
for the whole session, ``cuda_calls_on_cpu`` around the schedule), three CPU accommodations live here,
each applied only inside a context manager and undone on exit:

* ``cuda_tensor_types``: ``Float16OptimizerWithFloat16Params`` sorts parameters by
  ``param.type()`` and accepts only ``torch.cuda.*Tensor`` names; while open, ``Tensor.type()`` of a
  CPU tensor answers the CUDA name of its dtype (and ``device="cuda"`` factories give CPU tensors).
* ``cuda_stream_on_cpu``: DDP's gradient sync (0.19+) asks ``torch.cuda.current_stream()`` to
  wait for CUDA-graph events; while open it answers a stream that has nothing to wait for.
* ``checkpoint_io_on_cpu``: ``dist_checkpointing``'s save path calls ``torch.cuda.synchronize()``,
  and its file writers log their RSS through ``psutil``, which the test environment lacks; while
  open, the first is a no-op and the second answers 0.

None of them changes any computation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from megatron.core import dist_checkpointing
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

import mtp_hooks
from mtp_hooks.testing import Batch, CudaToCpu, TinyGPT, cuda_calls_on_cpu, make_batch

VOCAB = 64
SEQ = 16
MICRO_BATCH = 2


class _CudaTensorTypes(CudaToCpu):
    """``CudaToCpu`` plus ``Tensor.type()`` answering ``torch.cuda.<Dtype>Tensor`` for CPU tensors."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None) -> Any:
        if func is Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        return super().__torch_function__(func, types, args, kwargs)


@contextlib.contextmanager
def cuda_tensor_types() -> Iterator[None]:
    """While open, ``Tensor.type()`` names CPU tensors as CUDA ones and ``device="cuda"`` means CPU.

    For building mcore's ``Float16OptimizerWithFloat16Params``, which refuses parameters whose
    type name is not ``torch.cuda.{Half,BFloat16,Float}Tensor``.
    """
    with _CudaTensorTypes():
        yield


class _NoStream:
    """Stands for the current CUDA stream on CPU: nothing runs asynchronously, so nothing to wait for."""

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None


@contextlib.contextmanager
def cuda_stream_on_cpu() -> Iterator[None]:
    """While open, ``torch.cuda.current_stream()`` answers a ``_NoStream`` (DDP's grad sync asks it)."""
    original = torch.cuda.current_stream
    torch.cuda.current_stream = lambda *a, **k: _NoStream()  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_stream = original  # type: ignore[assignment]


@contextlib.contextmanager
def checkpoint_io_on_cpu() -> Iterator[None]:
    """While open, ``torch.cuda.synchronize()`` is a no-op and, without ``psutil``, the checkpoint
    writers' memory probe answers 0 (it only feeds a debug log). Also opens ``cuda_calls_on_cpu``."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    swaps: list[tuple[Any, str, Any]] = [(torch.cuda, "synchronize", lambda *a, **k: None)]
    if not getattr(filesystem_async, "HAVE_PSUTIL", True) and hasattr(filesystem_async, "_process_memory"):
        swaps.append((filesystem_async, "_process_memory", lambda: 0))
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in swaps]
    for owner, name, value in swaps:
        setattr(owner, name, value)
    try:
        with cuda_calls_on_cpu():
            yield
    finally:
        for owner, name, value in originals:
            setattr(owner, name, value)


# --------------------------------------------------------------------------- the model stack

SPEC = TinyGPT(vocab_size=VOCAB, hidden_size=32, num_layers=1, num_attention_heads=4, mtp_num_layers=2, params_dtype=torch.bfloat16)


@dataclasses.dataclass
class MegatronStack:
    """What Megatron's training loop holds: the language model, its ``Float16Module`` (bf16) inside
    mcore's ``DistributedDataParallel``, and mcore's optimizer (fp32 main params in bf16 mode)."""

    gpt: nn.Module
    ddp: DistributedDataParallel
    optimizer: Any

    @property
    def config(self) -> Any:
        return self.gpt.config


def build_stack(
    seed: int,
    *,
    config_overrides: Optional[dict[str, Any]] = None,
    ddp_options: Optional[dict[str, Any]] = None,
    optimizer_options: Optional[dict[str, Any]] = None,
) -> MegatronStack:
    """Build the stack as Megatron's ``training.setup_model_and_optimizer`` does, on CPU.

    DDP accumulates gradients into fp32 ``main_grad`` buffers (``grad_reduce_in_fp32``); the
    config carries the ``finalize_model_grads`` / ``no_sync`` / ``grad_scale_func`` hooks that
    the schedules call. The options override the model config, DDP config and optimizer config.
    """
    spec = dataclasses.replace(SPEC, config_overrides={**SPEC.config_overrides, **(config_overrides or {})})
    gpt = spec.build(seed=seed)
    config = gpt.config
    ddp_config = DistributedDataParallelConfig(
        **{"grad_reduce_in_fp32": True, "overlap_grad_reduce": False, "use_distributed_optimizer": False, **(ddp_options or {})}
    )
    ddp = DistributedDataParallel(config, ddp_config, Float16Module(config, gpt))
    optimizer_config = OptimizerConfig(
        **{
            "optimizer": "adam",
            "lr": 3e-3,
            "bf16": True,
            "params_dtype": torch.bfloat16,
            "clip_grad": 1.0,
            "weight_decay": 0.01,
            **(optimizer_options or {}),
        }
    )
    with cuda_tensor_types():
        optimizer = get_megatron_optimizer(optimizer_config, [ddp])
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    config.grad_scale_func = optimizer.scale_loss
    return MegatronStack(gpt, ddp, optimizer)


def float16_optimizers(stack: MegatronStack) -> list[Any]:
    """The optimizers inside mcore's ``ChainedOptimizer`` (``Float16OptimizerWithFloat16Params`` or
    ``DistributedOptimizer``)."""
    return list(getattr(stack.optimizer, "chained_optimizers", [stack.optimizer]))


def main_params_and_moments(stack: MegatronStack) -> dict[str, dict[str, Tensor]]:
    """Per parameter name: the bf16 model param, its fp32 main copy and Adam's moments and step.

    ``Float16OptimizerWithFloat16Params`` keeps the main copy as ``param.main_param``; mcore's
    ``DistributedOptimizer`` keeps this rank's flat shard of it (the whole parameter on one rank).
    """
    out: dict[str, dict[str, Tensor]] = {}
    optimizers = float16_optimizers(stack)
    for name, param in stack.gpt.named_parameters():
        entry = {"param": param.detach().clone()}
        for opt in optimizers:
            if hasattr(opt, "_get_main_param_and_optimizer_states"):  # DistributedOptimizer
                if param in opt.model_param_group_index_map:
                    states = dict(opt._get_main_param_and_optimizer_states(param))
                    entry["main_param"] = states.pop("param").detach().clone()
                    entry.update({key: torch.as_tensor(value).detach().clone() for key, value in states.items()})
            elif param.main_param in opt.optimizer.state:
                entry["main_param"] = param.main_param.detach().clone()
                entry.update({key: torch.as_tensor(value).detach().clone() for key, value in opt.optimizer.state[param.main_param].items()})
        out[name] = entry
    return out


# --------------------------------------------------------------------------- the RL loop

@dataclasses.dataclass
class Rollout:
    """Micro-batches of one rollout with per-sequence advantages; ``old_logprobs`` is filled by the
    inference pass (the policy's log-probs before the update), one ``[b, s]`` tensor per micro-batch."""

    batches: list[Batch]
    advantages: list[Tensor]
    old_logprobs: list[Tensor] = dataclasses.field(default_factory=list)


def make_rollout(index: int, micro_batches: int = 2) -> Rollout:
    batches = [make_batch(VOCAB, batch=MICRO_BATCH, seq=SEQ, mask="random", seed=100 * index + m) for m in range(micro_batches)]
    gen = torch.Generator().manual_seed(7 + index)
    return Rollout(batches, [torch.randn(MICRO_BATCH, 1, generator=gen) for _ in batches])


def token_logprobs(gpt: nn.Module, logits: Tensor, labels: Tensor) -> Tensor:
    """Log-probs ``[b, s]`` of ``labels`` from returned ``[b, s, V]`` logits, with mcore's own
    cross-entropy (the function stock's post-processing uses for its per-token loss)."""
    return -gpt.compute_language_model_loss(labels, logits.transpose(0, 1).contiguous())


def ppo_loss(rollout: Rollout, m: int, logprobs: Tensor, clip: float = 0.2) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Clipped PPO surrogate as mcore's 3-tuple: masked sum, token count, and logs."""
    batch = rollout.batches[m]
    assert batch.loss_mask is not None
    ratio = torch.exp(logprobs - rollout.old_logprobs[m])
    advantage = rollout.advantages[m]
    surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage)
    total = -(surrogate * batch.loss_mask).sum()
    tokens = batch.loss_mask.sum().to(torch.int)
    return total, tokens, {"pg loss": (total / tokens).detach()}


def _run_schedule(stack: MegatronStack, step: Callable[[Any, nn.Module], Any], micro_batches: int, forward_only: bool) -> list[Any]:
    forward_backward = get_forward_backward_func()
    with cuda_calls_on_cpu(), cuda_stream_on_cpu():
        return forward_backward(
            forward_step_func=step,
            data_iterator=iter(range(micro_batches)),
            model=[stack.ddp],
            num_microbatches=micro_batches,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            decoder_seq_length=SEQ,
            forward_only=forward_only,
        )


ForwardFn = Callable[[MegatronStack, Batch, bool], Tensor]
"""``(stack, batch, train) -> [b, s]`` log-probs of the batch's labels from one forward."""


def inference_pass(stack: MegatronStack, rollout: Rollout, logprobs_of: ForwardFn) -> None:
    """Old-policy log-probs through the schedule, ``forward_only`` under ``no_grad`` (as RL trainers
    compute them); stored on the rollout."""
    rollout.old_logprobs = [torch.empty(0)] * len(rollout.batches)

    def step(data: Iterator[int], model: nn.Module) -> Any:
        m = next(data)
        logprobs = logprobs_of(stack, rollout.batches[m], False)
        rollout.old_logprobs[m] = logprobs.detach()
        return logprobs, lambda out: (out.sum() * 0, torch.tensor(1, dtype=torch.int), {})

    stack.ddp.eval()
    with torch.no_grad():
        _run_schedule(stack, step, len(rollout.batches), forward_only=True)
    stack.ddp.train()


def accumulate_gradients(stack: MegatronStack, rollout: Rollout, logprobs_of: ForwardFn) -> list[dict[str, Tensor]]:
    """Forward/backward every micro-batch of ``rollout`` through the schedule (DDP accumulates
    ``main_grad``, ``finalize_model_grads`` reduces); no optimizer step."""

    def step(data: Iterator[int], model: nn.Module) -> Any:
        m = next(data)
        logprobs = logprobs_of(stack, rollout.batches[m], True)
        return logprobs, functools.partial(ppo_loss, rollout, m)

    return _run_schedule(stack, step, len(rollout.batches), forward_only=False)


def training_step(stack: MegatronStack, rollout: Rollout, logprobs_of: ForwardFn) -> list[dict[str, Tensor]]:
    """One optimizer step: zero DDP's grad buffers, forward/backward every micro-batch through the
    schedule (DDP accumulates ``main_grad``, ``finalize_model_grads`` reduces), then mcore's step."""
    stack.ddp.zero_grad_buffer()
    stack.optimizer.zero_grad()
    logs = accumulate_gradients(stack, rollout, logprobs_of)
    with cuda_tensor_types():
        update_successful, _grad_norm, _zeros = stack.optimizer.step()
    assert update_successful
    return logs


def stock_logprobs(stack: MegatronStack, batch: Batch, train: bool) -> Tensor:
    """Stock mcore: labels in, per-token main loss out (MTP loss attached by mcore); ``-loss`` is the log-prob."""
    return -stack.ddp(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)


def hooked_logprobs(stack: MegatronStack, batch: Batch, train: bool) -> Tensor:
    """With ``mtp_hooks``: a training micro-batch under ``micro_batch``, an inference one without
    labels; log-probs from the returned logits with mcore's own cross-entropy."""
    hooks = mtp_hooks.hooks_of(stack.ddp)
    assert hooks is not None
    if train:
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            logits = stack.ddp(*batch.model_args)
    else:
        logits = stack.ddp(*batch.model_args)
    return token_logprobs(stack.gpt, logits, batch.labels)


def run_rollouts(stack: MegatronStack, rollouts: list[Rollout], logprobs_of: ForwardFn, steps_per_rollout: int = 2) -> list[list[Tensor]]:
    """Per rollout: an inference pass for old log-probs, then ``steps_per_rollout`` optimizer steps.
    Returns each rollout's old log-probs."""
    old = []
    for rollout in rollouts:
        inference_pass(stack, rollout, logprobs_of)
        old.append(list(rollout.old_logprobs))
        for _ in range(steps_per_rollout):
            training_step(stack, rollout, logprobs_of)
    return old


# --------------------------------------------------------------------------- checkpoints

def sharded_state(stack: MegatronStack, is_loading: bool = False) -> dict[str, Any]:
    """Megatron's checkpoint content: the unwrapped model's and the optimizer's sharded state dicts."""
    model = stack.gpt.sharded_state_dict()
    return {"model": model, "optimizer": stack.optimizer.sharded_state_dict(model, is_loading=is_loading)}


def save_checkpoint(stack: MegatronStack, directory: Path) -> None:
    """Save model and optimizer state with ``dist_checkpointing`` (``torch_dist`` format)."""
    directory.mkdir(parents=True, exist_ok=True)
    with checkpoint_io_on_cpu():
        dist_checkpointing.save(sharded_state(stack), str(directory))


def load_checkpoint(stack: MegatronStack, directory: Path) -> None:
    """Load model and optimizer state as Megatron's ``load_checkpoint`` does (into the unwrapped model)."""
    with checkpoint_io_on_cpu():
        state = dist_checkpointing.load(sharded_state(stack, is_loading=True), str(directory))
    stack.gpt.load_state_dict(state["model"])
    stack.optimizer.load_state_dict(state["optimizer"])


def checkpoint_contents(directory: Path) -> dict[str, Any]:
    """Everything a checkpoint holds, flat by path: its tensors (``tensors/...``) and its common,
    non-sharded state (``common/...``)."""
    with checkpoint_io_on_cpu():
        tensors = dist_checkpointing.load_plain_tensors(str(directory))
        common = dist_checkpointing.load_common_state_dict(str(directory))
    return {**flatten(tensors, "tensors/"), **flatten(common, "common/")}


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of nested dicts, lists and tuples of a state dict, by ``/``-joined path."""
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in flatten(value, f"{prefix}{key}/").items()}
    if isinstance(tree, (list, tuple)) and any(isinstance(item, (dict, list, tuple, Tensor)) for item in tree):
        return {k: v for i, value in enumerate(tree) for k, v in flatten(value, f"{prefix}{i}/").items()}
    return {prefix: tree}


def assert_same_contents(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """The same paths, and at each the same value: tensors equal in dtype, shape and every bit."""
    assert sorted(actual) == sorted(expected), f"only in actual: {sorted(set(actual) - set(expected))}, only in expected: {sorted(set(expected) - set(actual))}"
    for path, value in expected.items():
        other = actual[path]
        if isinstance(value, Tensor):
            assert isinstance(other, Tensor) and other.dtype == value.dtype and torch.equal(other, value), path
        else:
            assert other == value, path


# --------------------------------------------------------------------------- comparing training states

# bf16 tolerance where the two runs round at different points (the lean loss reduces in fp32 where
# stock reduces bf16 logits): as ``tests/parity/test_properties.py``, two bf16 spacings relative plus one
# spacing times the largest reference entry of that tensor. Applied to the *updates* of the fp32
# main params (final minus initial; the bf16 model params are their rounding) and to Adam's
# moments, which carry the gradients' scale (Adam's update alone would hide a scale error).
BF16_RTOL = 2 * 2**-7
BF16_ATOL_OF_MAX = 2**-7


def assert_same_training_state(
    actual: dict[str, dict[str, Tensor]],
    expected: dict[str, dict[str, Tensor]],
    initial: dict[str, Tensor],
    exact: bool,
) -> None:
    """``main_params_and_moments`` of two runs from the same ``initial`` params agree: bit for bit
    with ``exact``, else within the bf16 tolerance above (the step count always exactly)."""
    assert actual.keys() == expected.keys()
    for name, reference in expected.items():
        assert not torch.equal(reference["param"], initial[name]), f"{name} never moved: the comparison would be empty"
        state = actual[name]
        assert state.keys() == reference.keys() == {"param", "main_param", "exp_avg", "exp_avg_sq", "step"}, name
        for key, ref in reference.items():
            value = state[key]
            if exact or key == "step":
                assert torch.equal(value, ref), f"{name} {key}: max diff {(value.float() - ref.float()).abs().max()}"
                continue
            if key == "param":
                continue  # bf16 rounding of main_param, compared below
            if key == "main_param":
                start = initial[name].float().reshape(ref.shape)
                value, ref = value - start, ref - start
            atol = BF16_ATOL_OF_MAX * float(ref.abs().max())
            torch.testing.assert_close(value, ref, rtol=BF16_RTOL, atol=atol, msg=lambda m: f"{name} {key}: {m}")
