"""Daemon-to-daemon transfer for prefill/decode disaggregation, through real daemons on loopback.

A prefill daemon (A) holds what its engine swapped out; a decode daemon (B) pulls it with
``lookup(keys, peer=A)`` and its engine loads it with an ordinary swap_in, byte for byte. Both
transports (Mooncake's transfer engine and inline), the ordering case (the decode asks before the
prefill's swap_out), the pool on the decode side (up and down), a prefill killed before and in
the middle of a transfer, and peers that lie: a fake exporter on a ZMQ socket answering with bad
sizes, extra records, bad checksums and garbage; an importer that never releases its lease.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import msgpack
import pytest
import zmq

from kvswap.backends import record
from kvswap.protocol import CacheLayout, Client, HostKVCache
from kvswap.protocol import messages as m
from kvswap.testing.remote_servers import RedisServer, redis_skip_reason

from support import DaemonProcess, free_port, wait_until

LAYOUT = CacheLayout("pd-peer", num_layers=2, num_blocks=32, block_size=16, num_kv_heads=2, head_dim=64)
KEYS = [f"turn1-{i}" for i in range(8)]


def transfer_engine_reason() -> str:
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as exc:
        return f"mooncake.engine does not import: {exc}"
    return ""


TRANSPORTS = ["inline", pytest.param("mooncake", marks=pytest.mark.skipif(
    bool(transfer_engine_reason()), reason=transfer_engine_reason() or "transfer engine"))]


def peer_daemon(tmp_path: Path, name: str, *args: str, transport: str = "inline") -> DaemonProcess:
    port = free_port()
    return DaemonProcess(tmp_path / name, port, free_port(), extra_args=[
        "--peer-address", f"tcp://127.0.0.1:{port}", "--peer-transport", transport, "--host-tier-bytes", "16M",
        *args]).start()


def peer_address(daemon: DaemonProcess) -> str:
    return f"tcp://127.0.0.1:{daemon.port}"


class Pair:
    """A prefill daemon and a decode daemon, each with a registered engine cache."""

    def __init__(self, prefill: DaemonProcess, decode: DaemonProcess) -> None:
        self.prefill, self.decode = prefill, decode
        self.prefill_cache = HostKVCache.create(LAYOUT)
        self.decode_cache = HostKVCache.create(LAYOUT)
        self.prefill_cache.fill_random(7)
        self.a = Client(prefill.endpoint, timeout=10)
        self.b = Client(decode.endpoint, timeout=10)
        self.namespace = self.a.register(self.prefill_cache)["namespace"]
        assert self.b.register(self.decode_cache)["namespace"] == self.namespace

    def expected(self, n: int = len(KEYS)) -> list[bytes]:
        return [self.prefill_cache.block_record(b) for b in range(n)]

    def loaded(self, keys: list[str], first_block: int = 16) -> list[bytes]:
        result = self.b.swap_in(keys, list(range(first_block, first_block + len(keys))))
        assert result.loaded == len(keys), result.status
        return [self.decode_cache.block_record(first_block + i) for i in range(len(keys))]

    def close(self) -> None:
        for c in (self.a, self.b):
            c.close()
        self.prefill_cache.close()
        self.decode_cache.close()


@pytest.fixture
def pair_of(tmp_path: Path) -> Iterator[Callable[..., Pair]]:
    made: list[tuple[Pair, list[DaemonProcess]]] = []

    def make(transport: str = "inline", prefill_args: tuple[str, ...] = (),
             decode_args: tuple[str, ...] = ()) -> Pair:
        prefill = peer_daemon(tmp_path, "prefill", *prefill_args, transport=transport)
        decode = peer_daemon(tmp_path, "decode", *decode_args, transport=transport)
        pair = Pair(prefill, decode)
        made.append((pair, [prefill, decode]))
        return pair

    yield make
    for pair, daemons in made:
        pair.close()
        for d in daemons:
            if d.alive:
                assert d.stop() == 0, d.log()[-3000:]


# -- the pull itself --------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_decode_pulls_the_prefills_records_and_loads_them_byte_for_byte(pair_of, transport: str) -> None:
    pair = pair_of(transport)
    assert pair.a.hello()["peer"] == {"address": peer_address(pair.prefill), "transport": transport,
                                      "pd_role": "none"}
    pair.a.swap_out(list(range(8)), KEYS, wait="persisted")
    assert pair.b.lookup(KEYS) == 0  # nothing here before the pull

    reply = pair.b.call(m.Lookup, {"keys": KEYS + ["never-stored"], "peer": peer_address(pair.prefill)})
    assert reply == {"hits": 8, "pulled": 8}
    assert pair.loaded(KEYS) == pair.expected()

    decode_peer, prefill_peer = pair.b.stats()["peer"], pair.a.stats()["peer"]
    assert decode_peer["pulled_records"] == 8
    assert decode_peer["pulled_bytes"] == 8 * LAYOUT.record_bytes
    assert decode_peer["pull_failures"] == {}
    assert prefill_peer["exported_records"] == 8
    assert prefill_peer["leases"] == 0 and prefill_peer["export_buffer"]["used_bytes"] == 0  # released
    assert pair.decode.metric("kvswap_peer_pulled_records_total") == 8
    assert pair.prefill.metric("kvswap_peer_exports_total", transport=transport) == 1

    # A second lookup finds them here: nothing is pulled again.
    assert pair.b.call(m.Lookup, {"keys": KEYS, "peer": peer_address(pair.prefill)}) == {"hits": 8, "pulled": 0}
    assert pair.a.stats()["peer"]["exported_records"] == 8


def test_pull_goes_on_past_what_one_inline_reply_carries(pair_of) -> None:
    """Records of 256 KiB: an inline reply holds 15 of them, so 24 take two round trips."""
    big = CacheLayout("pd-big", num_layers=2, num_blocks=32, block_size=256, num_kv_heads=2, head_dim=64)
    pair = pair_of("inline")
    keys = [f"big-{i}" for i in range(24)]
    with HostKVCache.create(big) as a_cache, HostKVCache.create(big) as b_cache:
        a_cache.fill_random(3)
        pair.a.register(a_cache)
        pair.b.register(b_cache)
        pair.a.swap_out(list(range(24)), keys, wait="persisted")
        assert pair.b.lookup(keys, peer=peer_address(pair.prefill)) == 24
        assert pair.b.swap_in(keys, list(range(24))).loaded == 24
        assert [b_cache.block_record(i) for i in range(24)] == [a_cache.block_record(i) for i in range(24)]
    assert pair.a.stats()["peer"]["exports"] == 2


def test_lookup_with_peer_on_a_daemon_without_peer_transfer_is_a_typed_error(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path / "plain", free_port(), free_port()).start()
    try:
        with Client(daemon.endpoint, timeout=5) as c, HostKVCache.create(LAYOUT) as cache:
            c.register(cache)
            assert "peer" not in c.hello()
            with pytest.raises(Exception) as info:
                c.lookup(KEYS, peer="tcp://127.0.0.1:1")
            assert getattr(info.value, "code", "") == "bad_request"
            assert info.value.details["reason"] == "peer_transfer_off"
            with pytest.raises(Exception) as info:
                c.call(m.PeerExport, {"keys": KEYS, "namespace": "0" * 32})
            assert info.value.details["reason"] == "peer_transfer_off"
            assert c.ping() >= 0
    finally:
        assert daemon.stop() == 0


# -- ordering: the decode asks before the prefill's KV landed ---------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_lookup_sent_before_the_swap_out_loads_everything(pair_of, transport: str) -> None:
    pair = pair_of(transport)
    answers: list[Any] = []

    def ask() -> None:
        with Client(pair.decode.endpoint, timeout=20) as c:
            answers.append(c.call(m.Lookup, {"keys": KEYS, "peer": peer_address(pair.prefill), "wait_ms": 15000},
                                  timeout=20))

    asker = threading.Thread(target=ask)
    asker.start()
    # The prefill daemon is waiting for the keys (the peer_export is in flight there) ...
    assert wait_until(lambda: pair.prefill.metric("kvswap_requests_in_flight") >= 1, 10)
    pair.a.swap_out(list(range(8)), KEYS)  # ... and only now its engine saves them
    asker.join(20)
    assert answers == [{"hits": 8, "pulled": 8}]
    assert pair.loaded(KEYS) == pair.expected()


def test_keys_that_never_arrive_answer_the_local_prefix_when_the_wait_ends(pair_of) -> None:
    pair = pair_of("inline")
    pair.decode_cache.fill_random(9)
    pair.b.swap_out([0, 1], KEYS[:2], wait="persisted")  # the decode node has the first two itself
    started = time.monotonic()
    reply = pair.b.call(m.Lookup, {"keys": KEYS, "peer": peer_address(pair.prefill), "wait_ms": 600}, timeout=10)
    elapsed = time.monotonic() - started
    assert reply == {"hits": 2, "pulled": 0}
    assert 0.6 <= elapsed < 5, elapsed
    # Without a peer, wait_ms waits for this daemon's own arrivals: none come, the prefix stands.
    started = time.monotonic()
    assert pair.b.lookup(KEYS, wait_ms=300) == 2
    assert time.monotonic() - started >= 0.3


def test_concurrent_lookups_of_the_same_keys_share_one_pull(pair_of) -> None:
    pair = pair_of("inline")
    answers: list[Any] = []

    def ask() -> None:
        with Client(pair.decode.endpoint, timeout=20) as c:
            answers.append(c.lookup(KEYS, peer=peer_address(pair.prefill), wait_ms=15000, timeout=20))

    askers = [threading.Thread(target=ask) for _ in range(3)]
    for t in askers:
        t.start()
    assert wait_until(lambda: pair.decode.metric("kvswap_requests_in_flight") >= 3, 10)
    pair.a.swap_out(list(range(8)), KEYS)
    for t in askers:
        t.join(20)
    assert answers == [8, 8, 8]
    assert pair.a.stats()["peer"]["exported_records"] == 8  # asked for once, not three times


# -- the pool on the decode side ----------------------------------------------------------------


@pytest.mark.skipif(bool(redis_skip_reason()), reason=redis_skip_reason() or "redis")
def test_pulled_records_reach_the_pool_and_a_down_pool_holds_nothing_up(pair_of, tmp_path: Path) -> None:
    redis = RedisServer(tmp_path).start()
    try:
        # The prefill as deployed: it stores to RAM and retrieves from the pool alone, and still
        # exports what its engine stored.
        pair = pair_of("inline", prefill_args=("--remote-url", redis.url, "--store-locations", "host",
                                               "--retrieve-locations", "remote", "--pd-role", "prefill"),
                       decode_args=("--remote-url", redis.url, "--store-locations", "host,remote",
                                    "--retrieve-locations", "host,remote", "--pd-role", "decode",
                                    "--remote-check-interval-s", "0.2"))
        pair.a.swap_out(list(range(8)), KEYS, wait="persisted")
        assert pair.b.lookup(KEYS, peer=peer_address(pair.prefill)) == 8
        assert pair.b.hello()["peer"]["pd_role"] == "decode"
        # The next turn's prefill reads them from the pool: a third daemon that only retrieves there.
        reader = DaemonProcess(tmp_path / "next-prefill", free_port(), free_port(), extra_args=[
            "--remote-url", redis.url, "--host-tier-bytes", "0", "--store-locations", "remote",
            "--retrieve-locations", "remote"]).start()
        try:
            with Client(reader.endpoint, timeout=10) as c, HostKVCache.create(LAYOUT) as cache:
                c.register(cache)
                assert wait_until(lambda: c.lookup(KEYS) == 8, 10)
                assert c.swap_in(KEYS, list(range(8))).loaded == 8
                assert [cache.block_record(b) for b in range(8)] == pair.expected()
        finally:
            assert reader.stop() == 0

        redis.stop()
        more = [f"turn2-{i}" for i in range(4)]
        pair.a.swap_out(list(range(8, 12)), more, wait="persisted")
        started = time.monotonic()
        assert pair.b.lookup(KEYS + more, peer=peer_address(pair.prefill)) == 12
        assert time.monotonic() - started < 5
        assert pair.loaded(more) == [pair.prefill_cache.block_record(b) for b in range(8, 12)]
        # The pool's failures are counted, and the daemon serves on.
        assert wait_until(lambda: pair.decode.metric("kvswap_tier_ops_total", tier="remote", op="put",
                                                     result="unavailable") >= 1
                          or pair.decode.metric_sum("kvswap_write_failures_total") >= 1, 10)
        assert pair.b.ping() >= 0
    finally:
        redis.stop()


# -- the prefill daemon dies ----------------------------------------------------------------------


def test_a_killed_prefill_is_a_miss_and_the_decode_serves_on(pair_of) -> None:
    pair = pair_of("inline")
    pair.decode_cache.fill_random(5)
    pair.b.swap_out([0], KEYS[:1], wait="persisted")
    pair.prefill.kill()
    started = time.monotonic()
    assert pair.b.call(m.Lookup, {"keys": KEYS, "peer": peer_address(pair.prefill), "wait_ms": 200},
                       timeout=4) == {"hits": 1, "pulled": 0}
    assert time.monotonic() - started < 4
    assert sum(pair.b.stats()["peer"]["pull_failures"].values()) == 1
    assert pair.b.lookup(KEYS) == 1  # nothing half stored
    assert pair.b.ping() >= 0


class Relay:
    """A ROUTER between the decode daemon and the real prefill daemon: forwards each request and
    calls ``on_reply(frames)`` before handing the prefill's reply back (the seam where a test
    kills the prefill between its export and the decode's read), or answers with ``fake``."""

    def __init__(self, upstream: str | None = None, fake: Callable[[dict], bytes | None] | None = None,
                 on_reply: Callable[[], None] | None = None) -> None:
        self.port = free_port()
        self.upstream, self.fake, self.on_reply = upstream, fake, on_reply
        self.requests: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._ready = threading.Event()
        self._thread.start()
        assert self._ready.wait(5)

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        ctx = zmq.Context()
        front = ctx.socket(zmq.ROUTER)
        front.bind(self.address)
        back = None
        if self.upstream:
            back = ctx.socket(zmq.DEALER)
            back.connect(self.upstream)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not front.poll(50):
                    continue
                frames = front.recv_multipart()
                request = msgpack.unpackb(frames[-1], raw=False)
                self.requests.append(request)
                if self.fake is not None:
                    body = self.fake(request)
                    if body is not None:
                        front.send_multipart([*frames[:-1], body])
                    continue
                assert back is not None
                back.send(frames[-1])
                if request.get("op") != "peer_export":
                    continue  # peer_release: no answer is waited for
                if back.poll(10_000):
                    reply = back.recv()
                    if self.on_reply is not None:
                        self.on_reply()
                    front.send_multipart([*frames[:-1], reply])
        finally:
            front.close(0)
            if back is not None:
                back.close(0)
            ctx.term()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.mark.skipif(bool(transfer_engine_reason()), reason=transfer_engine_reason() or "transfer engine")
