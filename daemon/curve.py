"""CURVE on the control socket: encryption plus client authentication by public key.

The daemon holds a secret key (a ZMQ certificate file, ``kvswap keygen``); engines connect
with their own keypair and the daemon's public key. A client whose public key is not in the
authorized-keys directory fails the handshake: ZMQ drops it before any frame reaches the
daemon, so it gets no reply at all (its request times out, or fails at once as unreachable).

The directory is re-read whenever its modification time changes, checked at each handshake,
so adding or removing a ``*.key`` file takes effect for the next connection without a restart.
Connections already authenticated stay up until they close.
"""

from __future__ import annotations

import logging
import os
import stat
import time
import zmq
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator
from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger("kvswap.daemon.curve")

#: Denied handshakes are logged at most this often (a hostile peer can retry in a loop).
DENIED_LOG_INTERVAL_S = 10.0


class CurveError(Exception):
    """The CURVE settings cannot work; the message is for the operator."""


def load_secret_key(path: str) -> tuple[bytes, bytes]:
    """The (public, secret) keys of a ZMQ certificate file that holds a secret key."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveError(f"cannot read the CURVE secret key file {path}: {exc}") from None
    if not secret:
        raise CurveError(f"{path} holds no secret key: pass the .key_secret file of kvswap keygen")
    return public, secret


def load_public_key(path: str) -> bytes:
    """The public key of a ZMQ certificate file (public or secret)."""
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveError(f"cannot read the CURVE key file {path}: {exc}") from None
    return public


class AuthorizedKeys:
    """The set of client public keys in a directory: a ZAP credentials provider."""

    def __init__(self, directory: str, denied: Counter) -> None:
        self.directory = directory
        self.denied = denied
        self._keys: frozenset[bytes] = frozenset()
        self._mtime_ns: int | None = None
        self._last_denied_log = 0.0
        self._suppressed = 0

    def load(self) -> int:
        """Read the directory now. Raises :class:`CurveError` when it cannot be read."""
        try:
            mtime = os.stat(self.directory).st_mtime_ns
            certs = zmq.auth.load_certificates(self.directory)
        except (OSError, ValueError) as exc:
            raise CurveError(f"cannot read the authorized keys directory {self.directory}: {exc}") from None
        self._keys = frozenset(k for k, ok in certs.items() if ok)
        self._mtime_ns = mtime
        return len(self._keys)

    def _refresh(self) -> None:
        try:
            if os.stat(self.directory).st_mtime_ns != self._mtime_ns:
                count = self.load()
                log.info("authorized keys reloaded from %s: %d client keys", self.directory, count)
        except (OSError, CurveError) as exc:
            # Keep the keys we have: a directory briefly missing during a config push must not
            # lock every engine out, nor let every client in.
            log.warning("cannot reload authorized keys, keeping the %d loaded: %s", len(self._keys), exc)

    def callback(self, domain: str, client_key: bytes) -> bool:
        """Called by the authenticator for each CURVE handshake with the client's z85 key."""
        self._refresh()
        if client_key in self._keys:
            return True
        self.denied.inc()
        now = time.monotonic()
        if now - self._last_denied_log >= DENIED_LOG_INTERVAL_S:
            more = f" ({self._suppressed} more since the last report)" if self._suppressed else ""
            log.warning("refused a CURVE client whose public key %s is not in %s%s",
                        client_key.decode("ascii", "replace"), self.directory, more)
            self._last_denied_log, self._suppressed = now, 0
        else:
            self._suppressed += 1
        return False


class CurveServer:
    """Turns CURVE on for one server socket. ``prepare`` before binding; ``close`` at shutdown."""

    def __init__(self, secret_key_file: str, authorized_keys: str, registry: CollectorRegistry) -> None:
        self.secret_key_file = secret_key_file
        self.denied = Counter("kvswap_auth_denied", "CURVE handshakes refused: the client's key is not authorized.",
                              registry=registry)
        self.keys = AuthorizedKeys(authorized_keys, self.denied)
        self.public_key = b""
        self._auth: AsyncioAuthenticator | None = None

    def prepare(self, ctx: zmq.Context, sock: zmq.Socket) -> None:
        """Load the keys, start the authenticator on the running loop, set the socket options.
        Raises :class:`CurveError`."""
        public, secret = load_secret_key(self.secret_key_file)
        mode = stat.S_IMODE(os.stat(self.secret_key_file).st_mode)
        if mode & 0o077:
            log.warning("the CURVE secret key file %s is readable by others (mode %04o); chmod 600 it",
                        self.secret_key_file, mode)
        count = self.keys.load()
        if count == 0:
            log.warning("no client keys in %s: every client will be refused until one is added", self.keys.directory)
        self._auth = AsyncioAuthenticator(ctx, log=logging.getLogger("kvswap.daemon.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self.keys)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
        self.public_key = public
        log.info("CURVE is on: the control socket is encrypted and admits the %d client keys in %s "
                 "(server public key %s)", count, self.keys.directory, public.decode("ascii"))

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
