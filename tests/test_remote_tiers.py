"""The remote tier (kvswap.backends.remote, redis_tier, mooncake_tier).

Pure units first: URL parsing and the health gate (fake clock, fake probe). Then the adapters
against real servers on loopback ports, started here: ``redis-server`` alone and as a
three-node Redis Cluster, and Mooncake Store's ``mooncake_master`` (clients use
``metadata=P2PHANDSHAKE``). Byte-exact round trips, misses, records damaged through the store's
own client, namespace isolation, and the server killed and restarted mid-run. The health gate's
clock is injected, so "fails fast" is shown by counting probes, not by timing calls.
"""

from __future__ import annotations

import secrets
import threading
from pathlib import Path

import numpy as np
import pytest

from kvswap.backends import record
from kvswap.backends.base import GetStatus
from kvswap.backends.remote import (HealthGate, MooncakeSpec, RedisSpec, RemoteConfigError, open_remote,
                                    parse_remote_url, remote_key)
from kvswap.protocol.errors import IOFailure, NoSpace, Unavailable
from kvswap.testing.remote_servers import (MooncakeMaster, RedisClusterServers, RedisServer, mooncake_skip_reason,
                                           redis_skip_reason)
from support import free_port, wait_until

RECORD_BYTES = 96 * 1024  # >= 64 KiB: the record carries the 4 KiB aligned header
STORED_BYTES = record.header_len_for(RECORD_BYTES) + RECORD_BYTES

needs_redis = pytest.mark.skipif(bool(redis_skip_reason()), reason=redis_skip_reason() or "redis available")
needs_mooncake = pytest.mark.skipif(bool(mooncake_skip_reason()), reason=mooncake_skip_reason() or "mooncake available")


def payload(seed: int, size: int = RECORD_BYTES) -> memoryview:
    return memoryview(np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8).tobytes())


def out_buffer(size: int = RECORD_BYTES) -> memoryview:
    return memoryview(bytearray(b"\xee" * size))


def new_namespace() -> str:
    return secrets.token_hex(16)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# -- URL parsing ------------------------------------------------------------------------------


def test_parse_redis_forms():
    assert parse_remote_url("redis://cache.local:6380/3?timeout=0.25&connect_timeout=2&max_connections=8") == RedisSpec(
        host="cache.local", port=6380, db=3, timeout=0.25, connect_timeout=2.0, max_connections=8)
    assert parse_remote_url("redis://127.0.0.1") == RedisSpec(host="127.0.0.1")
    tls = parse_remote_url("rediss://user:s%40cret@10.1.2.3:7000/1")
    assert (tls.tls, tls.username, tls.password, tls.db) == (True, "user", "s@cret", 1)
    assert tls.redacted() == "rediss://***@10.1.2.3:7000/1"
    cluster = parse_remote_url("redis+cluster://seed:7001")
    assert (cluster.cluster, cluster.host, cluster.port) == (True, "seed", 7001)


def test_parse_mooncake_forms():
    spec = parse_remote_url("mooncake://10.0.0.5:50051?metadata=http://10.0.0.5:8080/metadata&protocol=rdma"
                            "&device=mlx5_0,mlx5_1&segment=4GiB&buffer=512MB&slots=16&timeout=2")
    assert spec == MooncakeSpec(master_host="10.0.0.5", master_port=50051, metadata="http://10.0.0.5:8080/metadata",
                                protocol="rdma", device="mlx5_0,mlx5_1", segment=4 << 30, buffer=512 << 20, slots=16,
                                timeout=2.0)
    default = parse_remote_url("mooncake://master:50051")
    assert (default.metadata, default.protocol, default.segment) == ("P2PHANDSHAKE", "tcp", 0)


