"""``kvswap verify`` reads files the way the daemon does: a symlink to /dev/zero, a FIFO or an
oversized file planted under a record's name is reported bad, never followed, waited on or
read whole. Run as a real ``kvswap verify`` subprocess with a timeout, over a real directory
written by the file store."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvswap.backends import file_tools
from kvswap.backends.file_store import FileBackend

RECORD = 2048
NS = "cc" * 16


def make_store(root, n: int):
    store = FileBackend(str(root)).open_store(NS, {"model_id": "m-cc"}, RECORD)
    for i in range(n):
        store.put(f"cc-{i}", memoryview(bytes([i]) * RECORD))
    return store


def verify_cli(root, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvswap.daemon.tools.admin", "verify", str(root), "--json", *args],
                          capture_output=True, text=True, timeout=60)


def test_verify_reports_a_symlink_a_fifo_and_an_oversized_file(tmp_path) -> None:
    store = make_store(tmp_path, 5)
    to_zero, fifo, big = (store.path_of(f"cc-{i}")[1] for i in (1, 2, 3))
    os.unlink(to_zero)
    os.symlink("/dev/zero", to_zero)
    os.unlink(fifo)
    os.mkfifo(fifo, 0o600)
    with open(big, "r+b") as f:
        f.truncate(256 + RECORD + 1)  # one byte over a whole record of this namespace

    result = verify_cli(tmp_path)  # the old verify read /dev/zero to MemoryError, and hung on the FIFO
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["checked"] == 5 and report["good"] == 2
    reasons = dict((os.path.basename(p), r) for p, r in report["bad"])
    assert reasons == {os.path.basename(to_zero): "a symlink where a record should be",
                       os.path.basename(fifo): "not a regular file where a record should be",
                       os.path.basename(big): f"a file of {256 + RECORD + 1} bytes, larger than a record of this "
                                              f"namespace ({256 + RECORD})"}
    assert os.path.islink(to_zero) and os.path.exists(fifo)  # reported only

    removed = verify_cli(tmp_path, "--remove")
    assert json.loads(removed.stdout)["removed"] == 3
    assert not os.path.lexists(to_zero) and not os.path.exists(fifo) and not os.path.exists(big)
    assert os.path.realpath("/dev/zero") == "/dev/zero"  # the link was removed, not its target


def test_without_a_record_size_the_default_cap_applies(tmp_path) -> None:
    make_store(tmp_path, 1)
    os.unlink(tmp_path / NS / "namespace.json")
    os.symlink("/dev/zero", tmp_path / NS / "namespace.json")
    assert file_tools.max_record_file_bytes(str(tmp_path), NS) == file_tools.DEFAULT_MAX_RECORD_FILE_BYTES


def test_read_record_file_refuses_before_reading(tmp_path) -> None:
    path = tmp_path / "sparse.kvr"
    with open(path, "wb") as f:
        f.truncate(1 << 40)  # a terabyte, sparse: reading it whole would never finish
    with pytest.raises(file_tools.Corrupt) as err:
        file_tools.read_record_file(str(path), 4096)
    assert err.value.details == {"size": 1 << 40}
