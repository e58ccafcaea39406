"""vLLM's in-process shutdown and the trainer's process group (a pinned engine behaviour).

An RL trainer that runs vLLM in its own process has opened ``torch.distributed`` first; vLLM reuses
that default group. vLLM 0.32's ``EngineCore.shutdown`` (called by ``LLM``'s finalizer when the engine
is garbage collected) ends with ``cleanup_dist_env_and_memory()``, which destroys the default process
group whoever created it: the trainer's collectives then fail. ``mtp_hooks.engine.stop_vllm`` shuts
the engine down without that step. The pin fails once vLLM leaves a group it did not create alone.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from mtp_hooks.engine import VLLMSync, generate_greedy, start_vllm, stop_vllm
from mtp_hooks.errors import MTPHooksError
from mtp_hooks.export import mtp_hf_weights
from mtp_hooks.testing import engine_models as em
from mtp_hooks.testing import init_parallel


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, engines: Callable[..., Any]) -> Any:
    return em.engine_folder(tmp_path_factory.mktemp("mimo"), "mimo", em.trainer("mimo", "copy"))


def test_stop_vllm_keeps_the_trainers_process_group(folder: Any) -> None:
    assert torch.distributed.is_initialized()
    stop_vllm(start_vllm(str(folder), 1))
    assert torch.distributed.is_initialized()
    torch.distributed.barrier()


def test_a_stopped_engine_refuses_push_check_and_generate_naming_it(folder: Any) -> None:
    llm = start_vllm(str(folder), 1)
    sync = VLLMSync(llm)
    pairs = list(mtp_hf_weights(em.trainer("mimo", "copy"), "mimo"))
    sync.push(pairs)
    stop_vllm(llm)
    stop_vllm(llm)  # twice is harmless
    for call in (lambda: sync.push(pairs), lambda: sync.check(pairs), lambda: generate_greedy(llm, em.counting_prompts(2), 4)):
        with pytest.raises(MTPHooksError, match=r"^llm: refused\n  expected: a running engine for \w+\n  received: an engine stopped by stop_vllm"):
            call()


def test_vllms_own_shutdown_destroys_the_trainers_process_group(folder: Any) -> None:
    llm = start_vllm(str(folder), 1)
    try:
        assert torch.distributed.is_initialized()
        llm.llm_engine.engine_core.shutdown()
        assert not torch.distributed.is_initialized()
    finally:
        init_parallel()  # the session's group and mcore's parallel state, for the tests after this one
        from vllm.distributed.parallel_state import destroy_model_parallel

        destroy_model_parallel()