@pytest.mark.parametrize("url, problem", [
    ("", "empty"),
    ("memcached://h:1", "unknown remote URL scheme"),
    ("redis://", "names no host"),
    ("redis://h:notaport", "malformed"),
    ("redis://h:6379/zero", "database must be a number"),
    ("redis://h?timeout=-1", "positive number"),
    ("redis://h?timeout=soon", "number of seconds"),
    ("redis://h?tiemout=1", "unknown redis setting(s) tiemout"),
    ("redis+cluster://h:7000/2", "no database number"),
    ("mooncake://master", "needs the master's port"),
    ("mooncake://m:1?protocol=udp", "tcp or rdma"),
    ("mooncake://m:1?metadata=etcd-host", "metadata must be"),
    ("mooncake://m:1?segment=lots", "size such as"),
    ("mooncake://m:1?segment=inf", "non-negative size"),
    ("mooncake://m:1?segment=1MiB", "at least 16MiB"),
    ("mooncake://m:1?slots=0", "positive integer"),
    ("mooncake://m:1/path", "takes no path"),
])
def test_bad_urls_name_the_valid_forms(url, problem):
    with pytest.raises(RemoteConfigError) as info:
        open_remote(url)
    assert isinstance(info.value, ValueError)
    assert problem in str(info.value)
    assert "valid remote URLs: redis://" in str(info.value) and "mooncake://MASTER_HOST:PORT" in str(info.value)


def test_remote_keys_carry_the_namespace():
    assert remote_key("ab" * 16, "h0") == "kvswap/" + "ab" * 16 + "/h0"


# -- HealthGate (pure) ------------------------------------------------------------------------


class Probe:
    def __init__(self) -> None:
        self.calls = 0
        self.fail = False

    def __call__(self) -> None:
        self.calls += 1
        if self.fail:
            raise ConnectionRefusedError("refused")


def test_gate_connects_on_first_use_and_fails_fast_after_a_failure():
    clock, probe = FakeClock(), Probe()
    gate = HealthGate("t", probe, backoff_initial_s=1.0, backoff_max_s=4.0, clock=clock)
    assert not gate.healthy
    gate.admit()  # first use: probes (connects)
    assert (gate.healthy, probe.calls, gate.reconnects) == (True, 1, 0)
    gate.admit()
    assert probe.calls == 1  # healthy: no probe per call

    err = gate.failed(TimeoutError("read timed out"))
    assert isinstance(err, Unavailable) and "read timed out" in err.message
    assert (gate.healthy, gate.failures) == (False, 1)
    for _ in range(5):  # within the backoff: refused without touching the store
        with pytest.raises(Unavailable):
            gate.admit()
    assert probe.calls == 1

    clock.advance(1.0)
    gate.admit()  # due: one probe, which succeeds
    assert (gate.healthy, probe.calls, gate.reconnects) == (True, 2, 1)


def test_gate_backoff_doubles_to_its_cap_and_resets_on_success():
    clock, probe = FakeClock(), Probe()
    gate = HealthGate("t", probe, backoff_initial_s=1.0, backoff_max_s=4.0, clock=clock)
    probe.fail = True
    waits = []
    for _ in range(5):
        with pytest.raises(Unavailable) as info:
            gate.admit()
        waits.append(info.value.details["retry_in_s"])
        clock.advance(waits[-1])
    assert waits == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert (probe.calls, gate.failures, gate.probes) == (5, 5, 5)
    probe.fail = False
    gate.admit()
    assert gate.healthy and gate.reconnects == 0  # never connected before: not a reconnect
    gate.failed("gone")
    clock.advance(1.0)  # back to the initial backoff
    gate.admit()
    assert gate.reconnects == 1


def test_gate_lets_one_thread_reprobe_while_the_others_fail_fast():
    entered, release = threading.Event(), threading.Event()
    calls = []
    clock = FakeClock()

    def slow_probe() -> None:
        calls.append(1)
        if len(calls) > 1:  # the re-probe after an outage hangs until released
            entered.set()
            release.wait(10)

    gate = HealthGate("t", slow_probe, clock=clock)
    gate.admit()  # first connect
    gate.failed("connection reset")
    clock.advance(1.0)
    prober = threading.Thread(target=gate.admit)
    prober.start()
    assert entered.wait(10)
    with pytest.raises(Unavailable):
        gate.admit()
    assert gate.probe() is False  # a probe is running: check does not start another
    release.set()
    prober.join(10)
    assert (len(calls), gate.healthy) == (2, True)


