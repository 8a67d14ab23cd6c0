"""CURVE on the control socket: encryption plus client authentication by public key.

The daemon holds a secret key (a ZMQ certificate file, ``kvswap keygen``); engines connect
with their own keypair and the daemon's public key. A client whose public key is not in the
authorized-keys directory fails the handshake: ZMQ drops it before any frame reaches the
daemon, so it gets no reply at all (its request times out, or fails at once as unreachable).

The directory is re-read whenever it changes (its listing, or any ``*.key`` file's inode,
size or modification time), checked at each handshake, so adding, editing or removing a
``*.key`` file takes effect for the next connection without a restart. Connections already
authenticated stay up until they close.

A reload fails closed: the admitted set is exactly the keys that parse in the files present
now. A file that cannot be read or parsed (a half-written new key) admits nobody and is
reported; a directory that cannot be listed admits nobody until it can. So a deleted key is
never admitted again, whatever else is wrong in the directory. (It used to be that one bad
file abandoned the reload and kept the old set, deleted keys included.)

Nothing the key check raises leaves the ZAP handler (:class:`KvswapAuthenticator`): a bug or
a file the loader did not foresee denies that one handshake, is logged and counted in
``kvswap_auth_errors_total``, and the authenticator answers the next. (A key file whose z85
decoded past 2^32 - 1 raised ``struct.error`` out of the callback; it killed pyzmq's
authenticator task, so no handshake was answered again, and at start-up it hung the daemon.)
"""

from __future__ import annotations

import logging
import os
import stat
import struct
import time
from typing import Any

import zmq
import zmq.auth
import zmq.utils.z85
from zmq.auth.asyncio import AsyncioAuthenticator
from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger("kvswap.daemon.curve")

#: Denied handshakes are logged at most this often (a hostile peer can retry in a loop).
DENIED_LOG_INTERVAL_S = 10.0


class CurveError(Exception):
    """The CURVE settings cannot work; the message is for the operator."""


def load_secret_key(path: str) -> tuple[bytes, bytes]:
    """The (public, secret) keys of a ZMQ certificate file that holds a secret key; both are
    checked to be 40 z85 characters that decode (libzmq refuses others only at setsockopt)."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveError(f"cannot read the CURVE secret key file {path}: {exc}") from None
    if not secret:
        raise CurveError(f"{path} holds no secret key: pass the .key_secret file of kvswap keygen")
    for name, key in (("public", public), ("secret", secret)):
        problem = z85_key_problem(key)
        if problem:
            raise CurveError(f"the CURVE secret key file {path} is malformed: its {name} key {problem}")
    return public, secret


def z85_key_problem(key: bytes) -> str:
    """Why ``key`` is not the z85 text of a Curve25519 key ("" if it is)."""
    if len(key) != Z85_KEY_CHARS:
        return f"is {len(key)} characters, not {Z85_KEY_CHARS}"
    try:
        zmq.utils.z85.decode(key)
    except (ValueError, KeyError, IndexError, TypeError, struct.error):
        # struct.error: a group of five characters that decodes past 2^32 - 1.
        return "is not z85"
    return ""


def load_public_key(path: str) -> bytes:
    """The public key of a ZMQ certificate file (public or secret)."""
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveError(f"cannot read the CURVE key file {path}: {exc}") from None
    return public


#: A key file is a few hundred bytes; a larger one is not a key file.
MAX_KEY_FILE_BYTES = 64 * 1024
#: The z85 text of a Curve25519 public key.
Z85_KEY_CHARS = 40

Signature = tuple[tuple[str, int, int, int], ...]


class AuthorizedKeys:
    """The set of client public keys in a directory: a ZAP credentials provider."""

    def __init__(self, directory: str, denied: Counter, files: Gauge | None = None) -> None:
        self.directory = directory
        self.denied = denied
        #: kvswap_auth_key_files{state=loaded|unreadable}, when a registry is given.
        self.files = files
        self._keys: frozenset[bytes] = frozenset()
        self._signature: Signature | None = None
        self._last_denied_log = 0.0
        self._suppressed = 0

    def _key_files(self) -> Signature:
        """(name, inode, size, mtime) of every ``*.key`` file, sorted; raises ``OSError``.
        Symlinks are followed: Kubernetes mounts secrets as links into a ``..data`` directory."""
        out = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.name.endswith(".key") and not entry.name.startswith("."):
                    try:
                        st = entry.stat()
                    except OSError:  # vanished, or a dangling link: listed as unreadable
                        out.append((entry.name, -1, -1, -1))
                        continue
                    out.append((entry.name, st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(sorted(out))

    def load(self) -> int:
        """Read the directory now: admit exactly the keys that parse. Raises
        :class:`CurveError` when the directory cannot be listed (then nobody is admitted)."""
        try:
            signature = self._key_files()
        except OSError as exc:
            self._keys, self._signature = frozenset(), None
            raise CurveError(f"cannot read the authorized keys directory {self.directory}: {exc}") from None
        keys, unreadable = set(), 0
        for name, *_ in signature:
            path = os.path.join(self.directory, name)
            try:
                keys.add(read_public_key(path))
            except (OSError, ValueError) as exc:
                unreadable += 1
                log.warning("authorized key file %s is not admitted: %s", path, exc)
            except Exception as exc:  # a file the loader did not foresee: that file only admits nobody
                unreadable += 1
                log.error("authorized key file %s is not admitted: the key loader failed on it: %s: %s", path,
                          type(exc).__name__, exc)
        self._keys, self._signature = frozenset(keys), signature
        if self.files is not None:
            self.files.labels(state="loaded").set(len(keys))
            self.files.labels(state="unreadable").set(unreadable)
        return len(keys)

    def _refresh(self) -> None:
        try:
            changed = self._key_files() != self._signature
        except OSError:
            changed = True  # load() reports it and admits nobody
        if not changed:
            return
        try:
            count = self.load()
            log.info("authorized keys reloaded from %s: %d client keys", self.directory, count)
        except CurveError as exc:
            # Fail closed: a directory we cannot read admits nobody (existing connections stay).
            log.error("%s; refusing every new client until it can be read", exc)

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


def read_public_key(path: str) -> bytes:
    """The z85 public key of one ZMQ certificate file. Raises ``ValueError`` for a file that
    holds none (or a malformed one) and ``OSError`` for one that cannot be read; never blocks
    on a FIFO and never reads more than MAX_KEY_FILE_BYTES."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        data = os.read(fd, MAX_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ValueError(f"over {MAX_KEY_FILE_BYTES} bytes: not a key file")
    for line in data.splitlines():
        line = line.strip()
        if line.startswith(b"public-key"):
            key = line.split(b"=", 1)[1].strip(b" \t'\"") if b"=" in line else b""
            problem = z85_key_problem(key)
            if problem:
                raise ValueError(f"its public key {problem}")
            return key
    raise ValueError("no public key in it")


