"""CURVE on the control socket, ``kvswap keygen``, and the modes of what the daemon writes:
a real kvswapd subprocess, real keys, real sockets."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from kvswap.daemon.tools.keygen import write_keypair
from kvswap.protocol import AsyncClient, CacheLayout, Client, HostKVCache

from disk_records import LAYOUTS, records_on_disk
from support import DaemonProcess, free_port, wait_until


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def keygen(name: str, directory: Path, umask: int = 0o022) -> subprocess.CompletedProcess:
    """``kvswap keygen`` as a subprocess under the given umask (0 = the most permissive)."""
    return subprocess.run([sys.executable, "-m", "kvswap.daemon.tools.admin", "keygen", name, "--dir", str(directory)],
                          capture_output=True, text=True, timeout=30, preexec_fn=lambda: os.umask(umask))


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The daemon's keypair, an authorized engine's, an intruder's, and the authorized-keys
    directory holding the engine's public key only."""
    root = tmp_path_factory.mktemp("keys")
    for name in ("kvswapd", "engine", "intruder"):
        write_keypair(str(root / "made"), name)
    authorized = root / "authorized"
    authorized.mkdir(mode=0o700)
    shutil.copy(root / "made" / "engine.key", authorized / "engine.key")
    return {"dir": root / "made", "authorized": authorized, "server_secret": root / "made" / "kvswapd.key_secret",
            "server_public": root / "made" / "kvswapd.key", "engine": root / "made" / "engine.key_secret",
            "intruder": root / "made" / "intruder.key_secret"}


def engine_options(keys: dict[str, Path], who: str = "engine") -> dict[str, str]:
    return {"curve_secret_key_file": str(keys[who]), "curve_server_key_file": str(keys["server_public"])}


@pytest.fixture
def curve_daemon(tmp_path: Path, keys: dict[str, Path]) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path / "store", free_port(), free_port(),
                      extra_args=["--curve-secret-key-file", str(keys["server_secret"]),
                                  "--authorized-keys", str(keys["authorized"])],
                      client_options=engine_options(keys)).start()
    yield d
    assert d.stop() == 0, d.log()


