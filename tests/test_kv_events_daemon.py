"""KV events through real daemons: a subscriber that joins late (through replay) rebuilds, from
events alone, the keys each tier holds, and after churn (swap_outs past the RAM and file caps,
deletes, a corrupt record, clear, gc, a restart) it equals each tier's own index key for key,
and what ``lookup`` finds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import zmq

from kvswap.backends import record
from kvswap.backends.file_layout import record_name
from kvswap.daemon.kv_events import EventLedger
from kvswap.protocol import CacheLayout, Client, HostKVCache
from kvswap.protocol.kv_events import BlockMeta, BlockStored, END_SEQ, seq_bytes
from kvswap.protocol.kv_events_subscriber import Subscriber

from disk_records import LAYOUTS, record_of
from support import InProcessDaemon, free_port, wait_until

LAYOUT = CacheLayout("events", num_layers=2, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=64)
RECORD = LAYOUT.record_bytes  # 16 KiB
FILE_BYTES = record.header_len_for(RECORD) + RECORD


def _endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def _daemon(store: Path, pub: str, replay: str, **extra: object) -> InProcessDaemon:
    config: dict[str, object] = dict(kv_events_endpoint=pub, kv_events_replay_endpoint=replay,
                                     # RAM: 8 records and the idle staging slots (12), half the file tier.
                                     host_tier_bytes=8 * RECORD, storage_max_bytes=40 * FILE_BYTES,
                                     # Small staging: idle staging slots hold RAM records too.
                                     write_staging_bytes=8 * RECORD, read_staging_bytes=4 * RECORD,
                                     maintenance_interval_s=0.05)
    config.update(extra)
    return InProcessDaemon(store, **config)


def _truth(d: InProcessDaemon, namespace: str, universe: list[str]) -> dict[str, set[str]]:
    """What each tier's own index holds: the RAM tier's table, the file tier's index."""
    tiers = d.daemon.swapper.registrar.namespaces[namespace].stores
    host, file = tiers["host"], tiers["file"]
    return {"kvswap:host": {k for k in universe if host.contains(k)},
            "kvswap:file": {k for k in universe if record_name(k) in file.index}}  # type: ignore[attr-defined]


def _caught_up(condition: Callable[[], bool], sub: Subscriber, timeout: float = 15) -> bool:
    """Whether ``condition`` came to hold within ``timeout``, the subscriber caught up (live and
    replay) before each look."""
    def check() -> bool:
        sub.catch_up()
        return condition()

    return wait_until(check, timeout)


def _matches(sub: Subscriber, d: InProcessDaemon, namespace: str, universe: list[str]) -> bool:
    """The subscriber's view equals every tier's index, once the file tier's start-up scan is
    over (before, its index and the events both lack the records still to be found: an empty
    match that lookup, reading the files, contradicts)."""
    sub.catch_up()
    file = d.daemon.swapper.registrar.namespaces[namespace].stores["file"]
    if not file.scan_complete.is_set():  # type: ignore[attr-defined]
        return False
    truth = _truth(d, namespace, universe)
    return all(sub.view.keys(tier) == keys for tier, keys in truth.items())


def _assert_matches(sub: Subscriber, d: InProcessDaemon, c: Client, namespace: str, universe: list[str]) -> None:
    assert wait_until(lambda: _matches(sub, d, namespace, universe), timeout=15), (
        {tier: sorted(sub.view.keys(tier) ^ keys) for tier, keys in _truth(d, namespace, universe).items()})
    # And what lookup finds, key by key: a key is a hit exactly where some tier's events hold it.
    held = sub.view.keys("kvswap:host") | sub.view.keys("kvswap:file")
    assert {k for k in universe if c.lookup([k]) == 1} == held


def _chains(prefix: str, chains: int, length: int) -> list[list[str]]:
    return [[f"{prefix}{c}-{i}" for i in range(length)] for c in range(chains)]


