"""Waiting for a condition, by polling, up to a timeout."""

from __future__ import annotations

import time
from typing import Callable


def wait_until(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Poll ``predicate`` every ``interval`` seconds until it is true or ``timeout`` passes;
    whether it held (asked once more at the end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
