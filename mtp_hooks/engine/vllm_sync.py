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

import collections
import dataclasses
import time
from typing import Any, Iterable, Mapping, Optional

import torch
from torch import Tensor

from mtp_hooks.engine.checksums import checksums
from mtp_hooks.engine.ledger import Write, compare
from mtp_hooks.engine.vllm_worker import ROLES, PushOutcome, live_checksums_on_worker, push_on_worker
from mtp_hooks.engine.vllm_cpu_fix import install_sampling_fix_for
from mtp_hooks.engine.vllm_engine import refuse_stopped
from mtp_hooks.errors import MTPHooksError, StaleDraftError, bad_argument, describe

__all__ = ["PushReport", "VLLMSync"]


@dataclasses.dataclass(frozen=True)
class PushReport:
    """One push: how many tensors and bytes reached the engine, and how long it took."""

    tensors: int
    bytes: int  # of the pushed tensors as given (the engine casts them to its parameters' dtypes)
    seconds: float  # the whole call: cast, transfer, the engine's load and processing
    engine_seconds: float  # inside the engine: load and processing
    writes: tuple[Write, ...]


def validated_pairs(weights: Any) -> list[tuple[str, Tensor]]:
    """``weights`` as a list of ``(name, floating tensor)`` pairs, or ``MTPHooksError`` naming what came."""
    if isinstance(weights, Mapping):
        raise bad_argument(
            "weights",
            "an iterable of (hf_name, tensor) pairs (for a dict: weights.items())",
            f"a {type(weights).__name__}",
        )
    if isinstance(weights, (Tensor, str, bytes)) or not isinstance(weights, Iterable):
        raise bad_argument("weights", "an iterable of (hf_name, tensor) pairs", describe(weights))
    pairs = []
    for index, item in enumerate(weights):
        if not (
            isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], Tensor)
        ):
            raise bad_argument(f"weights[{index}]", "a (hf_name: str, tensor) pair", describe(item))
        name, tensor = item
        if not tensor.is_floating_point():
            raise bad_argument(f"weights[{index}] ({name})", "a floating-point tensor", describe(tensor))
        pairs.append((name, tensor.detach().contiguous()))
    if not pairs:
        raise bad_argument("weights", "at least one (hf_name, tensor) pair", "an empty iterable")
    twice = sorted(name for name, count in collections.Counter(name for name, _ in pairs).items() if count > 1)
    if twice:
        raise bad_argument("weights", "each name once", f"{twice[:8]} more than once")
    return pairs


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
        self._stale: dict[str, str] = {role: "" for role in ROLES}  # why the engine's model is unknown
        self.derived_backends: tuple[str, ...] = ()  # the MLA derivations the last push proved
        install_sampling_fix_for(llm)

    def _role(self, model: str) -> str:
        if model not in ROLES:
            raise bad_argument("model", f"one of {ROLES}", repr(model))
        return model

    def engine_dtype(self) -> torch.dtype:
        """The engine's model dtype (its parameters' but for a few it keeps in fp32, as MoE gates)."""
        return self._llm.llm_engine.model_config.dtype

    def push(self, weights: Iterable[tuple[str, Tensor]], *, model: str = "draft") -> PushReport:
        """Load ``(hf_name, tensor)`` pairs into the engine's ``model`` and re-derive its runtime weights.

        The push is all or nothing where it can be: it is first rehearsed on the meta device with the
        engine's own loader, and a name the loader does not take, a shape it refuses, or a parameter
        of ``model`` it would leave unwritten refuses it before any byte reaches the engine (the
        engine keeps the last good push, and ``check`` of those pairs still passes). Then the tensors
        go as they are (the engine's copy casts each to its parameter's dtype, as a load from disk
        does), through vLLM's layerwise reload (``mtp_hooks.engine.vllm_worker``), and the tensors vLLM
        derives after loading (MLA's ``W_UK_T`` / ``W_UV`` or their AMX-packed forms) are re-derived
        from the pushed ones and compared bit for bit. Push tensors in the dtype the engine computes
        in (bf16) to halve the bytes of an fp32 trainer's.

        Raises:
            MTPHooksError: the pairs are not ``(str, Tensor)`` pairs of floating tensors, the engine
                was stopped, or the rehearsal refused them (the engine is unchanged). If vLLM fails
                once it has started writing, or a derived tensor is not the pushed one's, the engine
                is marked stale: every ``check`` of ``model`` raises ``StaleDraftError`` saying why,
                until a push succeeds.
        """
        role = self._role(model)
        self._alive("push")
        start = time.perf_counter()
        pairs = validated_pairs(weights)
        outcome: PushOutcome = self._llm.collective_rpc(push_on_worker, args=(pairs, role))[0]
        if outcome.refused:
            raise MTPHooksError(
                f"weights: the engine's {role} model would not take the push whole; nothing was written\n"
                f"  expected: every pushed name taken by its loader at its shape, every {role} parameter written\n"
                f"  received: {outcome.refused}"
            )
        if outcome.failed:
            self._ledgers[role] = {}
            self._stale[role] = outcome.failed
            raise MTPHooksError(
                f"weights: the push into the engine's {role} model failed after writing began; "
                "the engine is marked stale\n"
                f"  expected: a load that writes every pushed tensor and re-derives what the engine derives\n"
                f"  received: {outcome.failed}"
            )
        ledger: dict[str, list[Write]] = {}
        for write in outcome.writes:
            ledger.setdefault(write.name, []).append(write)
        self._ledgers[role] = ledger
        self._stale[role] = ""
        self.derived_backends = outcome.backends
        return PushReport(
            tensors=len(pairs),
            bytes=sum(t.numel() * t.element_size() for _, t in pairs),
            seconds=time.perf_counter() - start,
            engine_seconds=outcome.seconds,
            writes=outcome.writes,
        )

    def _alive(self, call: str) -> None:
        refuse_stopped(self._llm, call)

    def check(self, weights: Iterable[tuple[str, Tensor]], *, model: str = "draft") -> int:
        """Prove that the engine's ``model`` holds ``weights``: per-tensor checksums on each side.

        The trainer's side: each tensor cast to the dtype of the engine parameter it went into at
        the last push (bf16, fp32 for MoE gates) and checksummed on its own device. The engine's side:
        the checksums its loader's writes had at the last push, and,
        where the engine still holds the written view (not repacked and released by its kernels),
        the view's checksum now. Only the checksums cross to the host.

        Returns:
            The number of tensors checked.

        Raises:
            StaleDraftError: naming the first tensor that differs (never pushed, changed in the
                trainer since the last push, or changed in the engine since), with both checksums.
        """
        role = self._role(model)
        self._alive("check")
        pairs = validated_pairs(weights)
        if self._stale[role]:
            raise StaleDraftError(
                f"{pairs[0][0]}: the engine's {role} is not the trainer's\n"
                f"  expected: the last push complete\n  received: {self._stale[role]}\n"
                "  push the trainer's weights again"
            )
        ledger = self._ledgers[role]
        dtypes = {name: ledger[name][0].torch_dtype if ledger.get(name) else self.engine_dtype() for name, _ in pairs}
        trainer = checksums(pairs, dtypes)
        probes = [(name, index, write) for name, writes in ledger.items() for index, write in enumerate(writes)]
        live: dict[tuple[str, int], Optional[int]] = {}
        if probes:
            values = self._llm.collective_rpc(live_checksums_on_worker, args=(role, [write for *_, write in probes]))[0]
            live = {(name, index): value for (name, index, _), value in zip(probes, values)}
        return compare(trainer, {name: tuple(t.shape) for name, t in pairs}, ledger, live)
