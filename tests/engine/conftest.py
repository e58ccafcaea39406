"""The engine tests run a real vLLM engine (``make test-engine``, in ``.vllm``), never in ``make test``.

``make test-engine`` sets ``MTP_HOOKS_ENGINE_TESTS=1`` (and ``MTP_HOOKS_ENGINE_CONFIG``, ``cpu`` by default).
Without it every test here is skipped with a reason naming the target; with it, a vLLM that cannot be
imported or an engine that cannot start fails the tests, never skips them.
"""

from __future__ import annotations

import gc
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


def _stop(llm: Any) -> None:
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    gc.collect()


@pytest.fixture(scope="module")
def engines(vllm_imported: None) -> Iterator[Callable[..., Any]]:
    """``engines(folder, k)``: an in-process engine on an HF folder, shut down at the module's end."""
    from mtp_hooks.engine import start_vllm

    started: list[Any] = []

    def start(folder: Path, num_speculative_tokens: int = 1, **kwargs: Any) -> Any:
        llm = start_vllm(str(folder), num_speculative_tokens, config=ENGINE_CONFIG, **kwargs)
        started.append(llm)
        return llm

    yield start
    for llm in started:
        _stop(llm)
    started.clear()