def test_operations_wait_for_the_first_connect_instead_of_failing():
    entered, release = threading.Event(), threading.Event()
    calls = []

    def slow_probe() -> None:
        calls.append(1)
        entered.set()
        release.wait(10)

    gate = HealthGate("t", slow_probe)
    prober = threading.Thread(target=gate.admit)
    prober.start()
    assert entered.wait(10)
    waiter_done = threading.Event()
    waiter = threading.Thread(target=lambda: (gate.admit(), waiter_done.set()))
    waiter.start()
    assert not waiter_done.wait(0.2)  # waiting on the connect, not failing
    release.set()
    prober.join(10)
    waiter.join(10)
    assert waiter_done.is_set() and gate.healthy and len(calls) == 1


def test_gate_checks_of_a_healthy_tier_are_no_reconnects(caplog):
    clock, probe = FakeClock(), Probe()
    gate = HealthGate("t", probe, clock=clock)
    with caplog.at_level("WARNING", logger="kvswap.backends.remote_base"):
        for _ in range(3):
            assert gate.probe() is True
            clock.advance(2.0)
    assert probe.calls == 3 and gate.reconnects == 0
    assert not [r for r in caplog.records if "reachable again" in r.getMessage()]


def test_gate_check_notices_an_outage_while_healthy():
    clock, probe = FakeClock(), Probe()
    gate = HealthGate("t", probe, clock=clock)
    assert gate.probe() is True
    probe.fail = True
    assert gate.probe() is False
    assert gate.probe() is False and probe.calls == 2  # backoff not over: no probe
    probe.fail = False
    clock.advance(0.5)
    assert gate.probe() is True and gate.reconnects == 1


# -- adapters against real servers ------------------------------------------------------------


class Remote:
    """One remote store under test: a backend on it (shared by the module's tests, which each
    use fresh namespaces: Mooncake's client takes seconds to leave the pool) and the store's
    own client, to damage records behind the adapter's back."""

    def __init__(self, kind: str, backend, raw_set, raw_exists) -> None:
        self.kind, self.backend, self.raw_set, self.raw_exists = kind, backend, raw_set, raw_exists

    def open(self):
        return self.backend


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    if redis_skip_reason():
        pytest.skip(redis_skip_reason())
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    if redis_skip_reason():
        pytest.skip(redis_skip_reason())
    cluster = RedisClusterServers(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory):
    if mooncake_skip_reason():
        pytest.skip(mooncake_skip_reason())
    master = MooncakeMaster(tmp_path_factory.mktemp("mooncake")).start()
    yield master
    master.kill()


@pytest.fixture(scope="module", params=["redis", "redis-cluster", "mooncake"])
def remote(request):
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        backend = open_remote(server.url)
        raw = server.raw()
        r = Remote("redis", backend, lambda k, v: raw.set(k, v), lambda k: bool(raw.exists(k)))
    elif request.param == "redis-cluster":
        import redis.cluster

        cluster = request.getfixturevalue("redis_cluster")
        backend = open_remote(cluster.url)
        raw = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
        r = Remote("redis-cluster", backend, lambda k, v: raw.set(k, v), lambda k: bool(raw.exists(k)))
    else:
        master = request.getfixturevalue("mooncake_master")
        backend = open_remote(master.url(segment="64MiB"))
        assert backend.probe(), backend.gate.last_error

        def raw_set(k, v):  # the adapter's own client, used directly (upsert replaces)
            assert backend._client.upsert(k, v) == 0
        r = Remote("mooncake", backend, raw_set, lambda k: backend._client.is_exist(k) == 1)
    yield r
    backend.close()


