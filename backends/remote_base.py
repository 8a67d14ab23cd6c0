"""What the Redis and Mooncake adapters share: the key mapping, the health gate and the
store base class. Neither adapter imports the other, and nothing here imports an adapter, so
the remote modules form no import loop (``remote`` picks the adapter; ``remote_url`` parses).

:class:`HealthGate` is the one piece of health logic both adapters share: a failure to reach the
store marks the tier unhealthy; while unhealthy every operation fails at once with
``Unavailable`` (no caller waits out a timeout), and one caller at a time re-probes the store
once the backoff (exponential, capped) has passed.

Records in a remote store are the same bytes as a record file (header + payload, see
:mod:`.record`) under the key ``kvswap/<namespace>/<key>``; a reader verifies them like a file.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Final

from kvswap.protocol.errors import Corrupt, KvswapError, Unavailable

from . import record
from .base import Store

log = logging.getLogger(__name__)

#: Every remote key starts with this, then the namespace fingerprint and "/".
KEY_ROOT: Final = "kvswap"


def remote_key(namespace: str, key: str) -> str:
    """``kvswap/<namespace>/<key>``. The namespace is a fixed-length hex fingerprint, so no key
    of one namespace can spell a key of another."""
    return f"{KEY_ROOT}/{namespace}/{key}"



# -- health -----------------------------------------------------------------------------------


#: How long an operation waits, at most per wake-up, for a probe another thread is running.
PROBE_WAIT_S = 1.0
#: Failed probes log at WARNING at most this often per tier (the rest at DEBUG, counted in the
#: next warning): an outage of an hour probed every 30 s is a few dozen lines, not thousands.
PROBE_WARN_EVERY_S: Final = 60.0


class HealthGate:
    """Whether a remote store is reachable, and when to try it again.

    Adapters wrap every operation: ``admit()`` before it, ``failed(exc)`` when it could not
    reach the store. The first failure marks the tier unhealthy; from then on ``admit()``
    raises ``Unavailable`` at once, except for one caller per backoff period, who runs the
    probe (reconnect + cheap request). A probe that succeeds makes the tier healthy again; one
    that fails doubles the backoff, up to ``backoff_max_s``.

    Before its first successful probe the tier has never been reached: ``healthy`` is False and
    the first operation probes (connects) at once; operations arriving meanwhile wait for that
    first connect instead of failing.
    """

    def __init__(self, name: str, reach: Callable[[], None], *, backoff_initial_s: float = 0.5,
                 backoff_max_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        if backoff_initial_s <= 0 or backoff_max_s < backoff_initial_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")
        self.name = name
        # Connects if needed and sends one cheap request; raises when the store cannot answer.
        self._reach = reach
        self._clock = clock
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        # A condition, so operations that arrive while a probe runs wait for its outcome
        # instead of failing as if the store were down.
        self._lock = threading.Condition()
        self._healthy = False
        self._ever_connected = False
        self._probing = False
        # Consecutive failures (operations and probes) since the store last answered.
        self._streak = 0
        self._next_probe_at = float("-inf")
        #: Operations and probes that could not reach the store.
        self.failures = 0
        #: Times the tier came back after being unhealthy (the first connection is not one).
        self.reconnects = 0
        #: Probes run (connects and re-probes).
        self.probes = 0
        #: The last failure, for logs and status.
        self.last_error = ""
        self._last_warned = float("-inf")
        self._unwarned = 0

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def retry_in_s(self) -> float:
        """Seconds until the next probe is allowed (0 when healthy or due)."""
        with self._lock:
            return 0.0 if self._healthy else max(0.0, self._next_probe_at - self._clock())

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"healthy": self._healthy, "failures": self.failures, "reconnects": self.reconnects,
                    "probes": self.probes, "last_error": self.last_error}

    def admit(self) -> None:
        """Return if the store may be called now; raise ``Unavailable`` if it is known to be
        unreachable. Runs the probe when one is due (only in one thread at a time)."""
        if self._healthy:
            return
        with self._lock:
            # The very first connect: wait for it rather than fail as if the store were down.
            # Once the store has been reached, a re-probe after an outage does not hold
            # callers up: they fail fast until it succeeds.
            while self._probing and not self._ever_connected:
                self._lock.wait(PROBE_WAIT_S)
            if self._healthy:
                return
            if self._probing:
                raise self._unavailable(max(0.0, self._next_probe_at - self._clock()))
            now = self._clock()
            if now < self._next_probe_at:
                raise self._unavailable(max(0.0, self._next_probe_at - now))
            self._probing = True
        self._run_probe()

    def probe(self) -> bool:
        """Probe now if the tier is healthy (to notice an outage before an operation does) or a
        re-probe is due; return ``healthy``. For a periodic health loop; blocks at most the
        store's connect/request timeouts."""
        with self._lock:
            if self._probing or (not self._healthy and self._clock() < self._next_probe_at):
                return self._healthy
            self._probing = True
        try:
            self._run_probe()
        except Unavailable:
            pass
        return self._healthy

    def failed(self, exc: BaseException | str) -> Unavailable:
        """Record that an operation could not reach the store; return the error to raise."""
        message = _describe(exc)
        with self._lock:
            self.failures += 1
            self.last_error = message
            if self._healthy:
                self._healthy = False
                self._streak = 1
                self._next_probe_at = self._clock() + self.backoff_initial_s
                log.warning("remote tier %s is unreachable (%s); retrying in %.1fs", self.name, message,
                            self.backoff_initial_s)
            return self._unavailable(max(0.0, self._next_probe_at - self._clock()))

    def _run_probe(self) -> None:
        try:
            self._reach()
        except BaseException as exc:
            message = _describe(exc)
            with self._lock:
                self._probing = False
                self._lock.notify_all()
                self.probes += 1
                self.failures += 1
                self.last_error = message
                self._healthy = False
                # Each consecutive failure doubles the wait, up to the cap.
                self._streak += 1
                wait = self._wait_after(self._streak)
                self._next_probe_at = self._clock() + wait
                error = self._unavailable(wait)
                now = self._clock()
                warn = now - self._last_warned >= PROBE_WARN_EVERY_S
                if warn:
                    self._last_warned, quiet, self._unwarned = now, self._unwarned, 0
                else:
                    self._unwarned += 1
            if warn:
                log.warning("remote tier %s probe failed (%s); next try in %.1fs%s", self.name, message, wait,
                            f" ({quiet} more failed probes since the last warning)" if quiet else "")
            else:
                log.debug("remote tier %s probe failed (%s); next try in %.1fs", self.name, message, wait)
            if not isinstance(exc, Exception):
                raise
            raise error from None
        with self._lock:
            self._probing = False
            self._lock.notify_all()
            self.probes += 1
            # A health check of a tier that was healthy is no reconnect (it used to count one,
            # and warn "reachable again", every check).
            recovered = self._ever_connected and not self._healthy
            self._healthy = True
            self._streak = 0
            if recovered:
                self.reconnects += 1
                log.warning("remote tier %s is reachable again", self.name)
            self._ever_connected = True
            self._last_warned, self._unwarned = float("-inf"), 0  # the next outage warns at once

    def _wait_after(self, streak: int) -> float:
        return min(self.backoff_initial_s * 2 ** min(streak - 1, 62), self.backoff_max_s)

    def _unavailable(self, retry_in: float) -> Unavailable:
        return Unavailable(f"remote tier {self.name} is unreachable: {self.last_error or 'not connected yet'}",
                           tier="remote", retry_in_s=round(retry_in, 3))


