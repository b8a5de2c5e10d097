"""`pytest --cpu-report`: the CPU seconds each test module costs, its own and its processes'.

CI runs on 2 cores and keeps both busy, so a module's wall time (`--durations`) says more about
what ran beside it than about itself: its CPU time is what a change can save. A module's figure
is the test process's CPU time over its tests (setup to teardown) plus that of the child
processes reaped meanwhile (stage processes, servers, compile workers: a child counts once
waited for, so a process kept across modules counts where it stops).
"""

from __future__ import annotations

import resource
from collections import defaultdict

import pytest

_START = pytest.StashKey[tuple]()
_KEY = "cpu_seconds"


def pytest_addoption(parser):
    parser.addoption("--cpu-report", action="store_true",
                     help="after the run, the CPU seconds each test module took (its own and its child processes')")


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if item.config.getoption("cpu_report"):
        item.stash[_START] = _cpu()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown" and _START in item.stash:
        now, start = _cpu(), item.stash[_START]
        report = outcome.get_result()
        # On the report (not the item), which xdist's workers send to the controller.
        report.user_properties = [*report.user_properties, (_KEY, (now[0] - start[0], now[1] - start[1]))]


class _Totals:
    def __init__(self):
        self.modules = defaultdict(lambda: [0.0, 0.0, 0.0])  # own CPU, children's CPU, wall

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report):
        row = self.modules[report.nodeid.split("::")[0]]
        row[2] += report.duration
        for key, (own, children) in report.user_properties:
            if key == _KEY:
                row[0] += own
                row[1] += children

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter):
        rows = sorted(self.modules.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))
        total = [sum(r[i] for _, r in rows) for i in range(3)]
        write = terminalreporter.write_line
        terminalreporter.section("CPU seconds per module")
        write(f"{'cpu':>8} {'own':>7} {'children':>8} {'wall':>7}  module")
        for name, (own, children, wall) in [*rows, ("total", total)]:
            write(f"{own + children:8.1f} {own:7.1f} {children:8.1f} {wall:7.1f}  {name}")


def pytest_configure(config):
    # The controller (or a run without xdist) sums the reports; xdist's workers only measure.
    if config.getoption("cpu_report") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Totals(), "cpu_report_totals")
