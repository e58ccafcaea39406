"""The engine tests run a real vLLM engine (``make test-engine``, in ``.vllm``), never in ``make test``.

``make test-engine`` sets ``MTP_HOOKS_ENGINE_TESTS=1`` (and ``MTP_HOOKS_ENGINE_CONFIG``, ``cpu`` by default).
Without it every test here is skipped with a reason naming the target; with it, a vLLM that cannot be
imported or an engine that cannot start fails the tests, never skips them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

ENGINE_TESTS = os.environ.get("MTP_HOOKS_ENGINE_TESTS") == "1"
ENGINE_CONFIG = os.environ.get("MTP_HOOKS_ENGINE_CONFIG", "cpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if ENGINE_TESTS:
        return
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason="runs a vLLM engine: make test-engine (in .vllm, from make engine-env)")
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_imported() -> None:
    """vLLM imports (a failure here fails every engine test: ``make engine-env`` builds it)."""
    import vllm  # noqa: F401


@pytest.fixture(scope="module")
def engines(vllm_imported: None) -> Iterator[Callable[..., Any]]:
    """``engines(folder, k)``: an in-process engine on an HF folder. One at a time: starting one stops the
    one before (vLLM's model-parallel groups are per process); the last stops at the module's end."""
    from mtp_hooks.engine import start_vllm, stop_vllm

    running: list[Any] = []

    def start(folder: Path, num_speculative_tokens: int = 1, **kwargs: Any) -> Any:
        while running:
            stop_vllm(running.pop())
        try:
            running.append(start_vllm(str(folder), num_speculative_tokens, config=ENGINE_CONFIG, **kwargs))
        except BaseException:
            from vllm.distributed.parallel_state import destroy_model_parallel

            destroy_model_parallel()  # what the failed start built: the next engine builds its own
            raise
        return running[-1]

    yield start
    while running:
        stop_vllm(running.pop())


def copy_draft_engine(family: str, engines: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """``(trainer, llm)``: the counting trainer of ``family`` with its copy draft, and an engine on its HF folder (k = 1)."""
    from mtp_hooks.testing import engine_models as em

    model = em.trainer(family, "copy")
    return model, engines(em.engine_folder(tmp_path_factory.mktemp(family), family, model), 1)
