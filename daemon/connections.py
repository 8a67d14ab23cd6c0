"""A cap on the connections of the control socket.

ZMQ holds memory per connection (RCV_HWM frames in, SND_HWM replies out, in daemon/server.py)
and accepts connections on its own thread, so without a cap what the daemon holds grew with
the number of connections. The cap is enforced at the ZMQ handshake, through ZAP: the
daemon runs a ZAP handler whether or not CURVE is on (without CURVE the socket gets a ZAP
domain, so the NULL mechanism asks it too), and a handshake that would otherwise succeed is
refused (ZAP status 400, "Too many connections") while ``max_connections`` are open. ZMQ
closes that connection, and the peer's socket does not retry it (libzmq 4.3 stops after a
handshake refused by ZAP), so its requests time out; a new connection is admitted once an
open one closes. (Status 300, "try again later", would leave a NULL handshake hanging open.)

Open connections are counted from the socket's monitor. ZMQ reports, for every accepted
connection, exactly one handshake outcome (succeeded, or failed: no detail, protocol, auth)
and then, once it ends, one disconnect; so the connections open after a successful handshake
are ``succeeded + failed - disconnected`` (a failed one counts until its disconnect follows,
microseconds later). A connection still in its handshake counts nothing, so raw TCP
connections that never speak ZMTP cannot take the cap from engines. A handshake admitted by
ZAP counts until its success is reported (or for PENDING_S, should it never be). The monitor
is read without blocking whenever the count is needed, and every DRAIN_INTERVAL_S.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from .background import Background
from .curve import KvswapAuthenticator
from .metrics import Metrics

log = logging.getLogger(__name__)

#: The ZAP domain the control socket uses when CURVE is off (so the NULL mechanism asks ZAP).
NULL_ZAP_DOMAIN = b"kvswap"
#: How long a handshake admitted by ZAP counts as open before its success is reported.
PENDING_S = 5.0
#: How often the monitor's events are read when nothing asks for the count.
DRAIN_INTERVAL_S = 0.5
#: Refusals are logged at most this often.
LOG_INTERVAL_S = 10.0
FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
          | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | FAILED | zmq.EVENT_DISCONNECTED


class ConnectionGate:
    """Counts the control socket's open connections and admits a handshake while fewer than
    ``limit`` are open. ``watch`` before the socket binds; ``stop`` before the context ends."""

    def __init__(self, limit: int, metrics: Metrics) -> None:
        self.limit = limit
        self.metrics = metrics
        self._succeeded = self._failed = self._disconnected = 0
        #: When each handshake admitted by ZAP and not yet reported succeeded was admitted.
        self._pending: collections.deque[float] = collections.deque()
        self._monitor: zmq.Socket | None = None
        self._sock: zmq.Socket | None = None
        #: The loop that reads the monitor every DRAIN_INTERVAL_S.
        self._background = Background("connection gate")
        self._auth: KvswapAuthenticator | None = None
        self._last_log = float("-inf")
        self._refused_since_log = 0
        metrics.connections.set_function(lambda: self.open)

    @property
    def open(self) -> int:
        """Connections open after a successful handshake (read from the monitor now)."""
        self._drain()
        return max(0, self._succeeded + self._failed - self._disconnected)

    def watch(self, ctx: zmq.Context, sock: zmq.Socket) -> None:
        """Start counting ``sock``'s connections (call before it binds, on the running loop)."""
        addr = f"inproc://kvswap-connections-{id(self)}"
        sock.monitor(addr, EVENTS)
        monitor = zmq.Socket(ctx, zmq.PAIR)  # a plain socket: read without blocking, never awaited
        monitor.rcvhwm = 0  # no event may be dropped: a lost disconnect would count forever
        monitor.linger = 0
        monitor.connect(addr)
        self._sock, self._monitor = sock, monitor
        self._background.spawn(self._keep_draining(), "reading the connection monitor", cancel_on_stop=True)

    def gate_null_mechanism(self, ctx: zmq.Context, sock: zmq.Socket) -> None:
        """Without CURVE: run a ZAP handler that admits every NULL handshake under the cap."""
        self._auth = KvswapAuthenticator(ctx, gate=self)
        self._auth.start()
        sock.zap_domain = NULL_ZAP_DOMAIN

    def admit(self) -> bool:
        """For the ZAP handler, once per handshake it would admit: False past the cap."""
        now = time.monotonic()
        while self._pending and now - self._pending[0] > PENDING_S:
            self._pending.popleft()
        open_now = self.open
        if open_now + len(self._pending) >= self.limit:
            self.metrics.connections_refused.inc()
            self._refused_since_log += 1
            if now - self._last_log >= LOG_INTERVAL_S:
                log.warning("refused a connection to the control socket: %d are open, the most "
                            "--max-connections allows (%d refused since the last report)", open_now,
                            self._refused_since_log)
                self._last_log, self._refused_since_log = now, 0
            return False
        self._pending.append(now)
        return True

    def _drain(self) -> None:
        """Count every event the monitor has queued."""
        if self._monitor is None:
            return
        while True:
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:  # closing
                return
            try:
                event = parse_monitor_message(frames)["event"]
            except Exception:  # a malformed event (never seen): skip it, keep counting
                log.exception("cannot read a control-socket monitor event")
                continue
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._succeeded += 1
                if self._pending:
                    self._pending.popleft()
            elif event & FAILED:
                self._failed += 1
            elif event == zmq.EVENT_DISCONNECTED:
                self._disconnected += 1

    async def _keep_draining(self) -> None:
        while True:
            await asyncio.sleep(DRAIN_INTERVAL_S)
            self._drain()

    async def stop(self) -> None:
        await self._background.stop()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._sock is not None and not self._sock.closed:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
        if self._monitor is not None:
            self._monitor.close(0)
            self._monitor = None