class KvswapAuthenticator(AsyncioAuthenticator):
    """pyzmq's asyncio authenticator with a boundary around each ZAP request: an exception
    from the credentials provider (or anywhere in the handling of one request) denies that
    handshake with status 500, is logged and counted, and the authenticator goes on to the
    next. pyzmq lets it escape, which ends the authenticator's task: every later handshake
    then waits forever, authorized clients included."""

    def __init__(self, context: zmq.Context, errors: Counter | None = None, gate: Any = None) -> None:
        super().__init__(context, log=logging.getLogger("kvswap.daemon.zap"))
        self.errors = errors
        #: The connection cap (daemon/connections.py): its ``admit()`` is asked once for each
        #: handshake this handler would admit, and a False turns the answer into 400.
        self.gate = gate

    def _send_zap_reply(self, request_id: bytes, status_code: bytes, status_text: bytes,
                        user_id: str = "anonymous") -> None:
        if status_code == b"200" and self.gate is not None and not self.gate.admit():
            status_code, status_text = b"400", b"Too many connections"
        super()._send_zap_reply(request_id, status_code, status_text, user_id)

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        try:
            await super().handle_zap_message(msg)
        except Exception as exc:
            if self.errors is not None:
                self.errors.inc()
            log.error("refused a CURVE handshake: the key check failed: %s: %s", type(exc).__name__, exc)
            if len(msg) >= 2:
                try:
                    super()._send_zap_reply(msg[1], b"500", b"Internal error")
                except zmq.ZMQError as send_exc:  # the ZAP socket is closing: nothing to answer
                    log.warning("cannot answer the ZAP request: %s", send_exc)


class CurveServer:
    """Turns CURVE on for one server socket. ``prepare`` before binding; ``close`` at shutdown."""

    def __init__(self, secret_key_file: str, authorized_keys: str, registry: CollectorRegistry) -> None:
        self.secret_key_file = secret_key_file
        self.denied = Counter("kvswap_auth_denied", "CURVE handshakes refused: the client's key is not authorized.",
                              registry=registry)
        files = Gauge("kvswap_auth_key_files", "Files in the authorized-keys directory at the last reload: loaded "
                      "(admitted) or unreadable (admit nobody).", ["state"], registry=registry)
        self.errors = Counter("kvswap_auth_errors", "CURVE handshakes refused because the key check itself failed "
                              "(a bug, or a key file the loader did not foresee); logged.", registry=registry)
        self.keys = AuthorizedKeys(authorized_keys, self.denied, files)
        self.public_key = b""
        self._auth: AsyncioAuthenticator | None = None

    def prepare(self, ctx: zmq.Context, sock: zmq.Socket, gate: Any = None) -> None:
        """Load the keys, start the authenticator on the running loop, set the socket options.
        ``gate``: the connection cap the authenticator also enforces. Raises :class:`CurveError`."""
        try:
            self._prepare(ctx, sock, gate)
        except CurveError:
            raise
        except Exception as exc:  # whatever else goes wrong here fails start-up with its reason
            self.close()
            raise CurveError(f"CURVE cannot be set up: {type(exc).__name__}: {exc}") from None

    def _prepare(self, ctx: zmq.Context, sock: zmq.Socket, gate: Any) -> None:
        public, secret = load_secret_key(self.secret_key_file)
        mode = stat.S_IMODE(os.stat(self.secret_key_file).st_mode)
        if mode & 0o077:
            log.warning("the CURVE secret key file %s is readable by others (mode %04o); chmod 600 it",
                        self.secret_key_file, mode)
        count = self.keys.load()
        if count == 0:
            log.warning("no client keys in %s: every client will be refused until one is added", self.keys.directory)
        self._auth = KvswapAuthenticator(ctx, self.errors, gate)
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
