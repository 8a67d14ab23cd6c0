"""Lookups off the request path's locks and GIL (issue 27): chain touches in pieces, merged
and spaced (tiers.ChainTouches), the RAM tier's lock-free key sets, the dispatcher on ZMQ's
plain socket, and the echo floor ``kvswap bench`` divides by. Correctness first: a lookup
still counts the leading keys stored in any retrieve tier, writes in flight included."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import msgpack
import pytest
import zmq
from support import GatedWrites, InProcessDaemon, wait_until

from kvswap.backends.chains import ChainOrder
from kvswap.backends.ram_tier import RamBackend
from kvswap.daemon.tiers import ChainTouches, touch_pieces
from kvswap.daemon.tools.latency_floor import EchoServer, echo_reply
from kvswap.protocol import Client, HostKVCache
from kvswap.protocol.errors import Internal, NotRegistered

NS = "ab" * 16


# -- touches in pieces -------------------------------------------------------------------------


@pytest.mark.parametrize("n,piece", [(1, 4), (4, 4), (5, 4), (10, 4), (64, 64), (1000, 64), (129, 64)])
def test_a_chain_touched_in_pieces_is_ordered_and_linked_as_one_touch(n: int, piece: int) -> None:
    """Head newest, tail oldest, newer than everything before, every link learned: what one
    stamp of the whole chain gives, whatever the piece size."""
    keys = [f"k{i}" for i in range(n)]
    pieces = touch_pieces(keys, piece)
    assert all(0 < len(p) <= piece for p in pieces)
    assert pieces[0][-1] == keys[-1] and pieces[-1][0] == keys[0]  # the tail's piece first
    assert all(later[-1] == earlier[0] for earlier, later in zip(pieces, pieces[1:]))  # one key shared
    assert sorted({k for p in pieces for k in p}) == sorted(keys)

    def touched(by_pieces: bool) -> ChainOrder[str]:
        order: ChainOrder[str] = ChainOrder(clock=lambda: 0)
        for key in [*keys, "other"]:
            order.add(key)
        for p in (pieces if by_pieces else [keys]):
            order.chain(p)
        return order

    whole, split = touched(False), touched(True)
    by_stamp = sorted(keys + ["other"], key=lambda k: split.stamp(k) or 0)
    assert by_stamp == ["other", *reversed(keys)]  # the tail oldest, the head newest
    assert split._parent == whole._parent and split._children == whole._children
    # The same victims in the same order: eviction cannot tell the two apart.
    assert [_pop(whole) for _ in range(n + 1)] == [_pop(split) for _ in range(n + 1)]


def _pop(order: ChainOrder[str]) -> str | None:
    victim = order.victim()
    if victim is not None:
        order.remove(victim)
    return victim


# -- merging and spacing ---------------------------------------------------------------------------


class Recording:
    """A NamespaceTiers stand-in that records the chains it is asked to touch."""

    def __init__(self) -> None:
        self.touched: list[tuple[str, ...]] = []

    def touch_chain(self, keys: Sequence[str], persist: bool = False) -> None:
        self.touched.append(tuple(keys))


def test_waiting_touches_merge_repeated_ones_wait_and_the_oldest_go_past_the_cap() -> None:
    now = [100.0]
    touches = ChainTouches(limit_keys=6, repeat_s=1.0, clock=lambda: now[0])
    tiers, other = Recording(), Recording()
    assert touches.add(tiers, ["a", "b"]) is True  # nobody drains yet: the caller starts it
    assert touches.add(tiers, ["c"]) is False
    assert touches.add(tiers, ["a", "b"]) is False  # waiting already: moved to the end
    assert touches.add(other, ["a", "b"]) is False  # other tiers: its own touch
    assert touches.drain() == 3
    assert tiers.touched == [("c",), ("a", "b")] and other.touched == [("a", "b")]
    assert touches.stats() == {"waiting": 0, "applied": 3, "coalesced": 1, "repeated": 0, "dropped": 0}

    # Touched less than repeat_s ago: not again. Past it: again.
    now[0] += 0.5
    assert touches.add(tiers, ["a", "b"]) is False
    assert touches.stats()["repeated"] == 1
    now[0] += 0.6
    assert touches.add(tiers, ["a", "b"]) is True
    assert touches.add(tiers, ["d", "e", "f"]) is False
    assert touches.add(tiers, ["g", "h"]) is False  # 7 keys waiting, over 6: the oldest goes
    assert touches.stats()["dropped"] == 1 and touches.stats()["waiting"] == 2
    assert touches.drain() == 2
    assert tiers.touched[2:] == [("d", "e", "f"), ("g", "h")]


def test_a_failing_touch_leaves_the_others_applied_and_the_next_lookup_drains_again() -> None:
    touches = ChainTouches(repeat_s=0.0)

    class Failing(Recording):
        def touch_chain(self, keys: Sequence[str], persist: bool = False) -> None:
            super().touch_chain(keys)
            if keys[0] == "bad":
                raise OSError("touch failed")

    tiers = Failing()
    touches.add(tiers, ["bad"])
    touches.add(tiers, ["good"])
    with pytest.raises(OSError, match="touch failed"):
        touches.drain()
    assert tiers.touched == [("bad",), ("good",)]
    assert touches.add(tiers, ["again"]) is True  # not stuck "draining"
    assert touches.drain() == 1


# -- the RAM tier's key sets ------------------------------------------------------------------------


def test_the_ram_tiers_prefix_reads_its_key_sets_and_they_follow_every_change() -> None:
    backend = RamBackend(4 * 4096)
    arena = backend.make_arena(4096, staging_slots=2)
    arena.grow(6)
    store = backend.open_store(NS, {}, 4096)
    other = backend.open_store("cd" * 16, {}, 4096)
    payload = memoryview(bytes(4096))
    for key in ("a", "b", "d"):
        store.put(key, payload)
    other.put("c", payload)
    assert store.cached_prefix(["a", "b", "c", "d"]) == 2  # c is another namespace's
    assert store.cached_prefix(["a", "b", "c", "d"], {"c"}) == 4  # in flight counts
    assert store.cached_prefix(["x", "a"], {"a"}) == 0
    assert store.cached_prefix([]) == 0
    assert store.delete("b") and store.cached_prefix(["a", "b"]) == 1
    for key in ("e", "f", "g", "h"):  # past the arena's 6 slots: the oldest are evicted
        store.put(key, payload)
    held = [k for k in "adefgh" if store.contains(k)]
    assert "a" not in held and held[-4:] == list("efgh")
    assert held == [k for k in "adefgh" if store.cached_prefix([k]) == 1]
    assert backend.problems() == []
    assert store.clear() == len(held) and store.cached_prefix(["h"]) == 0 and other.contains("c")
    assert backend.problems() == []


# -- a real daemon ------------------------------------------------------------------------------------


def test_lookup_counts_leading_keys_across_the_retrieve_tiers(tmp_path: Path, cache: HostKVCache) -> None:
    slot = (cache.layout.record_bytes + 4095) // 4096 * 4096
    # Staging and RAM of 9 records in all: most of 16 are in the file tier alone.
    with InProcessDaemon(tmp_path / "s", host_tier_bytes=3 * slot, write_staging_bytes=4 * slot,
                         read_staging_bytes=2 * slot) as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        keys = [f"k{i}" for i in range(16)]
        for start in range(0, 16, 4):
            c.swap_out(list(range(start, start + 4)), keys[start:start + 4], wait="persisted")
        stores = d.daemon.swapper.registration.tiers.stores  # type: ignore[union-attr]
        assert all(stores["file"].contains(k) for k in keys)
        in_ram = [k for k in keys if stores["host"].contains(k)]
        assert 0 < len(in_ram) < 16, in_ram  # the RAM tier holds part of the prefix
        assert c.lookup(keys) == 16
        assert c.lookup([*keys, "nope", "k0"]) == 16
        assert c.delete(["k5"]) == 1
        assert c.lookup(keys) == 5
        assert c.lookup(["nope", *keys]) == 0


def test_lookup_counts_writes_in_flight_as_stored(tmp_path: Path, cache: HostKVCache) -> None:
    with InProcessDaemon(tmp_path / "s", host_tier_bytes=0, file_layout="files") as d, \
            Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        assert c.swap_out([0, 1], ["k0", "k1"], wait="persisted").stored == 2
        with GatedWrites(d.daemon.file_backend.disk) as gate:
            assert c.swap_out([2, 3], ["k2", "k3"]).queued == 2  # copied; the writes wait
            assert gate.started.acquire(timeout=10)
            assert d.daemon.swapper.pending_writes == 2
            assert c.lookup(["k0", "k1", "k2", "k3", "k4"]) == 4  # in flight: stored
            assert c.lookup(["k2", "k3"]) == 2
        c.flush()
        assert c.lookup(["k0", "k1", "k2", "k3", "k4"]) == 4


def test_repeated_lookups_touch_their_chain_once_and_the_touch_still_orders_eviction(
        tmp_path: Path, cache: HostKVCache) -> None:
    slot = (cache.layout.record_bytes + 4095) // 4096 * 4096
    with InProcessDaemon(tmp_path / "s", host_tier_bytes=6 * slot, write_staging_bytes=4 * slot,
                         read_staging_bytes=2 * slot, read_threads=1) as d, \
            Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        host = d.daemon.swapper.registration.tiers.stores["host"]  # type: ignore[union-attr]
        a, b = ["a0", "a1"], ["b0", "b1"]
        assert c.swap_out([0, 1], a, wait="persisted").stored == 2
        assert c.swap_out([2, 3], b, wait="persisted").stored == 2
        for _ in range(50):  # an engine asking again while its request waits
            assert c.lookup(a) == 2

        def settled() -> bool:  # every lookup's touch applied, merged or skipped
            t = c.stats()["touches"]
            return t["waiting"] == 0 and t["applied"] + t["coalesced"] + t["repeated"] + t["dropped"] == 50

        assert wait_until(settled)
        stats = c.stats()["touches"]
        assert 1 <= stats["applied"] < 50 and stats["dropped"] == 0
        # Chain a was touched after b was written: b is older, and goes first.
        n = 0
        while all(host.contains(k) for k in a + b):
            n += 1
            assert n < 100, "the RAM tier never evicted"
            assert c.swap_out([4, 5], [f"f{n}-0", f"f{n}-1"], wait="persisted").stored == 2
        assert [host.contains(k) for k in a] == [True, True], [host.contains(k) for k in b]


def test_the_dispatcher_answers_frames_queued_behind_each_other_and_after_replies(
        tmp_path: Path) -> None:
    """ZMQ's descriptor is edge-triggered: frames that arrive together, or while a reply is
    being sent, must each be answered without another frame to wake the loop."""
    with InProcessDaemon(tmp_path / "s") as d:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(d.endpoint)
        try:
            for n in range(200):
                sock.send(msgpack.packb({"v": 1, "id": n, "op": "ping"}))
            got = set()
            while len(got) < 200:
                assert sock.poll(10_000), f"only {len(got)} of 200 answered"
                reply = msgpack.unpackb(sock.recv())
                assert reply["ok"] and reply["result"] == {"pong": True}
                got.add(reply["id"])
            assert got == set(range(200))
        finally:
            sock.close()


# -- answers from memory, in the read that took the frame ---------------------------------------


def _sample(d: InProcessDaemon, name: str, **labels: str) -> float:
    return d.daemon.metrics.registry.get_sample_value(name, labels) or 0.0


def test_memory_answers_come_from_the_read_and_the_rest_from_tasks(tmp_path: Path, cache: HostKVCache) -> None:
    """ping, hello and a lookup whose every key the indexes know are answered without a task
    (the async handler never sees them); a lookup with a miss, one that waits for keys on
    their way, and every op that moves bytes still run as tasks. The answers are the same."""
    with InProcessDaemon(tmp_path / "s", host_tier_bytes=0) as d, Client(d.endpoint, timeout=10) as c:
        dispatcher = d.daemon.dispatcher
        handled: list[str] = []
        real = dispatcher.handle

        async def handle(request, deadline):  # type: ignore[no-untyped-def]
            handled.append(request.op)
            return await real(request, deadline)

        dispatcher.handle = handle
        c.register(cache)
        keys = [f"k{i}" for i in range(4)]
        assert c.swap_out(list(range(4)), keys, wait="persisted").stored == 4
        handled.clear()
        assert c.ping() > 0 and c.hello()["server"] == "kvswapd"
        assert c.lookup(keys) == 4 and c.lookup(keys[:2]) == 2
        assert handled == []
        assert c.lookup([*keys, "missing", "k0"]) == 4  # the miss is asked of the tiers: a task
        assert c.lookup(keys, wait_ms=10) == 4  # may wait: a task
        assert c.swap_in(keys, [10, 11, 12, 13]).loaded == 4
        assert handled == ["lookup", "lookup", "swap_in"]
        # Answered from the read or not, each is a request counted once, with its latency.
        assert _sample(d, "kvswap_requests_total", op="lookup", outcome="ok") == 4
        assert _sample(d, "kvswap_request_duration_seconds_count", op="ping") == 1
        assert _sample(d, "kvswap_lookup_keys_total", result="hit") == 4 + 2 + 4 + 4


def test_a_memory_answer_that_fails_is_a_typed_error_and_the_daemon_serves_on(
        tmp_path: Path, cache: HostKVCache, caplog: pytest.LogCaptureFixture) -> None:
    with InProcessDaemon(tmp_path / "s") as d, Client(d.endpoint, timeout=10) as c:
        with pytest.raises(NotRegistered):
            c.lookup(["a"])  # no registration yet: answered from the read, typed
        c.register(cache)

        def bug(request):  # type: ignore[no-untyped-def]
            raise RuntimeError("a bug in the lookup")

        d.daemon.ops.now["lookup"] = bug
        with caplog.at_level("ERROR"), pytest.raises(Internal, match="RuntimeError: a bug in the lookup"):
            c.lookup(["a"])
        assert any("raised" in r.getMessage() for r in caplog.records)
        assert c.ping() > 0 and c.stats()["registered"]
        assert _sample(d, "kvswap_errors_total", op="lookup", code="not_registered") == 1
        assert _sample(d, "kvswap_errors_total", op="lookup", code="internal") == 1


def test_a_ping_read_after_its_deadline_is_answered_timeout_not_pong(tmp_path: Path) -> None:
    with InProcessDaemon(tmp_path / "s") as d:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(d.endpoint)
        try:
            for n, deadline_ns in enumerate([time.monotonic_ns() - 1, time.monotonic_ns() + 10**10]):
                sock.send(msgpack.packb({"v": 1, "id": n, "op": "ping", "deadline_ns": deadline_ns}))
                assert sock.poll(10_000)
                reply = msgpack.unpackb(sock.recv())
                assert reply["id"] == n
                if n == 0:
                    assert not reply["ok"] and reply["error"]["code"] == "timeout"
                else:
                    assert reply["ok"] and reply["result"] == {"pong": True}
            assert _sample(d, "kvswap_expired_on_arrival_total") == 1
        finally:
            sock.close()


# -- the echo floor -------------------------------------------------------------------------------


def test_the_echo_floor_answers_in_the_daemons_reply_shape() -> None:
    frame = msgpack.packb({"v": 1, "id": 7, "op": "lookup", "keys": ["a", "b", "c"]})
    assert msgpack.unpackb(echo_reply(frame)) == {"v": 1, "id": 7, "ok": True, "result": {"hits": 3}}
    assert msgpack.unpackb(echo_reply(msgpack.packb({"v": 1, "id": 8, "op": "ping"})))["result"] == {"pong": True}
    with EchoServer() as echo, Client(echo.endpoint, timeout=10) as c:
        assert c.lookup([f"k{i}" for i in range(1000)]) == 1000
        assert c.ping() > 0
