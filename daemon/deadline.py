"""A request's deadline, and the handshake that keeps its copies from outliving its answer.

The engine reuses its blocks the moment it has an answer. A copy thread that only *checks* the
clock before a batch can still be in the middle of that batch when the loop answers
``timeout``: the bytes it copies after the answer are the engine's next request's, and a record
gathered from them verifies (issue 22: a swap_out answered ``timeout`` stored records holding
76 % bytes written after the answer; a swap_in kept writing into blocks the engine had reset).

So the loop does not answer while a copy runs. Copy threads enter :meth:`Deadline.copying`
around every call that touches engine memory; at the deadline the loop calls
:meth:`Deadline.stop`, which refuses new entries, raises :attr:`Deadline.stop_flag` (read by the
native copy between rows, and by the other copy paths before each row or batch), and waits for
the copies inside to return. Only then is the answer sent: later than the deadline by at most
the piece of a copy in progress (about 0.1 ms for the native helper's 1 MiB pieces; a device
batch on a GPU), and never before the last byte moved::

    loop:   deadline ──stop()──────────────wait──────────────answer "timeout"
    thread:        copying() row 7 ... row 8 (flag seen) ──exit──┘
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from typing import Callable, Iterator

import numpy as np

log = logging.getLogger(__name__)

#: How long an answer waits for copies to stop. A stop takes microseconds (the native helper
#: checks its flag every MiB); only a copy stuck in the kernel or on a device exceeds this, and
#: the shipped clients give up 1 s (GRACE_S) after the deadline anyway, so waiting longer would
#: only turn a late copy into a missing answer. Past it the answer goes out and the late copy is
#: logged and counted (``kvswap_late_copies_total``).
STOP_WAIT_S = 0.5


class Deadline:
    """When a request must be answered, and whether copies for it may still touch engine
    memory. ``live()`` is the cheap check threads make; :meth:`copying` and :meth:`stop` are
    the handshake (see the module doc)."""

    __slots__ = ("at", "stop_flag", "_lock", "_stopped", "_copies", "_idle")

    def __init__(self, timeout_s: float) -> None:
        self.at = time.monotonic() + timeout_s
        #: Non-zero once the request is being answered: the native copy helper reads it between
        #: rows (a uint32 in memory it is handed, so no GIL is needed to see it).
        self.stop_flag = np.zeros(1, dtype=np.uint32)
        self._lock = threading.Lock()
        self._stopped = False
        self._copies = 0
        self._idle: concurrent.futures.Future[None] | None = None

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def live(self) -> bool:
        return not self._stopped and time.monotonic() < self.at

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def waiting(self) -> bool:
        """Whether :meth:`stop` is waiting for a copy to return (the answer is held back)."""
        idle = self._idle
        return idle is not None and not idle.done()

    def expire(self) -> None:
        """Refuse new copies and tell running ones to stop, without waiting for them (tests, and
        callers that wait through :meth:`stop`)."""
        with self._lock:
            self._stopped = True
            self.stop_flag[0] = 1

    @contextlib.contextmanager
    def copying(self) -> Iterator[bool]:
        """Around a copy of engine memory, on the copy's thread: yields whether the copy may
        start. While inside, :meth:`stop` waits for it."""
        with self._lock:
            allowed = self.live()
            if allowed:
                self._copies += 1
        try:
            yield allowed
        finally:
            if allowed:
                with self._lock:
                    self._copies -= 1
                    idle = self._idle if self._copies == 0 else None
                if idle is not None and not idle.done():
                    idle.set_result(None)

    async def stop(self, wait_s: float = STOP_WAIT_S) -> bool:
        """Stop every copy for this request and wait until none runs, up to ``wait_s``. True if
        none runs now; False if one was still running when the wait ended (logged)."""
        with self._lock:
            self._stopped = True
            self.stop_flag[0] = 1
            if self._copies == 0:
                return True
            if self._idle is None:
                self._idle = concurrent.futures.Future()
            idle = self._idle
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(idle)), wait_s)
            return True
        except asyncio.TimeoutError:
            log.error("a copy for a request past its deadline did not stop within %.1f s; answering anyway",
                      wait_s)
            return False


class CopyGuard:
    """What a mover consults during one request's copy: ``guard()`` is whether it may go on
    (the deadline holds and the registration is not being released), and :attr:`stop_flag` the
    flag a native copy reads between rows. Movers also accept a plain ``Callable[[], bool]``
    (tests, benchmarks), which they check before each row or block."""

    __slots__ = ("deadline", "_closing")

    def __init__(self, deadline: Deadline, closing: Callable[[], bool]) -> None:
        self.deadline = deadline
        self._closing = closing

    @property
    def stop_flag(self) -> np.ndarray:
        return self.deadline.stop_flag

    def __call__(self) -> bool:
        return self.deadline.live() and not self._closing()

    @contextlib.contextmanager
    def copying(self) -> Iterator[bool]:
        with self.deadline.copying() as allowed:
            yield allowed and not self._closing()