def test_round_trip_is_byte_exact_and_a_miss_is_a_miss(remote):
    backend = remote.open()
    store = backend.open_store(new_namespace(), {}, RECORD_BYTES)
    assert store.put("h0", payload(0)) == STORED_BYTES
    assert store.put_many([("h1", payload(1)), ("h2", payload(2))]) == [STORED_BYTES] * 2
    out = out_buffer()
    assert store.get_into("h0", out) is GetStatus.LOADED and bytes(out) == bytes(payload(0))
    outs = [out_buffer() for _ in range(4)]
    assert store.get_many(["h1", "h2", "nope", "h0"], outs) == [GetStatus.LOADED, GetStatus.LOADED, GetStatus.MISS,
                                                                GetStatus.LOADED]
    assert [bytes(o) for o in outs[:2]] == [bytes(payload(1)), bytes(payload(2))]
    assert bytes(outs[2]) == b"\xee" * RECORD_BYTES  # a miss leaves the buffer alone
    assert store.get_into("nope", out_buffer()) is GetStatus.MISS
    assert (store.contains("h2"), store.contains("nope")) == (True, False)
    assert store.contains_prefix(["h0", "h1", "nope", "h2"]) == 2
    assert store.usage() == {"records": 3, "bytes": 3 * STORED_BYTES}
    assert remote.raw_exists(remote_key(store.namespace, "h0"))
    assert (backend.healthy, backend.failures, backend.reconnects) == (True, 0, 0)


def test_damaged_records_are_corrupt_and_removed(remote):
    backend = remote.open()
    store = backend.open_store(new_namespace(), {}, RECORD_BYTES)
    good = record.encode_record(store.namespace_bytes, "flip", payload(3))
    store.put("flip", payload(3))
    flipped = bytearray(good)
    flipped[-1] ^= 0x01  # one payload bit
    remote.raw_set(remote_key(store.namespace, "flip"), bytes(flipped))
    remote.raw_set(remote_key(store.namespace, "short"), good[:-100])
    remote.raw_set(remote_key(store.namespace, "other"), good)  # a valid record, of another key
    remote.raw_set(remote_key(store.namespace, "junk"), b"\x00" * STORED_BYTES)

    for key in ("flip", "short", "other", "junk"):
        assert store.get_into(key, out_buffer()) is GetStatus.CORRUPT, key
        assert not remote.raw_exists(remote_key(store.namespace, key)), key
        assert store.get_into(key, out_buffer()) is GetStatus.MISS
    assert store.corrupt == 4
    store.put("flip", payload(3))  # a good copy goes back in
    out = out_buffer()
    assert store.get_into("flip", out) is GetStatus.LOADED and bytes(out) == bytes(payload(3))


def test_a_record_from_another_namespace_is_corrupt(remote):
    backend = remote.open()
    a = backend.open_store(new_namespace(), {}, RECORD_BYTES)
    b = backend.open_store(new_namespace(), {}, RECORD_BYTES)
    stolen = record.encode_record(a.namespace_bytes, "k", payload(4))
    remote.raw_set(remote_key(b.namespace, "k"), stolen)  # a's bytes under b's key
    assert b.get_into("k", out_buffer()) is GetStatus.CORRUPT


def test_namespaces_are_isolated_and_operations_scoped(remote):
    backend = remote.open()
    a = backend.open_store(new_namespace(), {}, RECORD_BYTES)
    b = backend.open_store(new_namespace(), {}, RECORD_BYTES)
    keys = [f"k{i}" for i in range(6)]
    a.put_many([(k, payload(10 + i)) for i, k in enumerate(keys)])
    b.put_many([(k, payload(20 + i)) for i, k in enumerate(keys)])

    out = out_buffer()
    assert a.get_into("k0", out) is GetStatus.LOADED and bytes(out) == bytes(payload(10))
    assert b.get_into("k0", out) is GetStatus.LOADED and bytes(out) == bytes(payload(20))
    assert (a.delete("k0"), a.delete("k0")) == (True, False)
    assert b.contains("k0")
    assert a.delete_many(["k1", "k2", "absent"]) == 2  # spread over slots on a cluster
    assert a.contains_prefix(keys) == 0 and a.contains_prefix(keys[3:]) == 3
    assert a.clear() == 3
    assert a.contains_prefix(keys[3:]) == 0 and a.usage()["records"] == 0
    assert b.contains_prefix(keys) == 6  # untouched by a's delete and clear
    assert b.get_many(keys, [out_buffer() for _ in keys]) == [GetStatus.LOADED] * 6