def test_prefill_killed_between_export_and_read_is_a_miss_never_a_torn_record(pair_of) -> None:
    pair = pair_of("mooncake")
    pair.a.swap_out(list(range(8)), KEYS, wait="persisted")
    relay = Relay(upstream=pair.prefill.endpoint, on_reply=pair.prefill.kill)
    try:
        # wait_ms sets how long the export may take to answer (wait_ms + 1 s, peer_import.py):
        # with 100 ms, a prefill slowed by other work beside the tests answered after 1.1 s, and
        # the pull failed as a timeout before any transfer was tried.
        reply = pair.b.call(m.Lookup, {"keys": KEYS, "peer": relay.address, "wait_ms": 2000}, timeout=8)
    finally:
        relay.close()
    assert reply == {"hits": 0, "pulled": 0}
    assert pair.b.stats()["peer"]["pull_failures"] == {"transfer": 1}
    assert pair.b.lookup(KEYS) == 0
    assert pair.b.swap_in(KEYS, list(range(8))).loaded == 0
    assert pair.b.ping() >= 0


# -- hostile peers -------------------------------------------------------------------------------


def _good_record(namespace: str, key: str, payload: bytes) -> dict[str, Any]:
    header = record.encode_header(bytes.fromhex(namespace), key, len(payload), record.payload_checksum(payload))
    return {"key": key, "header": header[:record.HEADER_CORE_BYTES], "data": payload}


