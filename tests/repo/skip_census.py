"""A pytest plugin that counts, by reason, the skips a whole run of the suite reports, without running
the whole suite: ``pytest -p tests.repo.skip_census tests`` with ``SKIP_CENSUS_OUT=<file.json>``.

* Decided before a test runs: every collected test whose ``skip`` / ``skipif`` marks (conftest-added ones
  included) skip it, as pytest's own ``evaluate_skip_marks`` decides at set-up, and every module skipped
  while it is collected (``pytest.skip(allow_module_level=True)``, one skip each in a run).
* Decided while a test runs (``pytest.skip(...)`` or ``pytest.importorskip(...)`` in its body): those tests
  alone are run, every other collected test is deselected, and their skips are counted.

The JSON written holds ``{"collected": {reason: count}, "running": {reason: count}}``. Skips raised
elsewhere at run time (a fixture, a helper) are not seen: ``tests/repo/test_skips.py`` checks that the
suite has none. Used by that test only.
"""

from __future__ import annotations

import inspect
import json
import os
from collections import Counter
from pathlib import Path

import pytest
from _pytest.skipping import evaluate_skip_marks

_collected: Counter[str] = Counter()
_running: Counter[str] = Counter()


def _reason(longrepr: object) -> str:
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _skips_while_running(item: pytest.Item) -> bool:
    function = getattr(item, "function", None)
    try:
        source = inspect.getsource(function) if function is not None else ""
    except (OSError, TypeError):
        return False
    return "pytest.skip(" in source or "pytest.importorskip(" in source


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:
        _collected[_reason(report.longrepr)] += 1


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept, deselected = [], []
    for item in items:
        skipped = evaluate_skip_marks(item)
        if skipped is not None:
            _collected[skipped.reason] += 1
            deselected.append(item)
        elif _skips_while_running(item) and item.path.name != "test_skips.py":  # never the test that runs this census
            kept.append(item)
        else:
            deselected.append(item)
    config.hook.pytest_deselected(items=deselected)
    items[:] = kept


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _running[_reason(report.longrepr)] += 1


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("SKIP_CENSUS_OUT")
    if out:
        census = {"collected": dict(sorted(_collected.items())), "running": dict(sorted(_running.items()))}
        Path(out).write_text(json.dumps(census, indent=1, sort_keys=True))
