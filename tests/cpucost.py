"""The suite's budget in CPU seconds: each test's user+sys time, its own and its children's, and
the ten costliest closing the log beside pytest's ten slowest. On 2 busy workers wall time says
little (a test waits for the core the other worker holds); CPU is what the 15 minutes are spent
on, most of it in fresh torch processes a test starts.

A child is counted when it is reaped (getrusage's RUSAGE_CHILDREN): a process one test starts and
a later one waits for lands on the later test. Figures travel from xdist's workers to the
controller in each teardown report's user_properties."""

from __future__ import annotations

import resource
from collections.abc import Iterator

import pytest

_KEY = "cpu_s"
_STARTED = pytest.StashKey[float]()
_SHOWN = 10


def _cpu_seconds() -> float:
    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    item.stash[_STARTED] = _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    if call.when == "teardown" and _STARTED in item.stash:
        report: pytest.TestReport = outcome.get_result()
        report.user_properties.append((_KEY, round(_cpu_seconds() - item.stash[_STARTED], 2)))


class _Costs:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "teardown":
            self.seconds.update((report.nodeid, float(v)) for k, v in report.user_properties if k == _KEY)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.seconds:
            return
        total = sum(self.seconds.values())
        terminalreporter.write_sep("=", f"costliest {_SHOWN} in CPU seconds (of {total:,.0f} in all tests)")
        for nodeid, seconds in sorted(self.seconds.items(), key=lambda kv: -kv[1])[:_SHOWN]:
            terminalreporter.write_line(f"{seconds:8.1f}s cpu  {nodeid}")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_Costs(), "cpucost-summary")
