"""The daemon's file descriptors: its limit, how many are open, and what is kept in reserve.

Every engine connection, metrics connection, record read or write and shared-memory segment
takes a descriptor. With the usual soft limit of 1,024, 1,100 idle connections to the metrics
port took them all: a new engine got no reply and a persisted write failed with ``io_error``.
So the daemon raises its soft limit to the hard limit at start-up, its metrics server stops
accepting before the last ``RESERVE`` descriptors, and ``kvswap_open_fds`` /
``kvswap_fd_limit`` say how close it is.
"""

from __future__ import annotations

import logging
import os
import resource
import time

log = logging.getLogger(__name__)

#: Descriptors kept for the daemon's own files (record reads and writes on every I/O thread,
#: the index and lock files, shared-memory segments, ZMQ's own pipes): connections to the
#: metrics port are refused while fewer than this many are free.
RESERVE = 128
#: Where the soft limit goes when the hard limit is "unlimited" (the kernel's nr_open bounds
#: it anyway; 2**20 is its usual value).
UNLIMITED_TARGET = 1 << 20


def raise_soft_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, target, exc)
    return soft_limit()


def soft_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return UNLIMITED_TARGET if soft == resource.RLIM_INFINITY else soft


def open_count() -> int:
    """Descriptors this process has open (-1 where /proc is not there)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir itself holds
    except OSError:
        return -1


class FdBudget:
    """Whether a new connection may take a descriptor: it may while more than ``reserve`` stay
    free. The count is re-read at most every ``interval_s`` (listing /proc/self/fd costs about
    0.3 ms per thousand descriptors, and a flood of connections must not make it the cost)."""

    def __init__(self, reserve: int = RESERVE, interval_s: float = 0.2) -> None:
        self.reserve = reserve
        self.interval_s = interval_s
        self._checked = float("-inf")
        self._open = 0

    def room(self) -> bool:
        now = time.monotonic()
        if now - self._checked >= self.interval_s:
            self._open, self._checked = open_count(), now
        else:
            self._open += 1  # each admitted connection between two counts takes one
        return self._open < 0 or soft_limit() - self._open > self.reserve
