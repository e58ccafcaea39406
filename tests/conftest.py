"""Shared fixtures: real mcore on CPU (gloo, world size 1), a clean process-wide MTP state, two spawned ranks."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Iterator

import pytest
import torch

# megatron-core's notices at import time (missing Transformer Engine / Apex), before pytest's
# filterwarnings (pyproject.toml) take over.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

from megatron.core.transformer.multi_token_prediction import (  # noqa: E402
    MTPLossAutoScaler,
    MTPLossLoggingHelper,
)

from mtp_hooks.testing import cuda_current_device_is_cpu, init_parallel  # noqa: E402

if TYPE_CHECKING:
    from tests.support.distributed import SpawnedGroup


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--parity-full",
        action="store_true",
        help="tests/parity/test_parity_matrix.py: the whole product of the knobs (not only its 3-wise covering set and sub-grid)",
    )


@pytest.fixture(scope="session", autouse=True)
def mcore_on_cpu() -> Iterator[None]:
    """One gloo process group and mcore's parallel state (TP=PP=CP=1) for the whole session."""
    with cuda_current_device_is_cpu():
        init_parallel()
        yield


@pytest.fixture(autouse=True)
def clean_mtp_process_state() -> Iterator[None]:
    """Empty mcore's MTP loss tracker and reset the AutoScaler's backward scale around each test."""
    MTPLossLoggingHelper.tracker.clear()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    torch.manual_seed(0)
    yield
    MTPLossLoggingHelper.tracker.clear()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))


@pytest.fixture(scope="module")
def group() -> Iterator[SpawnedGroup]:
    """Two spawned gloo ranks (``tests.support.distributed``), started once per test module that runs
    distributed scenarios: process start-up dominates, so the module's tests share them."""
    from tests.support.distributed import SpawnedGroup

    with SpawnedGroup(world_size=2) as spawned:
        yield spawned


@pytest.fixture(scope="module")
def one_intra_op_thread() -> Iterator[None]:
    """One intra-op thread for modules of many tiny models: on a loaded 2-core machine, handing
    each small matmul to a second thread costs more than the matmul (measured ~10x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
