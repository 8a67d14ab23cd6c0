"""CURVE revocation fails closed: a key deleted from the authorized directory is refused at the
next handshake even while a broken key file (a half-written new key) sits beside it; and one
malformed key file refuses only itself, never every client (issue 22). A real CURVE daemon
subprocess, real keys; the signals asserted on are the daemon's refusal counter, its key-file
gauge and its log lines."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter
from support import DaemonProcess, free_port, wait_until

from kvswap.daemon.curve import AuthorizedKeys, read_public_key
from kvswap.daemon.tools.keygen import write_keypair
from kvswap.protocol import Client, Timeout, Unavailable


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    made = tmp_path / "made"
    for name in ("kvswapd", "alice", "bob"):
        write_keypair(str(made), name)
    authorized = tmp_path / "authorized"
    authorized.mkdir(mode=0o700)
    for name in ("alice", "bob"):
        shutil.copy(made / f"{name}.key", authorized / f"{name}.key")
    return {"made": made, "authorized": authorized}


def options(keys: dict[str, Path], who: str) -> dict[str, str]:
    return {"curve_secret_key_file": str(keys["made"] / f"{who}.key_secret"),
            "curve_server_key_file": str(keys["made"] / "kvswapd.key")}


def answers(endpoint: str, **client_options: str) -> bool:
    with Client(endpoint, timeout=1, **client_options) as c:
        try:
            c.ping()
            return True
        except (Unavailable, Timeout):
            return False


def test_a_deleted_key_is_refused_while_a_broken_key_file_sits_beside_it(tmp_path: Path, keys) -> None:
    d = DaemonProcess(tmp_path / "store", free_port(), free_port(),
                      extra_args=["--curve-secret-key-file", str(keys["made"] / "kvswapd.key_secret"),
                                  "--authorized-keys", str(keys["authorized"])],
                      client_options=options(keys, "alice")).start()
    try:
        assert answers(d.endpoint, **options(keys, "alice"))
        assert d.metric("kvswap_auth_key_files", state="loaded") == 2
        # At once: alice is revoked and a new key file arrives half-written.
        (keys["authorized"] / "carol.key").write_text("#   ****  Generated on 2026-12-01 by pyzmq  ****\n")
        os.unlink(keys["authorized"] / "alice.key")
        assert not answers(d.endpoint, **options(keys, "alice"))
        assert wait_until(lambda: d.metric("kvswap_auth_denied_total") >= 1), "the daemon never refused alice"
        assert answers(d.endpoint, **options(keys, "bob"))  # the keys that parse still admit
        assert d.metric("kvswap_auth_key_files", state="loaded") == 1
        assert d.metric("kvswap_auth_key_files", state="unreadable") == 1
        log = d.log()
        assert f"authorized key file {keys['authorized'] / 'carol.key'} is not admitted" in log
        assert "refused a CURVE client whose public key" in log
    finally:
        assert d.stop() == 0, d.log()


def test_an_unreadable_directory_admits_nobody(tmp_path: Path, keys) -> None:
    registry = CollectorRegistry()
    denied = Counter("denied", "", registry=registry)
    authorized = AuthorizedKeys(str(keys["authorized"]), denied)
    assert authorized.load() == 2
    bob = read_public_key(str(keys["authorized"] / "bob.key"))
    assert authorized.callback("*", bob) is True
    moved = tmp_path / "elsewhere"
    os.rename(keys["authorized"], moved)  # a config push that swaps the directory
    assert authorized.callback("*", bob) is False
    assert registry.get_sample_value("denied_total") == 1
    os.rename(moved, keys["authorized"])
    assert authorized.callback("*", bob) is True  # readable again: reloaded


@pytest.mark.parametrize("content,reason", [
    (b"", "no public key"),
    (b'public-key = "short"\n', "not 40"),
    (b"x" * (64 * 1024 + 1), "not a key file"),
])
def test_read_public_key_refuses_what_is_not_a_key(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "bad.key"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=reason):
        read_public_key(str(path))


def test_read_public_key_does_not_block_on_a_fifo(tmp_path: Path) -> None:
    path = tmp_path / "fifo.key"
    os.mkfifo(path)
    with pytest.raises(ValueError, match="not a regular file"):
        read_public_key(str(path))


# -- one malformed key file must not lock everyone out (issue 22, finding 3) ---------------------

#: 40 valid z85 characters whose last group ("#####", 85^5 - 1) decodes past 2^32 - 1: the
#: z85 decoder raised struct.error, which escaped the loader and killed pyzmq's authenticator.
OVERFLOWING_KEY = b'public-key = "' + b"0" * 35 + b'#####"\n'


def curve_args(keys: dict[str, Path], secret: Path | None = None) -> list[str]:
    return ["--curve-secret-key-file", str(secret or keys["made"] / "kvswapd.key_secret"),
            "--authorized-keys", str(keys["authorized"])]


def test_a_key_file_decoding_past_32_bits_is_refused_alone_and_handshakes_go_on(tmp_path: Path, keys) -> None:
    d = DaemonProcess(tmp_path / "store", free_port(), free_port(), extra_args=curve_args(keys),
                      client_options=options(keys, "alice")).start()
    try:
        assert answers(d.endpoint, **options(keys, "bob"))
        bad = keys["authorized"] / "mallory.key"
        bad.write_bytes(OVERFLOWING_KEY)
        # The next handshakes reload the directory: the bad file is refused, the others admit.
        assert answers(d.endpoint, **options(keys, "alice"))
        assert answers(d.endpoint, **options(keys, "bob"))
        assert d.metric("kvswap_auth_key_files", state="unreadable") == 1
        assert d.metric("kvswap_auth_key_files", state="loaded") == 2
        os.unlink(bad)
        assert answers(d.endpoint, **options(keys, "alice"))
        assert d.metric("kvswap_auth_key_files", state="unreadable") == 0
        log = d.log()
        assert f"authorized key file {bad} is not admitted: its public key is not z85" in log
        assert "Traceback" not in log
    finally:
        assert d.stop() == 0, d.log()


def test_a_key_file_decoding_past_32_bits_at_start_up_does_not_hang_it(tmp_path: Path, keys) -> None:
    (keys["authorized"] / "mallory.key").write_bytes(OVERFLOWING_KEY)
    d = DaemonProcess(tmp_path / "store", free_port(), free_port(), extra_args=curve_args(keys),
                      client_options=options(keys, "alice"))
    d.start()  # used to hang in start-up until the test's 20 s ran out
    try:
        assert answers(d.endpoint, **options(keys, "bob"))
        assert d.metric("kvswap_auth_key_files", state="unreadable") == 1
        assert "is not admitted: its public key is not z85" in d.log()
    finally:
        assert d.stop() == 0, d.log()


def test_a_malformed_secret_key_file_fails_start_up_with_exit_3(tmp_path: Path, keys) -> None:
    secret = tmp_path / "bad.key_secret"
    secret.write_bytes(b'public-key = "' + b"0" * 40 + b'"\nsecret-key = "' + b"0" * 35 + b'#####"\n')
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "kvswap.daemon", "--cache-queue-port", str(free_port()),
                             "--metrics-port", str(free_port()), "--storage-dir", str(tmp_path / "s"),
                             *curve_args(keys, secret)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 3, result.stderr
    assert f"{secret}" in result.stderr and "start-up failed" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 20


class _Exploding:
    """A credentials provider with a bug: it raises for one client's key, admits the rest."""

    def __init__(self, bad_key: bytes) -> None:
        self.bad_key = bad_key

    def callback(self, domain: str, client_key: bytes) -> bool:
        if client_key == self.bad_key:
            raise RuntimeError("a bug in the key loader")
        return True


