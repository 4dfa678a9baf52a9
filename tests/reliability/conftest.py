"""Fixtures of the reliability suite: real processes stopped by PID, and scenario tallies.

Long mode (``KVTIER_RELIABILITY_LONG=1``, set by ``python -m loadtest.reliability --long``) is
read by the tests through :func:`tests.reliability.record.long_mode`.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from .procs import ProcessGroup
from .record import Tally

_OUTCOME = pytest.StashKey[str]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call" or (report.when == "setup" and not report.passed):
        item.stash[_OUTCOME] = "xfailed" if hasattr(report, "wasxfail") else report.outcome
    return report


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ProcessGroup]:
    """Processes this test starts; all stopped (by PID) when it ends."""
    group = ProcessGroup(tmp_path)
    try:
        yield group
    finally:
        group.close()


@pytest.fixture
def tally(request: pytest.FixtureRequest) -> Iterator[Tally]:
    """This scenario's counts, written for the report command when the test ends."""
    name = request.node.name.removeprefix("test_")
    if len(name) > 60:  # long parametrize ids (fuzz regression bodies)
        name = name[:57] + "..."
    record = Tally(scenario=name)
    yield record
    record.write(request.node.stash.get(_OUTCOME, "error"))