def test_small_records_use_the_small_header(remote):
    backend = remote.open()
    store = backend.open_store(new_namespace(), {}, 1000)
    store.put("s", payload(5, 1000))
    out = out_buffer(1000)
    assert store.get_into("s", out) is GetStatus.LOADED and bytes(out) == bytes(payload(5, 1000))
    assert store.usage()["bytes"] == record.SMALL_HEADER + 1000


def test_large_records_round_trip_in_batches(remote):
    # 1 MiB records: Redis sends these one command each rather than pipelined.
    size = 1 << 20
    store = remote.open().open_store(new_namespace(), {}, size)
    assert store.put_many([(f"L{i}", payload(30 + i, size)) for i in range(3)]) == [record.ALIGNED_HEADER + size] * 3
    outs = [out_buffer(size) for _ in range(4)]
    assert store.get_many(["L0", "L1", "L2", "L3"], outs) == [GetStatus.LOADED] * 3 + [GetStatus.MISS]
    assert [bytes(o) for o in outs[:3]] == [bytes(payload(30 + i, size)) for i in range(3)]
    assert store.delete_many(["L0", "L1", "L2"]) == 3


@needs_mooncake
def test_mooncake_registered_buffers_move_without_a_copy(mooncake_master):
    backend = open_remote(mooncake_master.url(segment="64MiB"))
    try:
        store = backend.open_store(new_namespace(), {}, RECORD_BYTES)
        staging = np.zeros(4 * RECORD_BYTES, dtype=np.uint8)  # stands in for the daemon's staging pool
        view = memoryview(staging)
        view[:RECORD_BYTES] = payload(6)
        backend.probe()
        backend.register_buffer(staging)
        store.put("zc", view[:RECORD_BYTES])
        assert store.get_into("zc", view[RECORD_BYTES:2 * RECORD_BYTES]) is GetStatus.LOADED
        assert bytes(view[RECORD_BYTES:2 * RECORD_BYTES]) == bytes(payload(6))
        assert (store.direct_puts, store.direct_gets) == (1, 1)
        out = out_buffer()  # not registered: bounced through the namespace's slots
        assert store.get_into("zc", out) is GetStatus.LOADED and bytes(out) == bytes(payload(6))
        assert store.direct_gets == 1
    finally:
        backend.close()


@needs_mooncake
def test_mooncake_threads_share_few_slots(mooncake_master):
    backend = open_remote(mooncake_master.url(segment="64MiB", slots=2))
    try:
        store = backend.open_store(new_namespace(), {}, RECORD_BYTES)
        errors = []

        def worker(t: int) -> None:
            try:
                for i in range(8):
                    key, seed = f"t{t}-{i}", 100 * t + i
                    store.put_many([(key, payload(seed)), (key + "b", payload(seed + 50))])
                    outs = [out_buffer(), out_buffer()]
                    assert store.get_many([key, key + "b"], outs) == [GetStatus.LOADED] * 2
                    assert bytes(outs[0]) == bytes(payload(seed)) and bytes(outs[1]) == bytes(payload(seed + 50))
            except BaseException as exc:  # reported below
                errors.append(exc)
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        assert store._free.qsize() == 2  # every slot came back
        assert store.contains_prefix([f"t{t}-{i}" for t in range(4) for i in range(8)]) == 32
    finally:
        backend.close()


@needs_mooncake
def test_mooncake_full_pool_is_no_space_not_unhealthy(tmp_path):
    master = MooncakeMaster(tmp_path).start()  # its own pool: only this client's 16 MiB in it
    backend = open_remote(master.url(segment="16MiB"))
    try:
        store = backend.open_store(new_namespace(), {}, 1 << 20)
        with pytest.raises(NoSpace):
            for i in range(40):  # 40 MiB into a 16 MiB pool
                store.put(f"n{i}", payload(i, 1 << 20))
        assert backend.healthy and backend.failures == 0
    finally:
        backend.close()
        master.kill()


# -- the server killed mid-run, then restarted ------------------------------------------------


def _fresh_server(kind: str, tmp_path: Path, port: int | None = None):
    reason = redis_skip_reason() if kind == "redis" else mooncake_skip_reason()
    if reason:
        pytest.skip(reason)
    return RedisServer(tmp_path, port) if kind == "redis" else MooncakeMaster(tmp_path, port)


