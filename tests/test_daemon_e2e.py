"""The end-to-end slice: a real kvswapd subprocess, the real client over ZMQ, a real directory."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import msgpack
import numpy as np
import pytest
import zmq

from kvswap.protocol import (
    AsyncClient,
    CacheLayout,
    Client,
    HostKVCache,
    InvalidKey,
    InvalidLayout,
    NotRegistered,
    OutOfRange,
    TooLarge,
)
from kvswap.protocol import messages as m
from kvswap.protocol.limits import MAX_KEYS_PER_REQUEST

from disk_records import LAYOUTS, find_record, record_of
from support import DaemonProcess, free_port, shm_exists, wait_until


def keys_for(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i:04d}" for i in range(n)]


def test_round_trip_into_other_blocks_is_byte_exact(client: Client, cache: HostKVCache) -> None:
    client.register(cache)
    rng = np.random.default_rng(7)
    src = rng.choice(cache.layout.num_blocks, size=12, replace=False).tolist()
    dst = rng.choice(cache.layout.num_blocks, size=12, replace=False).tolist()
    keys = keys_for("rt", 12)
    expected = [cache.block_record(b) for b in src]

    out = client.swap_out(src, keys, wait="persisted")
    assert out.status == ["stored"] * 12 and out.stored == 12

    cache.zero_blocks(list(range(cache.layout.num_blocks)))
    started = time.perf_counter()
    result = client.swap_in(keys, dst)
    waited = time.perf_counter() - started
    assert result.loaded == 12 and result.status == ["loaded"] * 12
    # The daemon says how long it worked on it: part of what the client waited.
    assert result.elapsed_s is not None and 0 < result.elapsed_s <= waited
    for want, block in zip(expected, dst):
        assert cache.block_record(block) == want
    # Every region of a loaded block was written, not just the first.
    assert all(cache.values[layer][dst[0]].any() for layer in range(cache.layout.num_layers))


def test_lookup_returns_the_stored_prefix(client: Client, cache: HostKVCache) -> None:
    client.register(cache)
    keys = [f"k{i}" for i in range(6)]
    client.swap_out([0, 1, 2, 3, 5], keys[:4] + [keys[5]], wait="persisted")
    assert client.lookup(keys) == 4
    assert client.lookup(keys[:3]) == 3
    assert client.lookup(["k4", "k5"]) == 0
    assert client.lookup([]) == 0


def test_copied_then_flush_then_found(client: Client, cache: HostKVCache) -> None:
    client.register(cache)
    keys = keys_for("cp", 8)
    out = client.swap_out(list(range(8)), keys, wait="copied")
    assert out.queued + out.stored == 8
    assert client.lookup(keys) == 8  # in-flight writes count as stored
    client.flush()
    assert client.stats()["tiers"]["file"]["records"] == 8


def test_duplicates_and_existing_keys_are_skipped(client: Client, cache: HostKVCache) -> None:
    client.register(cache)
    first = client.swap_out([1, 2, 1], ["a", "b", "a"], wait="persisted")
    assert first.status == ["stored", "stored", "exists"]
    again = client.swap_out([3, 4], ["a", "c"], wait="persisted")
    assert again.status == ["exists", "stored"]
    assert client.stats()["tiers"]["file"]["records"] == 3


def test_restart_serves_stored_keys(daemon: DaemonProcess, cache: HostKVCache) -> None:
    keys = keys_for("rs", 6)
    with Client(daemon.endpoint, timeout=10) as c:
        c.register(cache)
        c.swap_out(list(range(6)), keys, wait="persisted")
    expected = [cache.block_record(b) for b in range(6)]
    assert daemon.stop() == 0

    daemon.start()
    with Client(daemon.endpoint, timeout=10) as c:
        c.register(cache)
        assert c.lookup(keys) == 6
        cache.zero_blocks(list(range(32)))
        result = c.swap_in(keys, list(range(10, 16)))
        assert result.loaded == 6
        assert [cache.block_record(b) for b in range(10, 16)] == expected
        assert wait_until(lambda: c.stats()["tiers"]["file"]["records"] == 6)


def test_metrics_and_health_over_http(daemon: DaemonProcess, client: Client, cache: HostKVCache) -> None:
    assert daemon.http("/healthz")[0] == 200
    assert daemon.http("/readyz")[0] == 200
    assert daemon.http("/nope")[0] == 404
    client.register(cache)
    client.swap_out([0, 1, 2], ["m0", "m1", "m2"], wait="persisted")
    client.swap_in(["m0", "m1", "missing"], [5, 6, 7])
    client.lookup(["m0", "m1", "zz"])
    record = cache.layout.record_bytes
    assert daemon.metric("kvswap_bytes_total", direction="out") == 3 * record
    assert daemon.metric("kvswap_bytes_total", direction="in") == 2 * record
    assert daemon.metric("kvswap_requests_total", op="swap_out", outcome="ok") == 1
    assert daemon.metric("kvswap_lookup_keys_total", result="hit") == 2
    assert daemon.metric("kvswap_lookup_keys_total", result="miss") == 1
    assert daemon.metric("kvswap_blocks_total", op="swap_in", status="miss") == 1
    assert daemon.metric("kvswap_stored_records", tier="file") == 3
    assert daemon.metric("kvswap_registered") == 1
    assert daemon.metric("kvswap_request_duration_seconds_count", op="swap_out") == 1


def _raw_call(endpoint: str, frame: bytes) -> dict:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(frame)
        assert sock.poll(5000), "no reply to a raw frame"
        return msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.close()


@pytest.mark.parametrize(
    ("frame", "code", "reply_id"),
    [
        (b"\xc1not msgpack at all", "bad_request", None),
        (msgpack.packb({"v": 1, "id": 5, "op": "swap_out", "keys": ["a"]})[:-3], "bad_request", None),
        (msgpack.packb([1, 2, 3]), "bad_request", None),
        (msgpack.packb({"v": 1, "id": 9, "op": "explode"}), "unknown_op", 9),
        (msgpack.packb({"v": 2, "id": 10, "op": "ping"}), "unsupported_version", 10),
        (msgpack.packb({"v": 1, "id": 11, "op": "lookup", "keys": "abc"}), "bad_request", 11),
        (msgpack.packb({"v": 1, "id": 12, "op": "lookup", "keys": ["a/b"]}), "invalid_key", 12),
        (msgpack.packb({"v": 1, "id": 13, "op": "swap_in", "keys": ["a"], "block_ids": [-1]}), "bad_request", 13),
        (msgpack.packb({"v": 1, "id": 14, "op": "swap_in", "keys": ["a", "b"], "block_ids": [1]}), "bad_request", 14),
        (msgpack.packb({"v": 1, "id": 15, "op": "lookup", "keys": ["k"] * (MAX_KEYS_PER_REQUEST + 1)}),
         "too_large", 15),
    ],
)
def test_malformed_frames_get_typed_errors(daemon: DaemonProcess, frame: bytes, code: str, reply_id) -> None:
    reply = _raw_call(daemon.endpoint, frame)
    assert reply["ok"] is False
    assert reply["error"]["code"] == code
    assert reply["id"] == reply_id
    assert reply["error"]["message"]
    with Client(daemon.endpoint, timeout=5) as c:
        assert c.ping() < 5
    assert daemon.alive


def test_typed_errors_through_the_client(client: Client, cache: HostKVCache, daemon: DaemonProcess) -> None:
    with pytest.raises(NotRegistered):
        client.swap_in(["a"], [0])
    client.register(cache)
    with pytest.raises(OutOfRange) as err:
        client.swap_out([0, 32], ["a", "b"])
    assert err.value.details["block_id"] == 32
    with pytest.raises(InvalidKey):
        client.lookup(["..", "x"])
    with pytest.raises(TooLarge):
        client.lookup(["k"] * (MAX_KEYS_PER_REQUEST + 1))
    assert client.ping() > 0
    # Nothing stored was lost by the refusals.
    client.swap_out([1], ["kept"], wait="persisted")
    with pytest.raises(OutOfRange):
        client.swap_in(["kept"], [99])
    assert client.lookup(["kept"]) == 1
    assert daemon.metric("kvswap_errors_total", op="swap_out", code="out_of_range") == 1


@pytest.fixture(params=LAYOUTS)
def file_only(storage_dir: Path, request: pytest.FixtureRequest) -> Iterator[Client]:
    """A daemon without RAM tier, in each file layout: what swap_in loads comes from disk."""
    d = DaemonProcess(storage_dir, free_port(), free_port(),
                      extra_args=["--host-tier-bytes", "0", "--file-layout", request.param]).start()
    with Client(d.endpoint, timeout=10) as c:
        yield c
    assert d.stop() == 0, d.log()


def test_flipped_byte_is_reported_corrupt_and_never_loaded(file_only: Client, cache: HostKVCache,
                                                           storage_dir: Path) -> None:
    client = file_only
    info = client.register(cache)
    client.swap_out([0, 1], ["good", "bad"], wait="persisted")
    namespace_dir = storage_dir / info["namespace"]
    record_of(namespace_dir, "bad").flip(-100, 0x01)

    cache.zero_blocks([20, 21])
    result = client.swap_in(["good", "bad"], [20, 21])
    assert result.status == ["loaded", "corrupt"]
    assert result.loaded == 1
    assert cache.block_record(21) == bytes(cache.layout.record_bytes)  # untouched: still zeros
    # Removed (its file, or its slot freed in the journal), so the next lookup is an honest miss.
    assert find_record(namespace_dir, "bad") is None and find_record(namespace_dir, "good") is not None
    assert client.lookup(["good", "bad"]) == 1


def test_register_validates_the_segment(client: Client, cache: HostKVCache, layout: CacheLayout) -> None:
    too_big = CacheLayout(layout.model_id, layout.num_layers, layout.num_blocks * 4, layout.block_size,
                          layout.num_kv_heads, layout.head_dim)
    registration = cache.registration()
    registration["layout"] = too_big.to_wire()
    with pytest.raises(InvalidLayout):
        client.register(registration)
    missing = cache.registration()
    missing["handles"] = [{"kind": "shm", "name": "kvswap-does-not-exist", "size": 4096}]
    with pytest.raises(InvalidLayout):
        client.register(missing)
    traversal = cache.registration()
    traversal["handles"] = [{"kind": "shm", "name": "../etc/passwd", "size": 4096}]
    with pytest.raises(InvalidLayout):
        client.register(traversal)
    wrong_regions = cache.registration()
    wrong_regions["regions"] = wrong_regions["regions"][:-1]
    with pytest.raises(InvalidLayout):
        client.register(wrong_regions)
    assert client.register(cache)["record_bytes"] == layout.record_bytes


def test_pipelined_requests_on_one_socket(client: Client, cache: HostKVCache) -> None:
    client.register(cache)
    client.swap_out(list(range(4)), keys_for("p", 4), wait="persisted")
    sent = [client.send(m.Lookup, {"keys": tuple(keys_for("p", n))}) for n in (1, 2, 3, 4)]
    ping = client.send(m.Ping)
    # Collect out of order: replies are matched by id, not by arrival.
    assert client.wait(ping) == {"pong": True}
    assert [client.wait(i)["hits"] for i in reversed(sent)] == [4, 3, 2, 1]


def test_async_client_many_in_flight(daemon: DaemonProcess, cache: HostKVCache) -> None:
    async def main() -> list:
        async with AsyncClient(daemon.endpoint, timeout=10) as c:
            await c.wait_ready(5)
            await c.register(cache)
            await c.swap_out(list(range(16)), keys_for("a", 16), wait="persisted")
            lookups = [c.lookup(keys_for("a", n)) for n in range(1, 17)]
            pings = [c.ping() for _ in range(20)]
            return await asyncio.gather(*lookups, *pings)

    results = asyncio.run(main())
    assert results[:16] == list(range(1, 17))
    assert all(0 < rtt < 10 for rtt in results[16:])


def test_sigterm_drains_pending_writes_and_exits_zero(daemon: DaemonProcess, cache: HostKVCache) -> None:
    keys = keys_for("drain", 24)
    with Client(daemon.endpoint, timeout=10) as c:
        c.register(cache)
        c.swap_out(list(range(24)), keys, wait="copied")
    assert daemon.stop(signal.SIGTERM) == 0
    daemon.start()
    with Client(daemon.endpoint, timeout=10) as c:
        c.register(cache)
        assert c.lookup(keys) == 24


def test_engine_death_releases_its_mapping(daemon: DaemonProcess) -> None:
    script = (
        "import sys, time\n"
        "from kvswap.protocol import CacheLayout, HostKVCache, Client\n"
        "layout = CacheLayout('dying', num_layers=2, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=8)\n"
        "cache = HostKVCache.create(layout)\n"
        f"c = Client('{daemon.endpoint}', timeout=10)\n"
        "c.register(cache)\n"
        "print(cache.segment.name, flush=True)\n"
        "time.sleep(60)\n"
    )
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        segment = engine.stdout.readline().strip()
        assert segment and shm_exists(segment)
        assert wait_until(lambda: daemon.metric("kvswap_registered") == 1)
        engine.kill()
        engine.wait()
        assert wait_until(lambda: daemon.metric("kvswap_registered") == 0, timeout=10)
        assert daemon.metric("kvswap_registrations_total", event="engine_exited") == 1
    finally:
        engine.kill()
        engine.wait()
        if segment:
            try:
                os.unlink(f"/dev/shm/{segment}")
            except FileNotFoundError:
                pass
    # A new engine registers without restarting the daemon.
    layout = CacheLayout("next", num_layers=1, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=8)
    with HostKVCache.create(layout) as cache, Client(daemon.endpoint, timeout=10) as c:
        assert c.register(cache)["record_bytes"] == layout.record_bytes


def _run_daemon(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvswap.daemon", *args], capture_output=True, text=True, timeout=30)


def test_startup_fails_with_its_own_code_when_the_port_is_taken(tmp_path: Path) -> None:
    ctx = zmq.Context.instance()
    taken = ctx.socket(zmq.ROUTER)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        result = _run_daemon(["--cache-queue-port", str(port), "--metrics-port", str(free_port()),
                              "--storage-dir", str(tmp_path / "s")])
    finally:
        taken.close(0)
    assert result.returncode == 3
    assert "already in use" in result.stderr
    assert f"cache-queue port 127.0.0.1:{port}" in result.stderr


def test_startup_fails_when_the_directory_is_not_writable(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = _run_daemon(["--cache-queue-port", str(free_port()), "--metrics-port", str(free_port()),
                          "--storage-dir", str(blocker / "store")])
    assert result.returncode == 3
    assert "cannot be used: Not a directory" in result.stderr


def test_env_vars_configure_the_daemon(tmp_path: Path, cache: HostKVCache) -> None:
    port, mport = free_port(), free_port()
    env = dict(os.environ, KVSWAP_CACHE_QUEUE_PORT=str(port), KVSWAP_METRICS_PORT=str(mport),
               FILE_BACKEND_STORAGE_DIR=str(tmp_path / "fd-store"))
    proc = subprocess.Popen([sys.executable, "-m", "kvswap.daemon"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=5) as c:
            c.wait_ready(15)
            assert c.stats()["storage_dir"] == str(tmp_path / "fd-store")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