def test_an_exception_in_the_key_check_denies_that_handshake_and_the_authenticator_lives_on() -> None:
    """The ZAP boundary: whatever the credentials provider raises is a denial, logged and
    counted, and the next handshake is answered (a real authenticator, real CURVE sockets)."""
    import asyncio

    import zmq
    import zmq.asyncio
    from zmq.utils.monitor import parse_monitor_message

    from kvswap.daemon.curve import KvswapAuthenticator

    server_public, server_secret = zmq.curve_keypair()
    bad_public, bad_secret = zmq.curve_keypair()
    good_public, good_secret = zmq.curve_keypair()
    registry = CollectorRegistry()
    errors = Counter("auth_errors", "", registry=registry)

    async def main() -> tuple[int, bytes | None]:
        ctx = zmq.asyncio.Context()
        auth = KvswapAuthenticator(ctx, errors)
        auth.start()
        auth.configure_curve_callback(domain="*", credentials_provider=_Exploding(bad_public))
        server = ctx.socket(zmq.ROUTER)
        server.curve_secretkey, server.curve_publickey, server.curve_server = server_secret, server_public, True
        port = server.bind_to_random_port("tcp://127.0.0.1")
        sockets = []

        def client(public: bytes, secret: bytes) -> zmq.asyncio.Socket:
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = secret, public, server_public
            sockets.append(sock)
            return sock

        try:
            bad = client(bad_public, bad_secret)
            monitor = bad.get_monitor_socket()
            sockets.append(monitor)
            bad.connect(f"tcp://127.0.0.1:{port}")
            event = 0
            while event not in (zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
                event = parse_monitor_message(await asyncio.wait_for(monitor.recv_multipart(), 10))["event"]
            good = client(good_public, good_secret)
            good.connect(f"tcp://127.0.0.1:{port}")
            await good.send(b"hello")
            try:
                got: bytes | None = (await asyncio.wait_for(server.recv_multipart(), 10))[-1]
            except asyncio.TimeoutError:
                got = None  # the authenticator died: no handshake is answered any more
        finally:
            for sock in sockets:
                sock.close(0)
            server.close(0)
            auth.stop()
            ctx.term()
        return event, got

    event, got = asyncio.run(main())
    assert event == zmq.EVENT_HANDSHAKE_FAILED_AUTH  # denied, not left hanging
    assert got == b"hello"
    assert registry.get_sample_value("auth_errors_total") >= 1


def test_the_connection_cap_holds_with_curve_too(tmp_path: Path, keys) -> None:
    """Issue 22, finding 6: the cap is enforced by the same ZAP handler that checks keys: an
    authorized key past --max-connections is refused; one closing makes room."""
    d = DaemonProcess(tmp_path / "store", free_port(), free_port(),
                      extra_args=[*curve_args(keys), "--max-connections", "1"],
                      client_options=options(keys, "alice")).start()
    try:
        assert wait_until(lambda: d.metric("kvswap_connections") == 0, 10)
        with Client(d.endpoint, timeout=5, **options(keys, "alice")) as alice:
            assert alice.ping() > 0
            assert d.metric("kvswap_connections") == 1
            assert not answers(d.endpoint, **options(keys, "bob"))  # authorized, but the cap is reached
            assert d.metric("kvswap_connections_refused_total") >= 1
            assert d.metric("kvswap_auth_denied_total") == 0  # not counted as a bad key
        assert wait_until(lambda: d.metric("kvswap_connections") == 0, 10)
        assert answers(d.endpoint, **options(keys, "bob"))
        assert "refused a connection to the control socket: 1 are open" in d.log()
    finally:
        assert d.stop() == 0, d.log()