def _url(kind: str, server) -> str:
    return server.url + "?timeout=2&connect_timeout=0.5" if kind == "redis" else server.url(
        segment="32MiB", timeout=2, connect_timeout=0.5)


@pytest.mark.parametrize("kind", ["redis", "mooncake"])
def test_killed_server_makes_the_tier_unavailable_until_it_returns(kind, tmp_path):
    server = _fresh_server(kind, tmp_path).start()
    clock = FakeClock()
    backend = open_remote(_url(kind, server), backoff_initial_s=1.0, backoff_max_s=8.0, clock=clock)
    try:
        store = backend.open_store(new_namespace(), {}, RECORD_BYTES)
        store.put("before", payload(7))
        assert backend.healthy and backend.failures == 0

        server.kill()
        with pytest.raises(Unavailable):
            for i in range(3):  # a write must reach the server; the first one that cannot fails
                store.put(f"during{i}", payload(8))
        assert not backend.healthy and backend.failures >= 1
        probes = backend.gate.probes
        for op in (lambda: store.get_into("before", out_buffer()), lambda: store.put("x", payload(9)),
                   lambda: store.contains_prefix(["before"]), lambda: store.delete("before"), store.clear):
            with pytest.raises(Unavailable):
                op()
        assert backend.gate.probes == probes  # refused at the gate: nothing waited on a socket

        clock.advance(1.0)
        with pytest.raises(Unavailable):  # due: one probe, the server is still down
            store.put("x", payload(9))
        assert backend.gate.probes == probes + 1 and backend.gate.retry_in_s == 2.0  # backoff doubled

        server.start()

        def put_works() -> bool:
            clock.advance(8.0)
            try:
                store.put("after", payload(10))
                return True
            except (Unavailable, NoSpace):  # Mooncake: the segment is remounted a moment later
                return False
        assert wait_until(put_works, timeout=30, interval=0.2)
        assert backend.healthy and backend.reconnects >= 1
        out = out_buffer()
        assert store.get_into("after", out) is GetStatus.LOADED and bytes(out) == bytes(payload(10))
        # Neither server persisted anything here: what was stored before the crash is gone.
        assert store.get_into("before", out_buffer()) is GetStatus.MISS
    finally:
        backend.close()
        server.kill()


@pytest.mark.parametrize("kind", ["redis", "mooncake"])
def test_tier_starts_while_the_server_is_down(kind, tmp_path):
    port = free_port()
    clock = FakeClock()
    server = _fresh_server(kind, tmp_path, port)
    backend = open_remote(_url(kind, server), backoff_initial_s=1.0, clock=clock)
    try:
        assert not backend.healthy and backend.gate.probes == 0  # nothing connects at construction
        store = backend.open_store(new_namespace(), {}, RECORD_BYTES)
        with pytest.raises(Unavailable):
            store.put("k", payload(11))
        assert backend.probe() is False and backend.gate.probes == 1  # backoff: check did not probe
        server.start()
        clock.advance(1.0)
        assert backend.probe() is True and backend.reconnects == 0
        store.put("k", payload(11))
        out = out_buffer()
        assert store.get_into("k", out) is GetStatus.LOADED and bytes(out) == bytes(payload(11))
    finally:
        backend.close()
        server.kill()


@needs_redis
def test_redis_refusal_is_an_io_error_not_an_outage(redis_server):
    raw = redis_server.raw()
    backend = open_remote(redis_server.url)
    try:
        store = backend.open_store(new_namespace(), {}, RECORD_BYTES)
        store.put("k", payload(12))
        raw.config_set("maxmemory", "1")  # every write is refused with OOM
        try:
            with pytest.raises(NoSpace):
                store.put("k2", payload(13))
        finally:
            raw.config_set("maxmemory", "0")
        raw.rename(remote_key(store.namespace, "k"), "elsewhere")
        raw.lpush(remote_key(store.namespace, "k"), b"x")  # a list where a string should be
        with pytest.raises(IOFailure):
            store.get_into("k", out_buffer())
        assert backend.healthy and backend.failures == 0
    finally:
        backend.close()
