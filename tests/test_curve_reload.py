"""CURVE revocation fails closed: a key deleted from the authorized directory is refused at the
next handshake even while a broken key file (a half-written new key) sits beside it. A real
CURVE daemon subprocess, real keys; the signals asserted on are the daemon's refusal counter,
its key-file gauge and its log lines."""

from __future__ import annotations

import os
import shutil
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
