"""How a test or benchmark says it skipped for want of a component."""

from __future__ import annotations

from typing import Final

#: Ends the skip reason of every test that skips for a component scripts/test.sh installs
#: (Redis, Mooncake's libibverbs, promtool, the test extra's packages). Under CI=true such a
#: skip is a failure (tests/ci_skips.py): CI installed the component, so a skip means it broke.
INSTALLED_BY_TEST_SETUP: Final = "scripts/test.sh installs it"
