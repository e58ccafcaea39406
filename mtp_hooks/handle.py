"""The handle of the hooks on one language model: ``MTPHooks`` (what ``attach`` returns) and the
``micro_batch`` block it opens (``MicroBatchTargets``).

All per-model state is one ``ForwardHooks`` object (``hooks``) held by the handle; ``remove``
removes every hook it installed and restores stock mcore.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from mtp_hooks.errors import bad_state
from mtp_hooks.hooks import ForwardHooks
from mtp_hooks.models import STATE_KEY
from mtp_hooks.options import Options
from mtp_hooks.runtime.micro_batch import MicroBatch, MicroBatches


class MicroBatchTargets:
    """What ``MTPHooks.micro_batch`` returns: a context manager whose block owns the targets.

    Inside the block, the one training (grad-enabled) forward of this thread trains on them;
    grad-disabled forwards in the block are inference and leave them. They are dropped on exit
    (also by exception), so they can never train a later batch. Not entered, they train nothing:
    the next forward or ``micro_batch`` raises ``MTPHooksStateError``.
    """

    def __init__(self, hooks: "MTPHooks", micro_batches: MicroBatches, targets: MicroBatch) -> None:
        self._hooks = hooks
        self._micro_batches = micro_batches
        self._targets = targets

    def __enter__(self) -> "MTPHooks":
        self._targets.entered = True
        return self._hooks

    def __exit__(self, *exc: Any) -> None:
        self._micro_batches.disarm(self._targets, completed=exc[0] is None)


class MTPHooks:
    """Handle of ``mtp_hooks`` on one language model. Create it with ``attach``.

    Use ``micro_batch`` to give the labels of a training micro-batch, ``metrics`` to read the
    per-depth MTP loss and acceptance, and ``remove`` (or ``with``) to restore stock mcore.
    After ``remove`` every method but ``remove`` raises ``MTPHooksStateError``.
    """

    def __init__(self, model: nn.Module, options: Options) -> None:
        self.options = options
        self._hooks = ForwardHooks(model, options)
        self._handles: list[RemovableHandle] = self._hooks.install(model)
        self._model_class = type(model).__name__
        self._removed = False

    def _live(self, method: str) -> ForwardHooks:
        if self._removed:
            raise bad_state(
                method,
                "hooks still attached (attach the model again to train MTP)",
                "a call after remove() (these hooks were removed)",
            )
        return self._hooks

    @property
    def model(self) -> nn.Module:
        """The language model the hooks sit on."""
        return self._live("model").binding.model

    @property
    def depth(self) -> int:
        """Number of draft steps trained: ``config.mtp_num_layers``, or ``draft_steps``."""
        return self._hooks.depth

    @property
    def loss_scale(self) -> float:
        """Total MTP loss weight (split evenly over depths), as used by the next forward."""
        return self.options.mtp_loss_scale(self.model.config)

    @property
    def loss_path(self) -> Optional[str]:
        """How the last completed training micro-batch computed its MTP losses, ``None`` before one.

        ``"fused"`` (weight gradient accumulated in forward, stock's matmul count), ``"recompute"``
        (weight gradient recomputed in backward, one head matmul more, no accumulator),
        ``"detached"`` (lean with a detached head weight: no weight-gradient work) or ``"dense"``.
        """
        return self._hooks.loss_path

    def draft_plan(self) -> tuple[int, ...]:
        """Which MTP layer (an index into ``model.mtp.layers``) runs each draft step 1..k of a training forward:
        layer 0 for every step with ``draft_layers="first"`` (vLLM 0.32), else the block's layer of depth j for step j
        (mcore, SGLang: layer j - 1, or the one module that serves every depth) and for the steps past the block's
        the last one (``"per_step"``) or layer (j - 1) mod N (``"cyclic"``: vLLM 0.34)."""
        plan = self._live("draft_plan").plan
        block = tuple(min(depth, plan.layer) for depth in range(plan.kept))
        return block + tuple(map(plan.rerun_index, range(plan.reruns)))

    def micro_batch(
        self, labels: Tensor, loss_mask: Optional[Tensor] = None, *, loss_scale: Any = None
    ) -> MicroBatchTargets:
        """``with hooks.micro_batch(labels, loss_mask): model(...)``: the training forward in the
        block trains MTP on these ``[b, s]`` targets.

        The block owns them: its one grad-enabled forward of this model from this thread trains on
        them (a second raises), grad-disabled forwards in it are inference (with
        ``output="logprobs"`` they score the labels) and never use them up, and they are dropped on
        exit, also by exception. Why only ``with``: targets armed by a plain call would outlive a
        step that failed before its forward and silently train a later batch, or be taken by an
        inference forward. A plain call therefore trains nothing, and the next forward or
        ``micro_batch`` raises ``MTPHooksStateError``; pass ``labels=`` to the model instead.

        ``labels`` are next-token labels (as for the main head), ``loss_mask`` is aligned with
        them. Validated when called (``MTPHooksError``). ``loss_scale`` (a float >= 0 or a 0-d
        tensor, no host sync) multiplies this micro-batch's MTP loss, e.g. a per-micro-batch MTP
        gradient scale, or 0 to gate it off.

        One thread at a time: another thread's forward while one is in flight raises
        ``MTPHooksStateError``; it never sees this thread's targets.
        """
        hooks = self._live("micro_batch")
        return MicroBatchTargets(self, hooks.binding.micro_batches, hooks.binding.arm(labels, loss_mask, loss_scale))

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """Per-depth ``mtp_k/loss`` (masked mean CE), ``mtp_k/acc`` (share of masked positions whose
        argmax is the label) and ``mtp_k/tokens``, over the training forwards completed since the
        last reset (a forward that raised counts for nothing). A depth that counted no token has
        ``mtp_k/tokens == 0`` and no ratios. Where acceptance is measured (``agreement_metrics``
        or a draft objective) also ``mtp_k/agree``, ``mtp_k/accept`` (expected acceptance
        under ``accept_rule``: ``p_T(argmax q)`` by default) and ``mtp/accept_len``: the expected
        number of accepted draft tokens of the chained depths, ``sum_k mean_t prod_{j<=k} alpha_j(t)`` with the product
        taken per position (``metrics.MTPMetrics`` says why), each mean over the positions where
        depths 1..k all have a target; absent while there is no position with every depth's
        target. mcore's tracker gets no ``accept_len``: it holds per-depth loss and label counts
        only, and stays as stock fills it. Local to this rank (identical across TP ranks). Empty
        if nothing was trained. Reading syncs with the device once. With ``draft_step_weights`` also
        ``mtp_k/weight``, the weight on step k's loss."""
        hooks = self._live("metrics")
        hooks.binding.flight.recover_abandoned()
        read = hooks.metrics.read(reset)
        weights = self.options.step_weights(hooks.depth)
        if read and weights is not None:
            read.update({f"mtp_{j}/weight": weight for j, weight in enumerate(weights, start=1)})
        return read

    def remove(self) -> None:
        """Remove every hook; the model is stock again. Calling it twice is harmless.

        Raises ``MTPHooksStateError`` while a forward of the model is running (on any thread).
        """
        if self._removed:
            return
        self._hooks.close()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._removed = True
        model = self._hooks.binding.alive_model
        if model is not None and model.__dict__.get(STATE_KEY) is self:
            del model.__dict__[STATE_KEY]

    def __enter__(self) -> "MTPHooks":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = ", removed" if self._removed else ""
        options = "".join(f", {name}={value!r}" for name, value in self.options.changed().items())
        return f"MTPHooks({self._model_class}, depth={self.depth}{options}{state})"