def _reply(request: dict, result: dict) -> bytes:
    return msgpack.packb({"v": 1, "id": request["id"], "ok": True, "result": result}, use_bin_type=True)


def _lies(namespace: str) -> dict[str, Callable[[dict], bytes | None]]:
    size = LAYOUT.record_bytes

    def records(request: dict, n: int | None = None, **change: Any) -> list[dict[str, Any]]:
        keys = request["keys"] if n is None else (request["keys"] * 2)[:n]
        out = [_good_record(namespace, k, bytes([i]) * size) for i, k in enumerate(keys)]
        for r in out:
            r.update(change)
        return out

    def bad_checksum(request: dict) -> bytes:
        out = records(request)
        for r in out:
            r["data"] = bytes(reversed(r["data"][:-1])) + b"\x01"
        return _reply(request, {"transport": "inline", "records": out})

    return {
        "short_records": lambda r: _reply(r, {"transport": "inline", "records": records(r, data=b"\0" * (size - 1))}),
        "long_records": lambda r: _reply(r, {"transport": "inline", "records": records(r, data=b"\0" * (size + 1))}),
        "more_than_asked": lambda r: _reply(r, {"transport": "inline", "records": records(r, n=len(r["keys"]) + 3)}),
        "other_keys": lambda r: _reply(r, {"transport": "inline", "records": records(r, key="someone-else")}),
        "bad_checksums": bad_checksum,
        "header_of_another_namespace": lambda r: _reply(r, {"transport": "inline", "records": [
            _good_record("f" * 32, k, b"\0" * size) for k in r["keys"]]}),
        "garbage": lambda r: b"\xc1 not msgpack",
        "not_a_map": lambda r: msgpack.packb([1, 2, 3]),
        "records_not_maps": lambda r: _reply(r, {"transport": "inline", "records": [7] * len(r["keys"])}),
        "wrong_id": lambda r: msgpack.packb({"v": 1, "id": r["id"] + 1, "ok": True, "result": {}}),
        "foreign_segment": lambda r: _reply(r, {"transport": "mooncake", "segment": "10.9.9.9:1", "lease": "x",
                                                "records": [{"key": k, "header": b"\0" * 196, "addr": 0,
                                                             "length": size} for k in r["keys"]]}),
        "silence": lambda r: None,
    }


