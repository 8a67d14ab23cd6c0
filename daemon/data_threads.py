"""Thread pools for byte movement (copies, record I/O, storage upkeep) that run at a lower
OS scheduling priority than the event loop, so a ping or a lookup never waits behind bytes.

Why priority and not something else (measured with ``benchmarks/loop_latency.py --rounds 3``,
small preset, a swap_out stream at full speed, 2 shared cores; medians of 3 interleaved
rounds, ms):

=================================  ==========  ============
variant                            ping p99    lookup p99
=================================  ==========  ============
before (all threads nice 0)        10.7        15.2
data threads nice 10               4.6         7.1
GIL switch interval 0.5 ms         6.7         10.4
both                               4.9         7.6
=================================  ==========  ============

py-spy (``--gil``) showed the loop thread holding the GIL in 71% of the samples where anyone
held it, and the copy and write threads about 29%: the data threads already release the GIL
for every copy (``ctypes.memmove``) and every read or write system call, so what the loop
waited for was mostly the CPU, which the kernel handed to whichever thread was runnable.
A nice value makes the kernel prefer the loop whenever both want a core; a shorter GIL
switch interval added nothing on top.

The copy thread runs at half the nice value: the engine waits for its copy ("copied"), not
for the writes, and py-spy of one swap_out showed it sharing the cores with the write
threads' checksums and system calls. One 32 x 8 MiB swap_out answered "copied" ran at a
median 1.82 GB/s with the copy thread at nice 5, 0.95 GB/s at nice 10 (3 runs each,
interleaved; ranges 0.84-2.42 and 0.79-1.36 on the shared machine). On Linux ``setpriority`` on a thread id sets that
thread alone; raising a nice value needs no privilege.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
Item = TypeVar("Item")

#: The nice value data threads run at unless configured (0 leaves them at the loop's).
DEFAULT_NICE = 10


def lower_priority(nice: int) -> bool:
    """Run the calling thread ``nice`` below the main thread (Linux: per thread). Relative to
    the main thread, not to the thread's own value: a thread inherits its creator's nice
    value, and pool threads are started by whichever thread submits first (the copy thread
    starts the write threads). False where the platform cannot; the thread then runs at
    whatever priority it inherited."""
    if nice <= 0:
        return True
    try:
        tid = threading.get_native_id()
        base = os.getpriority(os.PRIO_PROCESS, os.getpid())  # the main thread's, on Linux
        os.setpriority(os.PRIO_PROCESS, tid, min(19, base + nice))
        return True
    except (AttributeError, OSError) as exc:
        log.debug("cannot lower the priority of %s: %s", threading.current_thread().name, exc)
        return False


def data_pool(workers: int, name: str, nice: int) -> ThreadPoolExecutor:
    """A pool whose threads lower their own priority by ``nice`` when they start."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=lower_priority, initargs=(nice,))


class DataThreads:
    """Every thread pool of one daemon, made once (by the swapper) and handed to the parts that
    use them. Making a pool starts no thread: each starts on its pool's first job.

    Each kind of work has its own pool, so a slow one never holds up another: a directory scan
    can take seconds, a remote probe can block for a connect timeout, and neither may delay
    eviction or the swap pipeline. The pools that move or scan bytes run below the loop's
    priority (``nice``; see the module doc); the copy pool at half of it."""

    def __init__(self, write_threads: int = 1, read_threads: int = 1, nice: int = 0) -> None:
        self.write = data_pool(write_threads, "kvswap-write", nice)
        self.read = data_pool(read_threads, "kvswap-read", nice)
        # Gathers and scatters are memory copies; one thread keeps them ordered and off the loop.
        # The engine waits for the copy ("copied"), not for the writes: it runs between the
        # loop and the I/O threads (py-spy of one swap_out: the copy thread shared the cores
        # with the write threads' checksums and system calls).
        self.copy = data_pool(1, "kvswap-copy", nice // 2)
        # Mapping an engine's memory, opening stores and making staging take time; they run
        # here, one registration at a time, never on the loop or the copy thread.
        self.register = ThreadPoolExecutor(1, thread_name_prefix="kvswap-register")
        #: Index scans and eviction, which can take seconds on big directories.
        self.maintain = data_pool(1, "kvswap-maintain", nice)
        #: Remote health probes, which can block for a connect timeout.
        self.health = ThreadPoolExecutor(1, thread_name_prefix="kvswap-health")
        #: Whether the registered engine's process is alive.
        self.liveness = ThreadPoolExecutor(1, thread_name_prefix="kvswap-liveness")
        #: Faulting in the host arena's RAM-tier share as it fills.
        self.fault = data_pool(1, "kvswap-fault", nice)

    @property
    def pools(self) -> list[ThreadPoolExecutor]:
        return [self.copy, self.read, self.write, self.register, self.maintain, self.health, self.liveness,
                self.fault]

    def shutdown(self) -> None:
        """Wait for every job submitted, then end the threads (the owners have awaited their
        work already; this ends the idle threads)."""
        for pool in self.pools:
            pool.shutdown(wait=True, cancel_futures=False)


async def run(pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on one of ``pool``'s threads, awaited on the loop."""
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))


def spread(pool: ThreadPoolExecutor, fn: Callable[[Item], T], items: Sequence[Item]) -> "Future[list[T]]":
    """``fn(item)`` for each item, each on a job of its own in ``pool``, so idle threads share
    one batch's work instead of one thread taking all of it; one future of the results in item
    order, resolved by the job that ends last (one wake-up of whoever waits, not one per item).

    It resolves only once every job has ended, also when some raised: the first exception is
    then its exception. Never raises itself: an item that cannot be submitted (the pool is shut
    down) fails with that error, and the future still waits for the jobs submitted before it,
    so a caller never frees what a running job still reads.

    Why (issue 27): a ``wait="persisted"`` swap_out of 32 records of 2 MiB, written in jobs of
    4 records, left each write thread idle 45% of the time (py-spy): a thread started only
    once a whole 4-record chunk was gathered, and a request's last records were written one
    after another on one thread. A record a job: 0.59x the raw O_DIRECT write against 0.52x,
    rounds alternated with the raw writes on the same disk (12 rounds of 256 records).
    """
    future: Future[list[T]] = Future()
    if not items:
        future.set_result([])
        return future
    results: list[Any] = [None] * len(items)
    errors: list[BaseException] = []
    lock = threading.Lock()
    left = [len(items)]

    def ended(count: int) -> None:
        with lock:
            left[0] -= count
            last = left[0] == 0
        if last:
            if errors:
                future.set_exception(errors[0])
            else:
                future.set_result(results)

    def job(i: int) -> None:
        try:
            results[i] = fn(items[i])
        except BaseException as exc:  # handed to the waiter once the others have ended
            with lock:
                errors.append(exc)
        ended(1)

    for i in range(len(items)):
        try:
            pool.submit(job, i)
        except BaseException as exc:  # RuntimeError after shutdown: the rest are never run
            with lock:
                errors.append(exc)
            ended(len(items) - i)
            break
    return future
