"""``VLLMSync``: push the trainer's MTP weights into a running vLLM engine's draft, and prove it holds them.

An RL step changes the MTP layers; the rollouts after it must be drafted by the changed layers.
The field's most frequent MTP complaint is the opposite: the engine keeps drafting with old or
broken weights (a skipped or target-only update, weights lost to sleep mode, derived tensors never
recomputed) while training looks fine, and acceptance falls towards 0. ``push`` loads the pairs with
the engine's own loader and re-derives what the engine derives at load time; ``check`` compares
per-tensor checksums computed on each side, on each tensor's own device, and raises
``StaleDraftError`` naming the first tensor that differs.

Example::

    sync = VLLMSync(llm)                                   # an in-process vllm.LLM with method="mtp"
    for step in range(steps):
        train_step(model)                                  # the optimizer changes the MTP layers
        sync.push(mtp_hf_weights(model, "deepseek_v3"))
        sync.check(mtp_hf_weights(model, "deepseek_v3"))   # StaleDraftError if the engine differs
        rollouts = llm.generate(prompts, sampling)
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterable, Optional

import torch
from torch import Tensor

from mtp_hooks.engine.checksums import checksums
from mtp_hooks.engine.ledger import Write, compare
from mtp_hooks.engine.vllm_worker import ROLES, PushOutcome, live_checksums_on_worker, push_on_worker
from mtp_hooks.errors import MTPHooksError, bad_argument, describe

__all__ = ["PushReport", "VLLMSync"]


@dataclasses.dataclass(frozen=True)
class PushReport:
    """One push: how many tensors and bytes reached the engine, and how long it took."""

    tensors: int
    bytes: int  # of the pushed tensors as given (the engine casts them to its parameters' dtypes)
    seconds: float  # the whole call: cast, transfer, the engine's load and processing
    engine_seconds: float  # inside the engine: load and processing
    writes: tuple[Write, ...]


def _dtype(name: str) -> torch.dtype:
    found = getattr(torch, name.removeprefix("torch."), None)
    assert isinstance(found, torch.dtype), name
    return found


class VLLMSync:
    """Pushes weights into an in-process ``vllm.LLM``'s draft (or target) model and checks them there.

    Args:
        llm: a ``vllm.LLM`` whose workers run ``collective_rpc`` callables: in process
            (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``distributed_executor_backend="uni"``, as
            ``mtp_hooks.engine.start_vllm`` starts it) the pushed tensors are handed over without
            a copy; with worker processes they are pickled to them. Tensor parallelism 1: each
            pushed tensor must reach the engine whole.

    The last push's writes are kept here, per model (``"draft"``, ``"target"``), for ``check``.
    """

    def __init__(self, llm: Any) -> None:
        if not callable(getattr(llm, "collective_rpc", None)):
            raise bad_argument("llm", "a vllm.LLM (with collective_rpc)", describe(llm))
        self._llm = llm
        self._ledgers: dict[str, dict[str, list[Write]]] = {role: {} for role in ROLES}

    def _role(self, model: str) -> str:
        if model not in ROLES:
            raise bad_argument("model", f"one of {ROLES}", repr(model))
        return model

    def engine_dtype(self) -> torch.dtype:
        """The engine's model dtype (its parameters' but for a few it keeps in fp32, as MoE gates)."""
        return self._llm.llm_engine.model_config.dtype

    def push(self, weights: Iterable[tuple[str, Tensor]], *, model: str = "draft") -> PushReport:
        """Load ``(hf_name, tensor)`` pairs into the engine's ``model`` and re-derive its runtime weights.

        The tensors go as they are (the engine's copy casts each to its parameter's dtype, as a
        load from disk does): loaded by the engine's ``load_weights`` inside vLLM's layerwise reload
        (``mtp_hooks.engine.vllm_worker``). Push tensors in the dtype the engine computes in (bf16)
        to halve the bytes of an fp32 trainer's.

        Raises:
            MTPHooksError: a name the engine's loader did not take (not this model's, or a tensor
                it would shard), or engine parameters of ``model`` no pushed tensor reached (a
                partial push would leave a mixed draft: push whole MTP layers). The engine holds
                the pushed tensors either way; the message says which parts are not the trainer's.
        """
        role = self._role(model)
        start = time.perf_counter()
        pairs = [(name, tensor.detach().contiguous()) for name, tensor in weights]
        if not pairs:
            raise bad_argument("weights", "at least one (hf_name, tensor) pair", "an empty iterable")
        outcome: PushOutcome = self._llm.collective_rpc(push_on_worker, args=(pairs, role))[0]
        ledger: dict[str, list[Write]] = {}
        for write in outcome.writes:
            ledger.setdefault(write.name, []).append(write)
        self._ledgers[role] = ledger
        report = PushReport(
            tensors=len(pairs),
            bytes=sum(t.numel() * t.element_size() for _, t in pairs),
            seconds=time.perf_counter() - start,
            engine_seconds=outcome.seconds,
            writes=outcome.writes,
        )
        if outcome.not_written or outcome.untouched:
            raise MTPHooksError(
                f"weights: the push did not cover the engine's {role} model\n"
                f"  expected: every pushed name taken by its loader, every {role} parameter reached\n"
                f"  received: {len(outcome.not_written)} names not taken {list(outcome.not_written)[:8]}, "
                f"{len(outcome.untouched)} parameters not reached {list(outcome.untouched)[:8]}"
            )
        return report

    def check(self, weights: Iterable[tuple[str, Tensor]], *, model: str = "draft") -> int:
        """Prove that the engine's ``model`` holds ``weights``: per-tensor checksums on each side.

        The trainer's side: each tensor cast to the dtype of the engine parameter it went into at
        the last push (bf16, fp32 for MoE gates) and checksummed on its own device. The engine's side: the checksums its loader's writes had at the last push, and,
        where the engine still holds the written view (not repacked and released by its kernels),
        the view's checksum now. Only the checksums cross to the host.

        Returns:
            The number of tensors checked.

        Raises:
            StaleDraftError: naming the first tensor that differs (never pushed, changed in the
                trainer since the last push, or changed in the engine since), with both checksums.
        """
        role = self._role(model)
        pairs = list(weights)
        if not pairs:
            raise bad_argument("weights", "at least one (hf_name, tensor) pair", "an empty iterable")
        ledger = self._ledgers[role]
        dtypes = {name: _dtype(ledger[name][0].dtype) if ledger.get(name) else self.engine_dtype() for name, _ in pairs}
        trainer = checksums(pairs, dtypes)
        probes = [(name, index, write) for name, writes in ledger.items() for index, write in enumerate(writes)]
        live: dict[tuple[str, int], Optional[int]] = {}
        if probes:
            values = self._llm.collective_rpc(live_checksums_on_worker, args=(role, [write for *_, write in probes]))[0]
            live = {(name, index): value for (name, index, _), value in zip(probes, values)}
        return compare(trainer, {name: tuple(t.shape) for name, t in pairs}, ledger, live)
