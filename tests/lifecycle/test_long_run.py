"""Long run: 1000 mixed micro-batches on one tiny hooked model; nothing accumulates.

The mix cycles through every way a micro-batch can go: training through ``micro_batch`` and
through ``labels=``, inference with and without gradients, ``inference_mode``, eval mode, a
forward that raises inside the output layer, user code raising inside ``micro_batch``, metric
reads. Every ``CHECK_EVERY`` micro-batches (after a warm-up) the test records:

* the number of hooks registered on all modules: must stay what ``attach`` registered;
* the tensors reachable from the hooks object (walking ``gc.get_referents`` from it, not into
  modules): must stay constant (0 right after a metrics read);
* the number of live ``torch.Tensor`` objects in the process: must stay constant;
* resident memory (``/proc/self/statm``): growth from the end of the warm-up to the end of the run
  must stay under ``RSS_BOUND``.

Why ``RSS_BOUND = 16 MiB``: over the 900 measured micro-batches, keeping one main-logits tensor per
micro-batch alive (``[2, 16, 256]`` fp32 = 32 KiB) would add 28 MiB, and keeping a micro-batch's
autograd graph alive far more, while allocator noise on this model measured under 2 MiB. The
tensor counts above catch smaller leaks exactly.
"""

from __future__ import annotations

import gc
import os
import types
from typing import Any, Callable

import pytest
import torch
from torch import nn

import mtp_hooks
from mtp_hooks.testing import Batch, TinyGPT, make_batch
from tests.support.micro_batches import infer_inference_mode, infer_no_grad_with_labels, infer_with_grad, train_context, train_kwargs

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB = 256
SHAPE = TinyGPT(vocab_size=VOCAB, hidden_size=16, num_layers=1, num_attention_heads=2, max_sequence_length=16, mtp_num_layers=2)
MICRO_BATCHES = 1000
WARM_UP = 100
CHECK_EVERY = 100
RSS_BOUND = 16 * 2**20

HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


class Fault(RuntimeError):
    pass


def registered_hooks(model: nn.Module) -> int:
    return sum(len(getattr(module, name)) for module in model.modules() for name in HOOK_DICTS)


def tensors_reachable_from(root: Any) -> int:
    """Tensors reachable from ``root`` through ``gc.get_referents``, not entering modules, classes,
    functions or Python modules (the model and code are not state of the hooks)."""
    stop = (nn.Module, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)
    seen: set[int] = set()
    stack = [root]
    count = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            count += 1
            continue
        if obj is not root and isinstance(obj, stop):
            continue
        stack.extend(gc.get_referents(obj))
    return count


def live_tensors() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --------------------------------------------------------------------------- the mix


def train_eval_mode(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch) -> None:
    model.eval()
    try:
        train_context(model, hooks, batch)
    finally:
        model.train()


def fault_in_output_layer(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch) -> None:
    def fail(*_: Any) -> None:
        raise Fault("injected")

    handle = model.output_layer.register_forward_hook(fail)
    try:
        train_context(model, hooks, batch)
    except Fault:
        pass
    else:
        raise AssertionError("the injected fault did not fire")
    finally:
        handle.remove()


def user_fault_in_micro_batch(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch) -> None:
    try:
        with hooks.micro_batch(batch.labels, batch.loss_mask):
            model(*batch.model_args)
            raise Fault("user code")
    except Fault:
        pass


def read_metrics(model: nn.Module, hooks: mtp_hooks.MTPHooks, batch: Batch) -> None:
    """Reset, train one micro-batch, read: exactly that micro-batch's tokens, finite losses."""
    hooks.metrics()
    train_context(model, hooks, batch)
    metrics = hooks.metrics()
    assert metrics["mtp_1/tokens"] == batch.loss_mask[:, 1:].sum().item()
    assert metrics["mtp_2/tokens"] == batch.loss_mask[:, 2:].sum().item()
    assert all(value == value for value in metrics.values())


MIX: list[Callable[[nn.Module, mtp_hooks.MTPHooks, Batch], None]] = [
    train_context,
    train_kwargs,
    infer_with_grad,
    train_context,
    infer_no_grad_with_labels,
    infer_inference_mode,
    train_eval_mode,
    fault_in_output_layer,
    user_fault_in_micro_batch,
    read_metrics,
]


def test_thousand_mixed_micro_batches_keep_hooks_tensors_and_memory_flat() -> None:
    model = SHAPE.build(11)
    batches = [make_batch(VOCAB, batch=2, seq=16, seed=seed) for seed in range(len(MIX))]
    hooks = mtp_hooks.attach(model)
    hooks_after_attach = registered_hooks(model)
    assert hooks_after_attach > 0
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    records: list[tuple[int, int, int, int]] = []
    for step in range(MICRO_BATCHES):
        kind = MIX[step % len(MIX)]
        kind(model, hooks, batches[step % len(MIX)])
        if step % len(MIX) == len(MIX) - 1:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        assert registered_hooks(model) == hooks_after_attach, f"micro-batch {step} ({kind.__name__})"
        if step + 1 >= WARM_UP and (step + 1) % CHECK_EVERY == 0:
            hooks.metrics()
            records.append((step + 1, tensors_reachable_from(hooks), live_tensors(), rss_bytes()))

    print("micro-batch, tensors reachable from hooks, live tensors, RSS MiB:")
    for step, reachable, live, rss in records:
        print(f"{step:5d} {reachable:3d} {live:6d} {rss / 2**20:8.1f}")
    first = records[0]
    for step, reachable, live, _rss in records:
        assert reachable == 0, f"after micro-batch {step}: {reachable} tensors reachable from the hooks"
        assert live == first[2], f"after micro-batch {step}: {live} live tensors, {first[2]} after warm-up"
    growth = records[-1][3] - first[3]
    assert growth < RSS_BOUND, f"RSS grew by {growth / 2**20:.1f} MiB over {MICRO_BATCHES - WARM_UP} micro-batches"
    for param in model.parameters():
        assert torch.isfinite(param).all()
