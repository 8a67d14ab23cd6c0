"""``kvswap verify`` reads files the way the daemon does: a symlink to /dev/zero, a FIFO or an
oversized file planted under a record's name is reported bad, never followed, waited on or
read whole; how much it reads is bounded by what a daemon accepts, never by the directory's
own ``namespace.json``. Run as a real ``kvswap verify`` subprocess with a timeout, over a real
directory written by the file store."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvswap.backends import file_tools, record
from kvswap.backends.file_backend import FileBackend
from kvswap.common.units import PAGE_BYTES
from kvswap.daemon.config import Config
from kvswap.protocol.layout import CacheLayout

LAYOUT = CacheLayout("m-cc", num_layers=1, num_blocks=8, block_size=8, num_kv_heads=2, head_dim=32)
RECORD = LAYOUT.record_bytes  # 2048
NS = LAYOUT.fingerprint()
FILE = 256 + RECORD
#: What a daemon with the default staging accepts: a record whose page-rounded slot fits both pools.
DAEMON_RECORD = min(Config().write_staging_bytes, Config().read_staging_bytes) // PAGE_BYTES * PAGE_BYTES
DAEMON_FILE = record.header_len_for(DAEMON_RECORD) + DAEMON_RECORD


def make_store(root, n: int, layout: CacheLayout = LAYOUT):
    store = FileBackend(str(root), layout="files").open_store(layout.fingerprint(), layout.to_wire(), layout.record_bytes)
    for i in range(n):
        store.put(f"cc-{i}", memoryview(bytes([i]) * layout.record_bytes))
    return store


def verify_cli(root, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvswap.daemon.tools.admin", "verify", str(root), "--json", *args],
                          capture_output=True, text=True, timeout=60)


#: Runs ``kvswap verify`` in-process after its imports, then prints what the command itself
#: read (``rchar``: every byte a read system call returned) and how much its peak RSS grew.
_MEASURED = """
import json, resource, sys
from kvswap.daemon.tools.admin import main
def rchar():
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))
read0, rss0 = rchar(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    main(["verify", "--json", *sys.argv[1:]], standalone_mode=False)
    code = 0
except SystemExit as exc:
    code = exc.code
read1, rss1 = rchar(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"rc": code, "read": read1 - read0, "rss_growth_kib": rss1 - rss0}), file=sys.stderr)
"""


def measured_verify(root) -> tuple[dict, dict]:
    result = subprocess.run([sys.executable, "-c", _MEASURED, str(root)], capture_output=True, text=True, timeout=120)
    return json.loads(result.stdout), json.loads(result.stderr.strip().splitlines()[-1])


def test_verify_reports_a_symlink_a_fifo_and_an_oversized_file(tmp_path) -> None:
    store = make_store(tmp_path, 5)
    to_zero, fifo, big = (store.path_of(f"cc-{i}")[1] for i in (1, 2, 3))
    os.unlink(to_zero)
    os.symlink("/dev/zero", to_zero)
    os.unlink(fifo)
    os.mkfifo(fifo, 0o600)
    with open(big, "r+b") as f:
        f.truncate(FILE + 1)  # one byte over a whole record of this namespace

    result = verify_cli(tmp_path)  # the old verify read /dev/zero to MemoryError, and hung on the FIFO
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["checked"] == 5 and report["good"] == 2
    reasons = dict((os.path.basename(p), r) for p, r in report["bad"])
    assert reasons == {os.path.basename(to_zero): "a symlink where a record should be",
                       os.path.basename(fifo): "not a regular file where a record should be",
                       os.path.basename(big): f"a file of {FILE + 1} bytes, larger than a record of this "
                                              f"namespace ({FILE})"}
    assert os.path.islink(to_zero) and os.path.exists(fifo)  # reported only

    removed = verify_cli(tmp_path, "--remove")
    assert json.loads(removed.stdout)["removed"] == 3
    assert not os.path.lexists(to_zero) and not os.path.exists(fifo) and not os.path.exists(big)
    assert os.path.realpath("/dev/zero") == "/dev/zero"  # the link was removed, not its target


@pytest.mark.parametrize("damage", ["forged", "edited"])
def test_namespace_json_does_not_raise_what_verify_reads(tmp_path, damage: str) -> None:
    """The old verify took its cap from namespace.json: declaring 1 TiB there made it read a
    300 MB sparse file whole (maxrss 350 MB). The cap is what a daemon accepts, narrowed only
    by a record size that namespace.json proves (its layout's fingerprint is the directory's
    name); an oversized file is reported from its size, without reading it."""
    store = make_store(tmp_path, 3)
    meta = tmp_path / NS / "namespace.json"
    body = json.loads(meta.read_text())
    body["record_bytes"] = 1 << 40
    if damage == "forged":
        body["layout"] = {"model_id": "m-cc"}  # no layout that fingerprints to this directory
    meta.write_text(json.dumps(body))
    huge, over = store.path_of("cc-1")[1], store.path_of("cc-2")[1]
    with open(huge, "r+b") as f:
        f.truncate(300 * 10**6)  # sparse: over what any daemon with default staging accepts
    payload = 32 << 20  # within the daemon's limit, over this namespace's records
    over_size = record.header_len_for(payload) + payload
    with open(over, "wb") as f:  # a well-formed header, then a sparse payload that fails its checksum
        f.write(record.encode_header(bytes.fromhex(NS), "cc-2", payload, 1))
        f.truncate(over_size)

    report, cost = measured_verify(tmp_path)
    assert cost["rss_growth_kib"] < 16 * 1024, cost  # the payload is checksummed in chunks
    assert cost["read"] < (over_size if damage == "forged" else 0) + (1 << 20), cost
    assert cost["rc"] == 1
    assert report["checked"] == 3 and report["good"] == 1
    reasons = {os.path.basename(p): r for p, r in report["bad"]}
    ((where, why),) = report["namespace_problems"]
    assert where == str(meta)
    if damage == "forged":
        assert reasons == {os.path.basename(huge): f"a file of {300 * 10**6} bytes, larger than any record a daemon "
                                                   f"accepts ({DAEMON_FILE}; see --max-record-bytes)",
                           os.path.basename(over): "payload checksum mismatch"}
        assert why.startswith("its layout does not fingerprint to this directory")
    else:
        assert reasons == {os.path.basename(p): f"a file of {size} bytes, larger than a record of this namespace "
                                                f"({FILE})" for p, size in ((huge, 300 * 10**6), (over, over_size))}
        assert why == f"it says record_bytes {1 << 40}, its layout makes {RECORD}"


def test_records_over_the_daemon_limit_are_not_judged(tmp_path) -> None:
    """A namespace whose proven record size is over --max-record-bytes (its daemons run with
    more staging) is reported and left alone: its records are neither read nor removed."""
    big = CacheLayout("m-big", num_layers=300, num_blocks=8, block_size=64, num_kv_heads=8, head_dim=128)
    assert big.record_bytes > DAEMON_RECORD
    store = make_store(tmp_path, 0, big)
    _, path = store.path_of("cc-0")
    os.makedirs(os.path.dirname(path), 0o700, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(record.header_len_for(big.record_bytes) + big.record_bytes)

    result = verify_cli(tmp_path, "--remove")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert (report["checked"], report["unchecked"], report["removed"], report["bad"]) == (0, 1, 0, [])
    ((_, why),) = report["namespace_problems"]
    assert why == (f"records of {big.record_bytes} bytes, over --max-record-bytes ({DAEMON_RECORD}): "
                   "1 record not checked")
    assert os.path.getsize(path) == record.header_len_for(big.record_bytes) + big.record_bytes

    raised = verify_cli(tmp_path, "--max-record-bytes", str(big.record_bytes))
    assert json.loads(raised.stdout)["bad"] == [[path, "header checksum mismatch"]]


def test_the_default_limit_is_what_a_daemon_accepts() -> None:
    assert file_tools.DEFAULT_MAX_RECORD_BYTES == DAEMON_RECORD


def test_without_namespace_json_the_daemon_limit_applies(tmp_path) -> None:
    make_store(tmp_path, 1)
    os.unlink(tmp_path / NS / "namespace.json")
    os.symlink("/dev/zero", tmp_path / NS / "namespace.json")
    size = file_tools.record_size(str(tmp_path), NS)
    assert size.record_bytes is None and size.problems == ("cannot be read: a symlink",)
    report = file_tools.verify(str(tmp_path))
    assert (report.checked, report.good) == (1, 1)


def test_read_record_file_refuses_before_reading(tmp_path) -> None:
    path = tmp_path / "sparse.kvr"
    with open(path, "wb") as f:
        f.truncate(1 << 40)  # a terabyte, sparse: reading it whole would never finish
    with pytest.raises(file_tools.Corrupt) as err:
        file_tools.read_record_file(str(path), 4096)
    assert err.value.details == {"size": 1 << 40}