@pytest.mark.parametrize("lie", sorted(_lies("0" * 32)))
def test_a_lying_exporter_gets_nothing_stored_and_the_decode_serves_on(tmp_path: Path, lie: str) -> None:
    decode = peer_daemon(tmp_path, "decode")
    try:
        with Client(decode.endpoint, timeout=10) as b, HostKVCache.create(LAYOUT) as cache:
            namespace = b.register(cache)["namespace"]
            fake = Relay(fake=_lies(namespace)[lie])
            try:
                reply = b.call(m.Lookup, {"keys": KEYS, "peer": fake.address, "wait_ms": 50}, timeout=3)
            finally:
                fake.close()
            assert reply == {"hits": 0, "pulled": 0}
            assert fake.requests and fake.requests[0]["op"] == "peer_export"
            assert fake.requests[0]["namespace"] == namespace
            assert b.lookup(KEYS) == 0  # nothing of it was stored
            assert b.swap_in(KEYS, list(range(8))).loaded == 0
            assert sum(b.stats()["peer"]["pull_failures"].values()) == 1
            assert b.ping() >= 0
    finally:
        assert decode.stop() == 0


def test_a_bad_record_ends_the_prefix_and_the_good_ones_before_it_count(tmp_path: Path) -> None:
    decode = peer_daemon(tmp_path, "decode")
    size = LAYOUT.record_bytes
    try:
        with Client(decode.endpoint, timeout=10) as b, HostKVCache.create(LAYOUT) as cache:
            namespace = b.register(cache)["namespace"]

            def third_is_bad(request: dict) -> bytes:
                out = [_good_record(namespace, k, bytes([i + 1]) * size) for i, k in enumerate(request["keys"])]
                out[2]["data"] = b"\x77" * size
                return _reply(request, {"transport": "inline", "records": out})

            fake = Relay(fake=third_is_bad)
            try:
                assert b.lookup(KEYS, peer=fake.address, wait_ms=50, timeout=3) == 2
            finally:
                fake.close()
            assert b.stats()["peer"]["pull_failures"] == {"corrupt": 1}
            assert b.swap_in(KEYS[:2], [0, 1]).loaded == 2
            assert [cache.block_record(i) for i in range(2)] == [bytes([1]) * size, bytes([2]) * size]
            assert b.lookup(KEYS) == 2
    finally:
        assert decode.stop() == 0


