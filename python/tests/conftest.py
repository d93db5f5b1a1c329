"""pytest's configuration of the Python binding's tests (python/tests/*.py).

- Exit status as Meson reads it: a run where every test skipped (or a module
  skipped whole, e.g. without torch) exits 77, Meson's "skipped", where pytest
  would exit 0 or 5 (no tests collected); a run with no test at all stays a
  failure (5).
- ``closing``: objects to close after the test, last first.
"""
from __future__ import annotations

import pytest

import kvi_testutil  # noqa: F401  (puts kvinject on the path)

MESON_SKIP = 77


class _Outcomes:
    def __init__(self):
        self.passed = self.failed = self.skipped = 0

    def pytest_runtest_logreport(self, report):
        if report.passed and report.when == "call":
            self.passed += 1
        elif report.failed:
            self.failed += 1
        elif report.skipped:
            self.skipped += 1

    def pytest_collectreport(self, report):
        if report.skipped:
            self.skipped += 1
        elif report.failed:
            self.failed += 1


def pytest_configure(config):
    config._kvi_outcomes = _Outcomes()
    config.pluginmanager.register(config._kvi_outcomes, "kvi-outcomes")


def pytest_sessionfinish(session, exitstatus):
    o = session.config._kvi_outcomes
    if exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED) and o.passed == 0 and \
            o.failed == 0 and o.skipped > 0:
        session.exitstatus = MESON_SKIP


@pytest.fixture
def closing():
    """A list of objects (stores, models, injectors) that the test made; each is
    closed after the test, the last first."""
    objs = []
    yield objs
    for obj in reversed(objs):
        obj.close()
