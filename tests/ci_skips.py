"""A pytest plugin (loaded by tests/conftest.py): under CI=true, a test that skips because a
component the test set-up installs is missing fails instead.

scripts/test.sh installs Redis, libibverbs, promtool and the test extra, and such a test's skip
reason ends with ``support.INSTALLED_BY_TEST_SETUP``. On CI the component was installed, so the
skip means the installation broke, and a green run would hide that. Skips for what CI has no
way to provide (a CUDA device, CuPy) carry no such reason and stay skips.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest

from support import INSTALLED_BY_TEST_SETUP


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    report = yield
    if report.skipped and os.environ.get("CI") == "true" and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2])
        if INSTALLED_BY_TEST_SETUP in reason:
            report.outcome = "failed"
            report.longrepr = f"CI=true, and this test would skip: {reason}"
    return report