@pytest.mark.skipif(bool(transfer_engine_reason()), reason=transfer_engine_reason() or "transfer engine")
def test_an_importer_that_never_releases_loses_its_lease_and_the_memory_comes_back(pair_of) -> None:
    pair = pair_of("mooncake", prefill_args=("--peer-lease-s", "0.5", "--peer-export-bytes", "1M"))
    pair.a.swap_out(list(range(8)), KEYS, wait="persisted")
    # A raw client asks for the records by the transfer engine and never reads or releases them.
    held = pair.a.call(m.PeerExport, {"keys": KEYS, "namespace": pair.namespace, "transport": "mooncake"})
    assert held["transport"] == "mooncake" and len(held["records"]) == 8 and held["lease"]
    peer = pair.a.stats()["peer"]
    assert peer["leases"] == 1 and peer["export_buffer"]["used_bytes"] == 8 * LAYOUT.record_bytes
    assert wait_until(lambda: pair.a.stats()["peer"]["leases_expired"] == 1, 10)
    peer = pair.a.stats()["peer"]
    assert peer["leases"] == 0 and peer["export_buffer"]["used_bytes"] == 0
    assert pair.prefill.metric("kvswap_peer_leases_expired_total") == 1
    assert pair.a.call(m.PeerRelease, {"lease": held["lease"]}) == {"released": False}

    # The buffer (1 MiB: 64 slots of 16 KiB) full of unreleased leases answers busy, then serves again.
    for _ in range(8):
        pair.a.call(m.PeerExport, {"keys": KEYS, "namespace": pair.namespace, "transport": "mooncake"})
    with pytest.raises(Exception) as info:
        pair.a.call(m.PeerExport, {"keys": KEYS, "namespace": pair.namespace, "transport": "mooncake"})
    assert getattr(info.value, "code", "") == "busy"
    assert wait_until(lambda: pair.a.stats()["peer"]["export_buffer"]["used_bytes"] == 0, 10)
    assert pair.b.lookup(KEYS, peer=peer_address(pair.prefill)) == 8