#: What the client's own ZMQ socket reports when the daemon ends a handshake (the signal a
#: refusal test waits on: a hung daemon would send none of them, and the wait would fail).
HANDSHAKE_EVENTS = {zmq.EVENT_HANDSHAKE_SUCCEEDED: "succeeded", zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed",
                    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed_protocol", zmq.EVENT_HANDSHAKE_FAILED_AUTH: "denied"}


def handshake(endpoint: str, curve_secret_key_file: str | None = None, curve_server_key_file: str | None = None,
              curve_server_key: bytes | None = None, timeout_s: float = 10.0) -> str:
    """Connect a socket with these CURVE settings (none: plain ZMQ) and return how its first
    handshake with the daemon ended: "succeeded", "failed" (the CURVE exchange broke off),
    "failed_protocol" (mechanism mismatch) or "denied" (the daemon's authenticator said no).
    The daemon must answer the handshake one way or the other within ``timeout_s``."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    if curve_secret_key_file is not None:
        public, secret = zmq.auth.load_certificate(curve_secret_key_file)
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = (curve_server_key if curve_server_key is not None
                                else zmq.auth.load_certificate(str(curve_server_key_file))[0])
    monitor = sock.get_monitor_socket()
    try:
        sock.connect(endpoint)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if monitor.poll(int(left * 1000) + 1):
                event = recv_monitor_message(monitor)["event"]
                if event in HANDSHAKE_EVENTS:
                    return HANDSHAKE_EVENTS[event]
        raise AssertionError(f"the daemon neither accepted nor refused a handshake within {timeout_s} s")
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()


def refused(endpoint: str, **options: object) -> bool:
    """True when the daemon ended the handshake of a client with these options with a
    failure (so no request of it can ever reach the daemon)."""
    return handshake(endpoint, **options) != "succeeded"


# -- keygen ------------------------------------------------------------------------------------


def test_keygen_writes_a_private_keypair_even_under_an_open_umask(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    result = keygen("engine0", directory, umask=0)
    assert result.returncode == 0, result.stderr
    public, secret = directory / "engine0.key", directory / "engine0.key_secret"
    assert mode(directory) == 0o700
    assert mode(public) == 0o600 and mode(secret) == 0o600
    assert sorted(os.listdir(directory)) == ["engine0.key", "engine0.key_secret"]  # no staging left behind
    public_key, no_secret = zmq.auth.load_certificate(str(public))
    same_public, secret_key = zmq.auth.load_certificate(str(secret))
    assert no_secret is None and len(secret_key) == 40
    assert public_key == same_public == zmq.curve_public(secret_key)


def test_keygen_never_overwrites_a_key(tmp_path: Path) -> None:
    assert keygen("engine0", tmp_path).returncode == 0
    before = (tmp_path / "engine0.key_secret").read_bytes()
    again = keygen("engine0", tmp_path)
    assert again.returncode == 1
    assert "exists" in again.stderr
    assert (tmp_path / "engine0.key_secret").read_bytes() == before
    bad = keygen("../escape", tmp_path)
    assert bad.returncode == 1 and not (tmp_path.parent / "escape.key").exists()


# -- CURVE on the control socket ----------------------------------------------------------------------


def test_authorized_engine_works_and_others_are_refused(curve_daemon: DaemonProcess, keys: dict[str, Path]) -> None:
    layout = CacheLayout("curve-model", num_layers=2, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=16)
    with HostKVCache.create(layout) as cache, Client(curve_daemon.endpoint, timeout=10, **engine_options(keys)) as c:
        cache.fill_random(seed=3)
        c.register(cache)
        expected = [cache.block_record(b) for b in (0, 1)]
        assert c.swap_out([0, 1], ["c0", "c1"], wait="persisted").stored == 2
        cache.zero_blocks([6, 7])
        assert c.swap_in(["c0", "c1"], [6, 7]).loaded == 2
        assert [cache.block_record(6), cache.block_record(7)] == expected

        # No CURVE at all, an unlisted key, a listed key with the wrong server key: each
        # handshake ends in a failure the client's socket reports; only the unlisted key
        # reaches the daemon's authenticator, which denies it and counts it.
        assert handshake(curve_daemon.endpoint) in ("failed", "failed_protocol")
        denied_before = curve_daemon.metric("kvswap_auth_denied_total")
        assert handshake(curve_daemon.endpoint, **engine_options(keys, "intruder")) == "denied"
        assert wait_until(lambda: curve_daemon.metric("kvswap_auth_denied_total") > denied_before)
        wrong_server = zmq.auth.load_certificate(str(keys["dir"] / "intruder.key"))[0]
        assert handshake(curve_daemon.endpoint, curve_secret_key_file=str(keys["engine"]),
                         curve_server_key=wrong_server) == "failed"
        assert handshake(curve_daemon.endpoint, **engine_options(keys)) == "succeeded"
        # The authorized engine is unaffected, and its records are intact.
        assert c.lookup(["c0", "c1"]) == 2
    assert curve_daemon.metric("kvswap_auth_denied_total") >= 1
    assert curve_daemon.alive
    log = curve_daemon.log()
    assert "CURVE is on" in log and "refused a CURVE client" in log
    assert "without authentication" not in log


def test_a_hung_daemon_is_not_taken_for_a_refusal(curve_daemon: DaemonProcess, keys: dict[str, Path]) -> None:
    """The refusal checks above wait for the daemon to end the handshake; a stopped daemon
    (the kernel still accepts the TCP connection) ends none, and the check says so."""
    assert curve_daemon.proc is not None
    curve_daemon.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(AssertionError, match="neither accepted nor refused"):
            handshake(curve_daemon.endpoint, **engine_options(keys, "intruder"), timeout_s=1.0)
    finally:
        curve_daemon.proc.send_signal(signal.SIGCONT)
    assert handshake(curve_daemon.endpoint, **engine_options(keys, "intruder")) == "denied"


def test_the_async_client_speaks_curve_too(curve_daemon: DaemonProcess, keys: dict[str, Path]) -> None:
    async def main() -> list[float]:
        async with AsyncClient(curve_daemon.endpoint, timeout=5, **engine_options(keys)) as c:
            return list(await asyncio.gather(*(c.ping() for _ in range(8))))

    assert all(rtt > 0 for rtt in asyncio.run(main()))


def test_client_refuses_an_incomplete_or_malformed_key_set(keys: dict[str, Path]) -> None:
    server_key = zmq.auth.load_certificate(str(keys["server_public"]))[0]
    with pytest.raises(ValueError, match="secret key"):
        Client("tcp://127.0.0.1:1", curve_server_key=server_key)
    with pytest.raises(ValueError, match="server's public key"):
        Client("tcp://127.0.0.1:1", curve_secret_key_file=str(keys["engine"]))
    with pytest.raises(ValueError, match="40-character"):
        Client("tcp://127.0.0.1:1", curve_secret_key="short", curve_server_key=server_key)
    with pytest.raises(ValueError, match="holds no secret key"):
        Client("tcp://127.0.0.1:1", curve_secret_key_file=str(keys["server_public"]), curve_server_key=server_key)


def test_adding_a_key_file_admits_that_client_without_a_restart(curve_daemon: DaemonProcess,
                                                                  keys: dict[str, Path]) -> None:
    intruder = engine_options(keys, "intruder")
    assert refused(curve_daemon.endpoint, **intruder)
    shutil.copy(keys["dir"] / "intruder.key", keys["authorized"] / "intruder.key")
    try:
        with Client(curve_daemon.endpoint, timeout=5, **intruder) as c:
            assert c.ping() < 5
    finally:
        os.unlink(keys["authorized"] / "intruder.key")
    assert refused(curve_daemon.endpoint, **intruder)  # and removing it shuts the door again


def _run_daemon(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvswap.daemon", "--cache-queue-port", str(free_port()),
                           "--metrics-port", str(free_port()), *args], capture_output=True, text=True, timeout=30)


def test_curve_flags_go_together(tmp_path: Path, keys: dict[str, Path]) -> None:
    result = _run_daemon(["--storage-dir", str(tmp_path / "s"), "--curve-secret-key-file", str(keys["server_secret"])])
    assert result.returncode == 2
    assert "authorized_keys" in result.stderr


def test_a_public_key_passed_as_the_secret_fails_startup(tmp_path: Path, keys: dict[str, Path]) -> None:
    result = _run_daemon(["--storage-dir", str(tmp_path / "s"), "--curve-secret-key-file", str(keys["server_public"]),
                          "--authorized-keys", str(keys["authorized"])])
    assert result.returncode == 3
    assert "holds no secret key" in result.stderr


def test_non_loopback_bind_warns_unless_curve_is_on(tmp_path: Path, keys: dict[str, Path]) -> None:
    plain = DaemonProcess(tmp_path / "a", free_port(), free_port(), extra_args=["--host", "0.0.0.0"]).start()
    try:
        assert "beyond loopback, without authentication" in plain.log()
    finally:
        assert plain.stop() == 0
    curved = DaemonProcess(tmp_path / "b", free_port(), free_port(),
                           extra_args=["--host", "0.0.0.0", "--curve-secret-key-file", str(keys["server_secret"]),
                                       "--authorized-keys", str(keys["authorized"])],
                           client_options=engine_options(keys)).start()
    try:
        assert "without authentication" not in curved.log()
        assert "CURVE is on" in curved.log()
    finally:
        assert curved.stop() == 0


# -- what the daemon writes is private ----------------------------------------------------------------


@pytest.mark.parametrize("file_layout", LAYOUTS)
def test_daemon_writes_0600_files_and_0700_directories_under_an_open_umask(tmp_path: Path, file_layout: str) -> None:
    """The store tests check modes in-process; this checks the real daemon, started with a
    umask that would leave everything world-readable if the code relied on it. In the slab
    layout the files are the slabs, their journals and locks."""
    store = tmp_path / "store"
    d = DaemonProcess(store, free_port(), free_port(), extra_args=["--file-layout", file_layout])
    old = os.umask(0)
    try:
        d.start()
    finally:
        os.umask(old)
    layout = CacheLayout("modes", num_layers=1, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=8)
    try:
        with HostKVCache.create(layout) as cache, Client(d.endpoint, timeout=10) as c:
            c.register(cache)
            c.swap_out([0, 1, 2], ["m0", "m1", "m2"], wait="persisted")
            assert wait_until(lambda: c.stats()["tiers"]["file"]["records"] == 3)
    finally:
        assert d.stop() == 0
    dirs, files = [store], []
    for here, subdirs, names in os.walk(store):
        dirs += [Path(here) / s for s in subdirs]
        files += [Path(here) / n for n in names]
    assert len(records_on_disk(store)) == 3
    assert {f.suffix for f in files} >= ({".kvr"} if file_layout == "files" else {".slab", ".journal", ".lock"})
    assert {str(p): oct(mode(p)) for p in dirs if mode(p) != 0o700} == {}
    assert {str(p): oct(mode(p)) for p in files if mode(p) != 0o600} == {}
