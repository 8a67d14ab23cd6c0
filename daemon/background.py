"""Background work with an owner: the tasks and thread jobs one component starts and does not
await where it starts them (an index scan, a health probe, a chain touch, a release in the
background), kept until they end and awaited when the component stops.

The model is trio's nursery (asyncio's ``TaskGroup``), without its rule that one failure
cancels the rest: background work here is independent, so a failure is logged (nobody else
would see it) and the others go on. What ``stop`` does with work still running is the
starter's choice, per piece: work that only waits (a timer loop) is cancelled; work a thread
is in (a copy, a write, a scan) is waited for, since cancelling the asyncio side would not
stop the thread, only hide it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
from typing import Any, Callable, Coroutine, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class Background:
    """The background work of one owner (``name`` says whose in the log)."""

    def __init__(self, name: str) -> None:
        self.name = name
        #: Tasks running, and whether ``stop`` may cancel each.
        self._tasks: dict[asyncio.Task, bool] = {}
        #: Jobs on threads; their done-callbacks run on the thread that ran them, hence the lock.
        self._jobs: set[concurrent.futures.Future] = set()
        self._lock = threading.Lock()

    def spawn(self, coro: Coroutine[Any, Any, T], what: str, cancel_on_stop: bool = False) -> "asyncio.Task[T]":
        """Run ``coro`` as a task of this owner; a failure is logged as ``what``'s.
        ``cancel_on_stop``: only where cancelling it is safe (it waits for no thread)."""
        task = asyncio.ensure_future(coro)
        self._tasks[task] = cancel_on_stop
        task.add_done_callback(functools.partial(self._ended, what))
        return task

    def submit(self, pool: concurrent.futures.Executor, fn: Callable[..., Any], *args: Any,
               what: str = "") -> concurrent.futures.Future:
        """Run ``fn(*args)`` on ``pool``, nobody waiting for its result but ``stop``."""
        job = pool.submit(fn, *args)
        with self._lock:
            self._jobs.add(job)
        job.add_done_callback(functools.partial(self._ended, what or getattr(fn, "__name__", "job")))
        return job

    @property
    def tasks(self) -> list[asyncio.Task]:
        return list(self._tasks)

    @property
    def running(self) -> int:
        """Tasks and jobs not yet ended."""
        with self._lock:
            return len(self._tasks) + len(self._jobs)

    def _ended(self, what: str, fut: "asyncio.Future[Any] | concurrent.futures.Future[Any]") -> None:
        if isinstance(fut, asyncio.Task):
            self._tasks.pop(fut, None)
        else:
            with self._lock:
                self._jobs.discard(fut)
        log_failure(fut, f"{self.name}: {what}")

    async def stop(self) -> None:
        """Cancel what may be cancelled, then wait until everything this owner started has
        ended (work started meanwhile, by work ending, included)."""
        while self.running:
            for task, cancel in list(self._tasks.items()):
                if cancel:
                    task.cancel()
            with self._lock:
                jobs = list(self._jobs)
            waiting: list[asyncio.Future] = [*self._tasks, *(asyncio.wrap_future(job) for job in jobs)]
            await asyncio.wait(waiting)
            # Done-callbacks run on the next loop iteration: let them forget what ended.
            await asyncio.sleep(0)


def log_failure(fut: "asyncio.Future[Any] | concurrent.futures.Future[Any]", what: str = "") -> None:
    """A failure of background work is logged, not lost (nobody awaits its result); ``what``
    (whose work, which) goes in the record's ``work`` field."""
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("background task failed: %s", fut.exception(), extra={"work": what})