def test_an_export_of_another_namespace_is_refused(pair_of) -> None:
    pair = pair_of("inline")
    with pytest.raises(Exception) as info:
        pair.b.call(m.PeerExport, {"keys": KEYS, "namespace": "a" * 32})
    assert getattr(info.value, "code", "") == "bad_request"
    assert info.value.details["field"] == "namespace"


# -- start-up validation ---------------------------------------------------------------------------


@pytest.mark.parametrize("args, words", [
    (["--pd-role", "prefill"], "pd_role prefill needs --peer-address"),
    (["--pd-role", "decode"], "pd_role decode needs --peer-address"),
    (["--pd-role", "prefill", "--peer-address", "tcp://127.0.0.1:55500"],
     "a prefill that retrieves nothing from the pool"),
    (["--pd-role", "decode", "--peer-address", "tcp://127.0.0.1:55500"], "a decode node that stores nowhere"),
    (["--pd-role", "decode", "--peer-address", "tcp://127.0.0.1:55500", "--remote-url", "redis://127.0.0.1:1/0",
      "--store-locations", "host"], "remote among the store locations"),
    (["--peer-address", "tcp://0.0.0.0:55500"], "names every interface"),
    (["--peer-address", "10.0.0.5:55500"], "must be tcp://HOST:PORT"),
])
def test_pd_role_and_peer_address_are_checked_at_start_up(tmp_path: Path, args: list[str], words: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvswap.daemon", "--storage-dir", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr


def test_a_prefill_with_the_pool_among_its_retrieve_locations_starts(tmp_path: Path) -> None:
    port = free_port()
    daemon = DaemonProcess(tmp_path / "prefill", port, free_port(), extra_args=[
        "--peer-address", f"tcp://127.0.0.1:{port}", "--peer-transport", "inline", "--pd-role", "prefill",
        "--remote-url", "redis://127.0.0.1:1/0", "--retrieve-locations", "host,remote",
        "--ready-when-degraded"]).start()
    try:
        with Client(daemon.endpoint, timeout=5) as c:
            assert c.hello()["peer"]["pd_role"] == "prefill"
    finally:
        assert daemon.stop(signal.SIGTERM) == 0


# -- CURVE between daemons -------------------------------------------------------------------------


def test_daemons_pull_over_curve_and_an_unauthorized_daemon_gets_nothing(tmp_path: Path) -> None:
    import shutil

    from kvswap.daemon.tools.keygen import write_keypair

    made = tmp_path / "keys"
    for name in ("prefill", "decode", "stranger", "engine"):
        write_keypair(str(made), name)

    def authorized(name: str, *who: str) -> Path:
        d = tmp_path / f"authorized-{name}"
        d.mkdir(mode=0o700)
        for w in who:
            shutil.copy(made / f"{w}.key", d / f"{w}.key")
        return d

    engine = {"curve_secret_key_file": str(made / "engine.key_secret")}

    def curve_daemon(name: str, *admits: str) -> DaemonProcess:
        port = free_port()
        return DaemonProcess(tmp_path / name, port, free_port(), extra_args=[
            "--peer-address", f"tcp://127.0.0.1:{port}", "--peer-transport", "inline", "--host-tier-bytes", "16M",
            "--curve-secret-key-file", str(made / f"{name}.key_secret"),
            "--authorized-keys", str(authorized(name, "engine", *admits)),
            "--peer-server-key-file", str(made / "prefill.key")],
            client_options={**engine, "curve_server_key_file": str(made / f"{name}.key")}).start()

    prefill = curve_daemon("prefill", "decode")  # admits its engine and the decode daemon
    decode = curve_daemon("decode")
    stranger = curve_daemon("stranger")  # a daemon the prefill does not admit
    try:
        with HostKVCache.create(LAYOUT) as a_cache, HostKVCache.create(LAYOUT) as b_cache, \
                HostKVCache.create(LAYOUT) as s_cache, \
                Client(prefill.endpoint, timeout=10, **prefill.client_options) as a, \
                Client(decode.endpoint, timeout=10, **decode.client_options) as b, \
                Client(stranger.endpoint, timeout=10, **stranger.client_options) as s:
            a_cache.fill_random(4)
            a.register(a_cache)
            b.register(b_cache)
            s.register(s_cache)
            a.swap_out(list(range(8)), KEYS, wait="persisted")
            assert b.lookup(KEYS, peer=peer_address(prefill)) == 8
            assert b.swap_in(KEYS, list(range(8))).loaded == 8
            assert [b_cache.block_record(i) for i in range(8)] == [a_cache.block_record(i) for i in range(8)]
            assert s.lookup(KEYS, peer=peer_address(prefill), timeout=3) == 0
            assert sum(s.stats()["peer"]["pull_failures"].values()) == 1
            assert prefill.metric("kvswap_auth_denied_total") >= 1
    finally:
        for d in (prefill, decode, stranger):
            assert d.stop() == 0


def test_a_wait_longer_than_the_deadline_answers_at_the_deadline_not_timeout(pair_of) -> None:
    pair = pair_of("inline")
    started = time.monotonic()
    assert pair.b.lookup(KEYS, peer=peer_address(pair.prefill), wait_ms=60_000, timeout=1.0) == 0
    assert time.monotonic() - started < 1.5
    assert pair.b.ping() >= 0


def test_at_most_64_requests_wait_for_records_and_one_more_answers_at_once(pair_of) -> None:
    from kvswap.daemon.peer_arrivals import MAX_WAITERS

    pair = pair_of("inline")
    with Client(pair.decode.endpoint, timeout=30) as c:
        # MAX_WAITERS lookups wait for keys of this daemon's own that are not here yet ...
        waiting = [c.send(m.Lookup, {"keys": KEYS, "wait_ms": 20000}, timeout=30) for _ in range(MAX_WAITERS)]
        assert wait_until(lambda: pair.b.stats()["waiting"]["now"] == MAX_WAITERS, 20)
        # ... so one more looks once and answers, while they still wait.
        assert pair.b.lookup(KEYS, wait_ms=20000) == 0
        assert pair.b.stats()["waiting"] == {"now": MAX_WAITERS, "refused": 1}
        pair.decode_cache.fill_random(4)
        pair.b.swap_out(list(range(8)), KEYS)  # the keys arrive: every waiter answers them
        assert [c.wait(i)["hits"] for i in waiting] == [8] * MAX_WAITERS
    assert pair.b.stats()["waiting"] == {"now": 0, "refused": 1}