def _describe(exc: BaseException | str) -> str:
    if isinstance(exc, str):
        return exc
    text = getattr(exc, "message", None) or str(exc)
    details = getattr(exc, "details", None)
    if details:
        text += " (" + ", ".join(f"{k}={v}" for k, v in details.items()) + ")"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# -- what both adapters' stores share ---------------------------------------------------------


class GatedHealth:
    """``healthy``, ``failures`` and ``reconnects`` of an object's ``gate``, as the daemon
    reads them from remote backends and stores alike."""

    gate: HealthGate

    @property
    def healthy(self) -> bool:
        return self.gate.healthy

    @property
    def failures(self) -> int:
        return self.gate.failures

    @property
    def reconnects(self) -> int:
        return self.gate.reconnects


class RemoteStoreBase(GatedHealth, Store):
    """Namespace, key mapping, health view and the usage this process has seen, shared by the
    Redis and Mooncake stores. Adapters implement the raw operations."""

    tier = "remote"

    def __init__(self, gate: HealthGate, namespace: str, record_bytes: int) -> None:
        self.gate = gate
        self.namespace = namespace
        self.namespace_bytes = bytes.fromhex(namespace)
        self.record_bytes = record_bytes
        self.header_len = record.header_len_for(record_bytes)
        self.stored_bytes = self.header_len + record_bytes
        self.prefix = f"{KEY_ROOT}/{namespace}/"
        # Keys this process wrote or found, so usage() answers without scanning a shared
        # store. Other nodes' writes and the store's own eviction are not seen here.
        self._seen: set[str] = set()
        self._seen_lock = threading.Lock()
        #: Records that failed verification (and were removed).
        self.corrupt = 0

    def rkey(self, key: str) -> str:
        return self.prefix + key

    def header_for(self, key: str, payload: memoryview) -> bytes:
        if len(payload) != self.record_bytes:
            raise ValueError(f"payload of {len(payload)} bytes, the namespace stores {self.record_bytes}")
        return record.encode_header(self.namespace_bytes, key, len(payload), record.payload_checksum(payload))

    def usage(self) -> dict[str, int]:
        with self._seen_lock:
            n = len(self._seen)
        return {"records": n, "bytes": n * self.stored_bytes}

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.usage())
        out.update(healthy=self.healthy, failures=self.failures, reconnects=self.reconnects, corrupt=self.corrupt)
        return out

    # The events are told under the lock of what this process has seen, so they come in the
    # order it saw them. The remote store's own evictions and other nodes' deletes are not seen.

    def _remember(self, keys) -> None:
        with self._seen_lock:
            if self.events.enabled:
                keys = [key for key in keys if key not in self._seen]
                self.events.stored(self.tier, self.namespace, keys)
            self._seen.update(keys)

    def _forget(self, keys) -> None:
        with self._seen_lock:
            if self.events.enabled:
                keys = [key for key in keys if key in self._seen]
                self.events.removed(self.tier, self.namespace, keys)
            self._seen.difference_update(keys)

    def _forget_all(self) -> None:
        with self._seen_lock:
            self._seen.clear()
            self.events.cleared(self.tier, self.namespace)

    def _drop_corrupt(self, key: str, exc: Corrupt) -> None:
        """Count and remove a record that failed verification."""
        self.corrupt += 1
        log.warning("corrupt remote record %s: %s; removing it", self.rkey(key), exc.message)
        try:
            self.delete(key)
        except KvswapError as err:  # the status is still "corrupt"; the next reader retries
            log.warning("cannot remove corrupt record %s: %s", self.rkey(key), err.message)