@pytest.mark.parametrize("file_layout", LAYOUTS)
def test_a_late_subscriber_rebuilds_every_tier_through_churn_and_a_restart(tmp_path: Path, file_layout: str) -> None:
    store = tmp_path / "store"
    pub, replay = _endpoints()
    universe: list[str] = []
    with HostKVCache.create(LAYOUT) as cache:
        cache.fill_random(7)
        with _daemon(store, pub, replay, file_layout=file_layout) as d, Client(d.endpoint, timeout=20) as c:
            namespace = c.register(cache)["namespace"]
            # Past both caps: 10 chains of 8 (80 records; RAM holds at most 20, the file tier 40).
            for chain in _chains("a", 10, 8):
                universe += chain
                c.swap_out(list(range(len(chain))), chain, wait="persisted")
            assert wait_until(lambda: d.daemon.swapper.registrar.namespaces[namespace].stores["file"].usage()["bytes"]
                              <= 40 * FILE_BYTES, timeout=15)
            assert c.delete(universe[72:75]) >= 1  # the newest chain's head: stored in both tiers
            truth = _truth(d, namespace, universe)
            # A corrupt record, read from the file tier (not in RAM): removed on read, and told.
            victim = next(k for k in sorted(truth["kvswap:file"] - truth["kvswap:host"]))
            record_of(store / namespace, victim).write(4096 + 100, b"\xff" * 8)  # payload bytes: the checksum fails
            assert c.swap_in([victim], [60]).status == ["corrupt"]

            # The subscriber joins now, long after the first batches: replay brings them.
            sub = Subscriber(pub, replay, keep_stored=True)
            try:
                sub.join()
                _assert_matches(sub, d, c, namespace, universe)
                assert victim not in sub.view.keys("kvswap:file")
                assert any(isinstance(e, BlockStored) for e in sub.view.stored)

                c.clear()
                _assert_matches(sub, d, c, namespace, universe)
                assert not sub.view.held or not any(sub.view.held.values())
                for chain in _chains("b", 3, 8):
                    universe += chain
                    c.swap_out(list(range(len(chain))), chain, wait="persisted")
                _assert_matches(sub, d, c, namespace, universe)
            finally:
                sub.close()

        # Stopped: gc removes records while no daemon runs; the restart's scan announces the rest.
        done = subprocess.run([sys.executable, "-m", "kvswap.daemon.tools.admin", "gc", str(store), "--max-bytes",
                               str(12 * FILE_BYTES)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        with _daemon(store, pub, replay, file_layout=file_layout) as d, Client(d.endpoint, timeout=20) as c:
            namespace = c.register(cache)["namespace"]
            files = d.daemon.swapper.registrar.namespaces[namespace].stores["file"]
            assert wait_until(lambda: files.scan_complete.is_set(), timeout=15)  # type: ignore[attr-defined]
            sub = Subscriber(pub, replay, keep_stored=True)
            try:
                sub.join()
                _assert_matches(sub, d, c, namespace, universe)
                assert 0 < len(sub.view.keys("kvswap:file")) <= 12
                assert not sub.view.keys("kvswap:host")  # a new process holds nothing in RAM
            finally:
                sub.close()


@pytest.mark.parametrize("file_layout", LAYOUTS)
def test_a_subscriber_across_a_restart_drops_what_the_old_daemon_announced(tmp_path: Path, file_layout: str) -> None:
    store = tmp_path / "store"
    pub, replay = _endpoints()
    with HostKVCache.create(LAYOUT) as cache:
        cache.fill_random(3)
        sub = Subscriber(pub, replay, keep_stored=True)
        try:
            with _daemon(store, pub, replay, file_layout=file_layout) as d, Client(d.endpoint, timeout=20) as c:
                namespace = c.register(cache)["namespace"]
                keys = [f"k{i}" for i in range(6)]
                c.swap_out(list(range(6)), keys, wait="persisted")
                sub.join()
                _assert_matches(sub, d, c, namespace, keys)
                assert sub.view.keys("kvswap:host") == set(keys)
            with _daemon(store, pub, replay, file_layout=file_layout) as d, Client(d.endpoint, timeout=20) as c:
                namespace = c.register(cache)["namespace"]
                _assert_matches(sub, d, c, namespace, keys)
                assert sub.restarts == 1
                assert sub.view.keys("kvswap:host") == set()
                assert sub.view.keys("kvswap:file") == set(keys)
        finally:
            sub.close()


def test_block_meta_names_records_with_the_engine_hashes_and_the_chain_gives_parents(tmp_path: Path) -> None:
    pub, replay = _endpoints()
    hashes = [bytes([i]) * 32 for i in range(4)]
    metas = [BlockMeta((h,), hashes[i - 1] if i else b"\x99" * 32, tuple(range(i * 16, i * 16 + 16)), 16, None)
             for i, h in enumerate(hashes)]
    metas[2] = BlockMeta((hashes[2],), None, (), 0, "adapter")  # no parent sent: the chain's
    with HostKVCache.create(LAYOUT) as cache, _daemon(tmp_path / "s", pub, replay) as d, \
            Client(d.endpoint, timeout=20) as c:
        cache.fill_random(1)
        c.register(cache)
        sub = Subscriber(pub, replay, keep_stored=True)
        try:
            c.swap_out([0, 1, 2, 3, 4], ["m0", "m1", "m2", "m3", "plain"], wait="persisted", block_meta=[*metas, None])
            assert _caught_up(lambda: len(sub.view.stored) >= 10, sub)
            by_tier = {(e.ownership, e.block_hashes): e for e in sub.view.stored}
            for tier in ("kvswap:host", "kvswap:file"):
                first = by_tier[(tier, (hashes[0],))]
                assert first.parent_block_hash == b"\x99" * 32 and first.token_ids == tuple(range(16))
                assert first.block_size == 16 and first.medium == ("CPU" if tier == "kvswap:host" else "STORAGE")
                third = by_tier[(tier, (hashes[2],))]
                assert third.parent_block_hash == hashes[1] and third.lora_name == "adapter"
                assert third.block_size == LAYOUT.block_size  # not sent: the layout's
                plain = by_tier[(tier, (b"plain",))]
                assert plain.parent_block_hash == hashes[3] and plain.token_ids == ()
            c.delete(["m1"])
            assert _caught_up(lambda: hashes[1] not in sub.view.held[("CPU", "kvswap:host")], sub)
            assert hashes[1] not in sub.view.held[("STORAGE", "kvswap:file")]
        finally:
            sub.close()


@pytest.mark.parametrize("file_layout", LAYOUTS)
def test_another_daemons_eviction_in_a_shared_directory_is_found_by_the_rescan_and_told(tmp_path: Path,
                                                                                        file_layout: str) -> None:
    """Daemon B (no RAM tier) holds records that daemon A, the evicting one, removes: B's
    rescan finds them gone and its events say so."""
    store = tmp_path / "shared"
    pub_a, replay_a = _endpoints()
    pub_b, replay_b = _endpoints()
    common = dict(host_tier_bytes=0, storage_rescan_interval_s=0.2, file_layout=file_layout)
    with HostKVCache.create(LAYOUT) as cache:
        cache.fill_random(5)
        with _daemon(store, pub_a, replay_a, storage_max_bytes=0, **common) as a, \
                _daemon(store, pub_b, replay_b, storage_max_bytes=0, **common) as b, \
                Client(a.endpoint, timeout=20) as ca, Client(b.endpoint, timeout=20) as cb:
            ns = ca.register(cache)["namespace"]
            cb.register(cache)
            keys = [f"s{i}" for i in range(8)]
            cb.swap_out(list(range(8)), keys, wait="persisted")
            sub = Subscriber(pub_b, replay_b, keep_stored=True)
            try:
                sub.join()
                assert _caught_up(lambda: sub.view.keys("kvswap:file") == set(keys), sub)
                assert ca.delete(keys[4:]) == 4  # A removes half of B's records
                assert _caught_up(lambda: sub.view.keys("kvswap:file") == set(keys[:4]), sub)
                files = b.daemon.swapper.registrar.namespaces[ns].stores["file"]
                assert {k for k in keys if record_name(k) in files.index} == set(keys[:4])  # type: ignore[attr-defined]
            finally:
                sub.close()


def test_the_replay_socket_ignores_malformed_requests_and_keeps_answering(tmp_path: Path) -> None:
    pub, replay = _endpoints()
    with _daemon(tmp_path / "s", pub, replay) as d:
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(replay)
        try:
            dealer.send_multipart([b"", b"short"])
            dealer.send_multipart([b"", seq_bytes(0), b"extra"])
            dealer.send_multipart([b"x" * 20])
            dealer.send_multipart([b"", seq_bytes(0)])
            assert dealer.poll(10_000)
            frames = dealer.recv_multipart()
            assert frames[2] == seq_bytes(0)  # batch 0: the reset every daemon starts with
            assert dealer.poll(10_000)
            assert dealer.recv_multipart() == [b"", b"", END_SEQ, b""]
            publisher = d.daemon.kv_publisher
            assert publisher is not None
            assert wait_until(lambda: publisher.bad_replays == 3, timeout=10)
            assert publisher.replays == 1
            with Client(d.endpoint, timeout=10) as c:
                stats = c.stats()["kv_events"]
            assert stats["enabled"] and stats["replays"] == 1 and stats["bad_replays"] == 3
            assert stats["endpoint"] == pub and stats["batches"] >= 1
        finally:
            dealer.close(0)
            ctx.term()


@pytest.mark.parametrize("endpoint, message", [
    ("tcp://0.0.0.0:5557", "not a loopback address"),
    ("tcp://10.1.2.3:5557", "not a loopback address"),
    ("tcp://*:5557", "not a loopback address"),
    ("udp://127.0.0.1:1", "must be tcp://"),
    ("tcp://127.0.0.1", "needs a port"),
])
def test_events_endpoints_beyond_loopback_are_refused(endpoint: str, message: str) -> None:
    from kvswap.daemon.config import Config

    with pytest.raises(ValueError, match=message):
        Config(kv_events_endpoint=endpoint).validate()


def test_replay_needs_a_stream_and_its_own_address() -> None:
    from kvswap.daemon.config import Config

    with pytest.raises(ValueError, match="needs kv_events_endpoint"):
        Config(kv_events_replay_endpoint="tcp://127.0.0.1:5558").validate()
    with pytest.raises(ValueError, match="two different addresses"):
        Config(kv_events_endpoint="tcp://127.0.0.1:5558", kv_events_replay_endpoint="tcp://127.0.0.1:5558").validate()
    with pytest.raises(ValueError, match="kv_events_encoding"):
        Config(kv_events_endpoint="ipc:///tmp/x", kv_events_encoding="json").validate()


def test_kvswapd_exits_3_when_the_events_port_is_taken(tmp_path: Path) -> None:
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        done = subprocess.run([sys.executable, "-m", "kvswap.daemon", "--storage-dir", str(tmp_path / "s"),
                               "--cache-queue-port", str(free_port()), "--metrics-port", str(free_port()),
                               "--kv-events-endpoint", f"tcp://127.0.0.1:{port}"],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 3, done.stderr
        assert f"cannot bind the KV events endpoints tcp://127.0.0.1:{port}" in done.stderr
    finally:
        taken.close(0)
        ctx.term()


def test_events_off_costs_no_ledger(tmp_path: Path) -> None:
    with InProcessDaemon(tmp_path / "s", host_tier_bytes=0) as d:
        assert d.daemon.kv_events is None and d.daemon.kv_publisher is None
        assert not d.daemon.swapper.events.enabled
    assert EventLedger.enabled
    assert os.environ.get("KVSWAP_KV_EVENTS_ENDPOINT") is None


def test_the_remote_tier_is_told_apart_as_remote_storage(tmp_path: Path) -> None:
    from kvswap.testing.remote_servers import RedisServer, redis_skip_reason

    if redis_skip_reason():
        pytest.skip(redis_skip_reason())
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis").start()
    pub, replay = _endpoints()
    try:
        with HostKVCache.create(LAYOUT) as cache, \
                _daemon(tmp_path / "s", pub, replay, remote_url=server.url, host_tier_bytes=0) as d, \
                Client(d.endpoint, timeout=20) as c:
            cache.fill_random(2)
            c.register(cache)
            keys = [f"r{i}" for i in range(5)]
            c.swap_out(list(range(5)), keys, wait="persisted")
            sub = Subscriber(pub, replay, keep_stored=True)
            try:
                sub.join()
                assert _caught_up(lambda: sub.view.keys("kvswap:remote") == set(keys), sub)
                assert {e.locality for e in sub.view.stored if e.ownership == "kvswap:remote"} == {"REMOTE"}
                assert {e.medium for e in sub.view.stored if e.ownership == "kvswap:remote"} == {"STORAGE"}
                assert sub.view.keys("kvswap:file") == set(keys)
                c.delete(keys[:2])
                assert _caught_up(lambda: sub.view.keys("kvswap:remote") == set(keys[2:]), sub)
                c.clear()
                assert _caught_up(lambda: not any(sub.view.held.values()), sub)
            finally:
                sub.close()
    finally:
        server.kill()


@pytest.mark.parametrize("file_layout", LAYOUTS)
def test_a_restart_announces_records_under_the_names_their_headers_kept(tmp_path: Path, file_layout: str) -> None:
    """64 KiB records get a page-sized header, which keeps the engine's names: the restarted
    daemon's scan announces them with the same hashes, parents and tokens."""
    big = CacheLayout("events-big", num_layers=8, num_blocks=16, block_size=16, num_kv_heads=2, head_dim=64)
    assert big.record_bytes == 64 * 1024 and record.annotation_room(record.header_len_for(big.record_bytes)) > 3000
    store, (pub, replay) = tmp_path / "store", _endpoints()
    hashes = [bytes([i + 1]) * 32 for i in range(4)]
    metas = [BlockMeta((h,), None, tuple(range(16 * i, 16 * i + 16)), 16) for i, h in enumerate(hashes)]
    with HostKVCache.create(big) as cache:
        cache.fill_random(9)
        with _daemon(store, pub, replay, host_tier_bytes=0, write_staging_bytes=16 * big.record_bytes,
                     file_layout=file_layout) as d, Client(d.endpoint, timeout=20) as c:
            c.register(cache)
            c.swap_out([0, 1, 2, 3, 4], ["n0", "n1", "n2", "n3", "plain"], wait="persisted",
                       block_meta=[*metas, None])
        with _daemon(store, pub, replay, host_tier_bytes=0, write_staging_bytes=16 * big.record_bytes,
                     file_layout=file_layout) as d, Client(d.endpoint, timeout=20) as c:
            c.register(cache)
            sub = Subscriber(pub, replay, keep_stored=True)
            try:
                sub.join()
                assert _caught_up(lambda: len(sub.view.held[("STORAGE", "kvswap:file")]) == 5, sub)
                announced = {e.block_hashes[0]: e for e in sub.view.stored}
                for i, h in enumerate(hashes):
                    assert announced[h].token_ids == metas[i].token_ids
                    assert announced[h].parent_block_hash == (hashes[i - 1] if i else None)
                assert announced[b"plain"].parent_block_hash == hashes[3]  # the chain's, kept too
                c.delete(["n2"])  # and removed under that name
                assert _caught_up(lambda: hashes[2] not in sub.view.held[("STORAGE", "kvswap:file")], sub)
            finally:
                sub.close()


@pytest.mark.parametrize("file_layout", LAYOUTS)
def test_a_namespace_no_longer_served_is_removed_and_announced_again_when_it_returns(tmp_path: Path,
                                                                                     file_layout: str) -> None:
    other = CacheLayout("events-other", num_layers=2, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=32)
    pub, replay = _endpoints()
    with HostKVCache.create(LAYOUT) as first, HostKVCache.create(other) as second, \
            _daemon(tmp_path / "s", pub, replay, file_layout=file_layout) as d, Client(d.endpoint, timeout=20) as c:
        first.fill_random(1)
        second.fill_random(2)
        c.register(first)
        c.swap_out([0, 1, 2], ["x0", "x1", "x2"], wait="persisted")
        sub = Subscriber(pub, replay, keep_stored=True)
        try:
            sub.join()
            assert _caught_up(lambda: sub.view.keys("kvswap:file") == {"x0", "x1", "x2"}, sub)
            c.register(second)  # another layout: the first namespace's stores close
            c.swap_out([0], ["y0"], wait="persisted")
            assert _caught_up(lambda: sub.view.keys("kvswap:file") == {"y0"}, sub)
            assert sub.view.keys("kvswap:host") == {"y0"}
            c.register(first)  # back: its scan announces its records again
            assert _caught_up(lambda: sub.view.keys("kvswap:file") == {"x0", "x1", "x2"}, sub)
        finally:
            sub.close()


def test_a_subscriber_later_than_the_replay_buffer_gets_the_whole_state(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The buffer keeps 4 KiB of batches, far less than the history: a replay from 0 makes the
    daemon publish a reset and the whole state, from which the subscriber starts."""
    from kvswap.daemon import kv_events

    monkeypatch.setattr(kv_events, "RESTATE_INTERVAL_S", 0.0)  # every catch-up may ask (in-process daemon)
    pub, replay = _endpoints()
    universe: list[str] = []
    with HostKVCache.create(LAYOUT) as cache, _daemon(tmp_path / "s", pub, replay, kv_events_buffer_bytes=4096) as d, \
            Client(d.endpoint, timeout=20) as c:
        cache.fill_random(4)
        namespace = c.register(cache)["namespace"]
        publisher = d.daemon.kv_publisher
        assert publisher is not None

        def history_past_the_buffer() -> bool:
            # More history until batch 0 has left the buffer: how many batches a chain's events
            # make depends on how fast the writes land (the publisher gathers for 2 ms).
            chain = _chains(f"h{len(universe)}-", 1, 8)[0]
            universe.extend(chain)
            c.swap_out(list(range(len(chain))), chain, wait="persisted")
            return bool(publisher._buffer) and publisher._buffer[0][0] > 0  # 0 is gone

        assert wait_until(history_past_the_buffer, timeout=60)
        sub = Subscriber(pub, replay, keep_stored=True)
        try:
            sub.join()
            _assert_matches(sub, d, c, namespace, universe)
            assert publisher.restates >= 1
        finally:
            sub.close()


def test_kvswap_events_shows_what_the_events_say_each_tier_holds(tmp_path: Path) -> None:
    import json

    pub, replay = _endpoints()
    with HostKVCache.create(LAYOUT) as cache, _daemon(tmp_path / "s", pub, replay) as d, \
            Client(d.endpoint, timeout=20) as c:
        cache.fill_random(6)
        c.register(cache)
        c.swap_out([0, 1, 2], ["e0", "e1", "e2"], wait="persisted",
                   block_meta=[BlockMeta((b"\xab" * 32,), None, (7, 8)), None, None])
        c.delete(["e2"])
        c.flush()
        sub = Subscriber(pub, replay)
        try:  # published, and in the replay buffer, before the command asks
            sub.join()
            assert _caught_up(lambda: sub.view.held[("STORAGE", "kvswap:file")] == {b"\xab" * 32, b"e1"}, sub)
        finally:
            sub.close()
        cli = [sys.executable, "-m", "kvswap.daemon.tools.admin", "events", pub, "--replay", replay]
        done = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout.splitlines()[-1])["summary"] == {"kvswap:file": 2, "kvswap:host": 2}
        done = subprocess.run([*cli, "--follow", "--seconds", "0.5", "--json"], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        events = [json.loads(line) for line in done.stdout.splitlines() if '"seq"' in line]
        assert events[0]["type"] == "AllBlocksCleared" and events[0]["seq"] == 0
        stored = [e for e in events if e["type"] == "BlockStored"]
        assert {(e["ownership"], e["block_hashes"][0]) for e in stored} == {
            (tier, h) for tier in ("kvswap:host", "kvswap:file") for h in ("ab" * 32, "e1", "e2")}
        assert {e["parent_block_hash"] for e in stored if e["block_hashes"] == ["e1"]} == {"ab" * 32}
        removed = [e for e in events if e["type"] == "BlockRemoved"]
        assert sorted(e["ownership"] for e in removed) == ["kvswap:file", "kvswap:host"]
        text = subprocess.run(cli, capture_output=True, text=True, timeout=60)
        assert text.returncode == 0 and "kvswap:host" in text.stdout and "batches replayed" in text.stdout
        nobody = subprocess.run([*cli[:-1], f"tcp://127.0.0.1:{free_port()}", "--timeout", "0.5"],
                                capture_output=True, text=True, timeout=60)
        assert nobody.returncode == 1 and "no answer from the replay socket" in nobody.stderr
