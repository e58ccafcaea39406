"""A short demo on a tiny CPU model: MTP trains on training micro-batches, is skipped on inference ones.

``python -m benchmarks.demo`` (``make demo``). Two identical real mcore GPTModels with MTP layers:
one with ``mtp_hooks`` attached (it returns logits), one left stock (labels in, loss out), both
updated by the same SGD steps. For every micro-batch the demo prints the MTP metrics and the
largest difference from stock mcore in MTP losses, main-head logits and gradients. Stock
mcore's main-head logits are read, without changing anything, by a forward hook on its output
layer; stock cannot run without labels, so its inference micro-batches get labels under no_grad.
The hooks record their MTP losses in mcore's ``MTPLossLoggingHelper`` tracker as stock does, so the
tracker is read (and cleared) after each model's forward: the hooked model's reading and the hooks'
own metrics are both compared with stock's. Exit status 0 when everything matches, 1 otherwise.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Optional

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|tp_group is None|ffn_hidden_size|full scope).*")

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper  # noqa: E402

import mtp_hooks  # noqa: E402
from benchmarks import models  # noqa: E402
from benchmarks.configs import Config, Shape  # noqa: E402
from benchmarks.variants import main_loss, masked_mean  # noqa: E402

SHAPE = Shape(vocab=128, seq=16, mtp=2, hidden=64, layers=2, heads=4, batch=2)
CONFIG = Config(
    name="demo", device="cpu", dtype=torch.float32, base=SHAPE, vocab_sweep=(), seq_sweep=(), mtp_sweep=(),
    rounds=1, warmup=0, position_embedding="learned_absolute",
)
SCHEDULE = ["train", "train", "inference", "train", "inference", "train"]
LEARNING_RATE = 0.5


class LastOutput:
    """Read-only forward hook: keeps the last output of a module (stock's main-head logits)."""

    def __init__(self, module: nn.Module) -> None:
        self.value: Optional[Tensor] = None
        self.handle = module.register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, args: Any, output: Any) -> None:
        self.value = output[0].detach().clone()  # stock's fp32 CE later writes into its logits


def _max_diff(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _grad_diff(model: nn.Module, reference: nn.Module) -> float:
    worst = 0.0
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        a = torch.zeros_like(p) if p.grad is None else p.grad
        b = torch.zeros_like(q) if q.grad is None else q.grad
        worst = max(worst, _max_diff(a, b))
    return worst


def _tracked_losses() -> list[float]:
    """Per-depth MTP losses mcore's ``MTPLossLoggingHelper`` holds since it was last cleared."""
    tracker = MTPLossLoggingHelper.tracker
    values = tracker.get("loss_values", tracker.get("values"))  # 0.19.2+ keeps acceptance counts beside it
    if values is None:
        raise RuntimeError("mcore's MTP loss tracker holds nothing: no MTP loss was recorded")
    return [float(v) for v in values.tolist()]


def _sgd(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(LEARNING_RATE * p.grad)
    model.zero_grad(set_to_none=True)


def main() -> int:
    with contextlib.ExitStack() as stack:
        models.setup(CONFIG, stack)
        hooked = models.build(CONFIG, SHAPE, SHAPE.mtp)
        stock = models.build(CONFIG, SHAPE, SHAPE.mtp)
        stock_logits = LastOutput(stock.output_layer)
        hooks = mtp_hooks.attach(hooked)  # defaults: lean MTP loss, mcore's mtp_loss_scaling_factor
        batches = [models.make_batch(CONFIG, SHAPE, seed=i) for i in range(2)]
        print(
            f"mtp_hooks demo: real mcore GPTModel (V={SHAPE.vocab}, h={SHAPE.hidden}, {SHAPE.layers} layers, "
            f"N={SHAPE.mtp} MTP layers), micro-batches of {SHAPE.batch}x{SHAPE.seq} tokens on CPU,\n"
            f"next to an identical stock twin; both take the same SGD steps (lr {LEARNING_RATE}).\n"
            "Right of '|': largest |mtp_hooks - stock mcore| in MTP losses, main-head logits, gradients.\n"
        )
        depth_cols = "".join(f"  mtp_{k}/loss  mtp_{k}/acc" for k in range(1, SHAPE.mtp + 1))
        print(f"step  micro-batch  main loss{depth_cols}  |  MTP loss   logits    grads")
        worst = {"loss": 0.0, "logits": 0.0, "grads": 0.0}
        for step, kind in enumerate(SCHEDULE, start=1):
            batch = batches[(step - 1) % len(batches)]
            MTPLossLoggingHelper.tracker.clear()
            if kind == "train":
                with hooks.micro_batch(labels=batch.labels, loss_mask=batch.loss_mask):
                    logits = hooked(*batch.model_args)
                loss = main_loss(logits.clone(), batch)  # mcore's CE writes into fp32 logits
                loss.backward()
                # The hooks feed mcore's MTP loss tracker as stock does: read it before stock adds to it.
                ours_tracked = _tracked_losses()
                MTPLossLoggingHelper.tracker.clear()
                per_token = stock(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
                masked_mean(per_token, batch.loss_mask).backward()
                stock_mtp = _tracked_losses()
                metrics = hooks.metrics()
                ours_mtp = [metrics[f"mtp_{k}/loss"] for k in range(1, SHAPE.mtp + 1)]
                # both readings of ours (the hooks' metrics, mcore's tracker) against stock's tracker
                ours_mtp = ours_mtp + ours_tracked
                stock_mtp = stock_mtp + stock_mtp
                diffs = {
                    "loss": max(abs(a - b) for a, b in zip(ours_mtp, stock_mtp)),
                    "logits": _max_diff(logits.detach(), stock_logits.value.transpose(0, 1)),
                    "grads": _grad_diff(hooked, stock),
                }
                cols = "".join(f"  {metrics[f'mtp_{k}/loss']:>10.4f}  {metrics[f'mtp_{k}/acc']:>9.3f}" for k in range(1, SHAPE.mtp + 1))
                print(f"{step:>4}  {kind:<11}  {loss.item():>9.4f}{cols}  |  {diffs['loss']:>8.1e}  {diffs['logits']:>7.1e}  {diffs['grads']:>7.1e}")
                _sgd(hooked)
                _sgd(stock)
            else:
                with torch.no_grad():
                    logits = hooked(*batch.model_args)
                    stock(*batch.model_args, labels=batch.labels, loss_mask=batch.loss_mask)
                skipped = "(MTP skipped)".center(len(depth_cols))
                diffs = {"logits": _max_diff(logits, stock_logits.value.transpose(0, 1))}
                assert not hooks.metrics(), "an inference micro-batch recorded MTP metrics"
                print(f"{step:>4}  {kind:<11}  {'-':>9}{skipped}  |  {'-':>8}  {diffs['logits']:>7.1e}  {'-':>7}")
            for key, value in diffs.items():
                worst[key] = max(worst[key], value)
        hooks.remove()
        stock_logits.handle.remove()
        ok = worst["loss"] < 1e-4 and worst["logits"] < 1e-4 and worst["grads"] < 1e-4
        print(
            f"\nlargest differences from stock mcore over all steps: MTP loss {worst['loss']:.1e}, "
            f"logits {worst['logits']:.1e}, gradients {worst['grads']:.1e} -> "
            + ("same as stock within fp32 rounding" if ok else "DIFFERENT from stock")
        )
        return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
