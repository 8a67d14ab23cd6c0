"""Every request gets exactly one answer: limits on requests in flight (per client and in all),
message size, a slow disk, and shutdown with requests still running.

Daemons run in this process where a test holds the disk seam (to keep requests in flight or
slow them down), and as subprocesses otherwise; all are driven over real sockets."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from kvswap.protocol import Busy, CacheLayout, Client, HostKVCache, InvalidLayout, NotRegistered, Timeout, Unavailable
from kvswap.protocol import messages as m
from kvswap.protocol.limits import MAX_MESSAGE_BYTES

from support import DaemonProcess, InProcessDaemon, wait_until


class HeldDisk:
    """Wraps one method of the daemon's Disk: each call announces itself, then waits for the
    gate (or sleeps ``delay`` seconds) before doing the real work."""

    def __init__(self, disk, method: str, delay: float | None = None) -> None:
        self.disk, self.method = disk, method
        self.original = getattr(disk, method)
        self.delay = delay
        self.gate = threading.Event()
        self.started = threading.Semaphore(0)
        self.finished = threading.Semaphore(0)
        setattr(disk, method, self)

    def __call__(self, *args, **kwargs):
        self.started.release()
        try:
            if self.delay is not None:
                time.sleep(self.delay)
            else:
                assert self.gate.wait(30), "the test never opened the gate"
            return self.original(*args, **kwargs)
        finally:
            self.finished.release()

    def wait_started(self, count: int) -> None:
        for _ in range(count):
            assert self.started.acquire(timeout=10), "the held call never started"

    def restore(self) -> None:
        setattr(self.disk, self.method, self.original)


def persisted_swap_out(client: Client, block: int, key: str, timeout: float = 10) -> int:
    return client.send(m.SwapOut, {"block_ids": (block,), "keys": (key,), "wait": "persisted"}, timeout=timeout)


def test_one_client_cannot_hold_more_than_its_share(tmp_path: Path, cache: HostKVCache) -> None:
    with InProcessDaemon(tmp_path / "s", file_layout="files", max_inflight_per_client=4) as d, \
            Client(d.endpoint, timeout=10) as greedy, Client(d.endpoint, timeout=10) as other:
        greedy.register(cache)
        held = HeldDisk(d.daemon.file_backend.disk, "write_file")
        sent = [persisted_swap_out(greedy, i, f"g{i}") for i in range(4)]
        held.wait_started(4)
        extra = greedy.send(m.Lookup, {"keys": ("g0",)})
        with pytest.raises(Busy) as err:
            greedy.wait(extra)
        assert err.value.details == {"limit": 4}
        # Another client is not affected by the greedy one's limit.
        assert other.lookup(["g0", "g1", "g2", "g3"]) == 4  # in-flight writes count as stored
        assert other.ping() > 0
        held.gate.set()
        assert [greedy.wait(i)["status"] for i in sent] == [["stored"]] * 4
        assert greedy.lookup(["g0"]) == 1  # its slots came back
        # Nothing left counted for anyone (the count drops just after each answer is sent).
        assert wait_until(lambda: d.daemon.dispatcher.per_client == {})


def test_the_daemon_wide_limit_answers_busy_to_everyone(tmp_path: Path, cache: HostKVCache) -> None:
    with InProcessDaemon(tmp_path / "s", file_layout="files", max_inflight_requests=3) as d, \
            Client(d.endpoint, timeout=10) as a, Client(d.endpoint, timeout=10) as b:
        a.register(cache)
        held = HeldDisk(d.daemon.file_backend.disk, "write_file")
        sent = [persisted_swap_out(a, i, f"w{i}") for i in range(3)]
        held.wait_started(3)
        with pytest.raises(Busy) as err:
            b.ping()
        assert err.value.details == {"limit": 3}
        held.gate.set()
        assert [a.wait(i)["stored"] for i in sent] == [1, 1, 1]
        assert b.ping() > 0


def test_shutdown_answers_unfinished_requests_unavailable_and_keeps_their_writes(
        tmp_path: Path, cache: HostKVCache) -> None:
    expected = cache.block_record(5)
    daemon = InProcessDaemon(tmp_path / "s", file_layout="files", drain_timeout_s=0.5)
    with daemon as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        held = HeldDisk(d.daemon.file_backend.disk, "write_file")
        stuck = persisted_swap_out(c, 5, "late", timeout=30)
        held.wait_started(1)
        d._loop.call_soon_threadsafe(d.daemon.request_exit)
        assert wait_until(lambda: not d.daemon.serving)
        with Client(d.endpoint, timeout=5) as newcomer, pytest.raises(Unavailable):
            newcomer.ping()  # draining: new requests are refused with a reason
        # The stuck request is answered when the drain gives up, long before its 30 s deadline
        # (a lost answer would surface here as the client's own Timeout after 5 s).
        with pytest.raises(Unavailable):
            c.wait(stuck, timeout=5)
        held.gate.set()  # the write was copied before shutdown: it still lands
    with InProcessDaemon(tmp_path / "s", file_layout="files") as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        cache.zero_blocks([6])
        assert c.swap_in(["late"], [6]).loaded == 1
        assert cache.block_record(6) == expected


def test_a_slow_read_times_out_with_an_answer_and_never_writes_late(tmp_path: Path, cache: HostKVCache) -> None:
    # No RAM tier: the read must come from the (slow) disk.
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0) as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        c.swap_out([1], ["slow"], wait="persisted")
        expected = cache.block_record(1)
        slow = HeldDisk(d.daemon.file_backend.disk, "read_file", delay=0.6)
        cache.zero_blocks([9])
        with pytest.raises(Timeout) as err:
            c.swap_in(["slow"], [9], timeout=0.2)
        assert err.value.details == {"timeout_ms": 200}  # the daemon's answer, not the client's
        assert c.ping() > 0  # the loop is free while the read crawls
        assert slow.finished.acquire(timeout=10)
        assert c.stats()["pending_writes"] == 0
        # The read finished after the deadline: the engine may have reused block 9 by now, so
        # nothing may be written into it.
        assert cache.block_record(9) == bytes(cache.layout.record_bytes)
        slow.delay = 0.05  # slow but within the deadline: loads normally
        assert c.swap_in(["slow"], [9], timeout=5).loaded == 1
        assert cache.block_record(9) == expected


def _raw(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def test_message_size_limits(daemon: DaemonProcess) -> None:
    sock = _raw(daemon.endpoint)
    try:
        # Just over the protocol limit: read by ZMQ, refused by the daemon with a reason.
        over = msgpack.packb({"v": 1, "id": 3, "op": "ping", "pad": b"x" * (MAX_MESSAGE_BYTES + 16)})
        sock.send(over)
        assert sock.poll(10_000)
        reply = msgpack.unpackb(sock.recv())
        assert reply["ok"] is False and reply["error"]["code"] == "too_large" and reply["id"] is None
        # Far over: ZMQ drops the frame (and the connection) before it costs the daemon memory.
        sock.send(b"\x00" * (MAX_MESSAGE_BYTES + 1_000_000))
        assert not sock.poll(1000)
    finally:
        sock.close()
    assert daemon.alive
    with Client(daemon.endpoint, timeout=5) as c:
        assert c.ping() > 0


def test_layouts_beyond_the_region_limit_are_refused_before_they_are_built() -> None:
    with pytest.raises(InvalidLayout) as err:
        CacheLayout("huge", num_layers=10**9, num_blocks=1, block_size=1, num_kv_heads=1, head_dim=1)
    assert err.value.details == {"regions": 2 * 10**9, "limit": 4096}


def test_register_refuses_a_pid_beyond_a_c_int(client: Client, cache: HostKVCache) -> None:
    registration = cache.registration()
    registration["pid"] = 2**31
    with pytest.raises(Exception) as err:
        client.register(registration)
    assert err.value.code == "bad_request"
    assert client.register(cache)["record_bytes"] == cache.layout.record_bytes


def test_a_record_larger_than_staging_is_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    """A sparse shared-memory segment costs its sender nothing; without this check a layout
    of huge records made the daemon allocate (and touch) two staging slots that large."""
    huge = CacheLayout("huge-records", num_layers=1, num_blocks=1, block_size=1, num_kv_heads=1,
                       head_dim=1024 * 1024, dtype="float16")  # 4 MiB records (k and v)
    with InProcessDaemon(tmp_path / "s", file_layout="files", write_staging_bytes=1 << 20, read_staging_bytes=2 << 20) as d, \
            HostKVCache.create(huge) as cache, Client(d.endpoint, timeout=10) as c:
        with pytest.raises(InvalidLayout) as err:
            c.register(cache)
        assert err.value.details == {"record_bytes": 4 << 20, "staging_bytes": 1 << 20}
        assert d.daemon.swapper.registration is None
        assert c.stats()["registered"] is False and "write_staging" not in c.stats()


def test_decoded_requests_in_flight_are_bounded_in_bytes(tmp_path: Path, cache: HostKVCache) -> None:
    """Issue 22, finding 6: what decoded requests waiting for their answer hold is charged
    against --max-inflight-request-bytes (one connection: its share, a quarter by default);
    past it the answer is busy, another connection is still served, and the charge comes back
    when the requests are answered and freed."""
    budget = 1024 * 1024
    share = budget // 4
    with InProcessDaemon(tmp_path / "s", file_layout="files", max_inflight_request_bytes=budget) as d, \
            Client(d.endpoint, timeout=10) as greedy, Client(d.endpoint, timeout=10) as other:
        greedy.register(cache)
        held = HeldDisk(d.daemon.file_backend.disk, "write_file")

        def swap_out(n: int) -> int:  # 32 keys of 128 characters, each request its own
            keys = tuple(f"r{n}-{i}".ljust(128, "k") for i in range(32))
            return greedy.send(m.SwapOut, {"keys": keys, "block_ids": tuple(range(32)), "wait": "persisted"})

        # The register's charge comes back when its request is freed, which may be after its
        # answer: measured with it still held, one swap_out's charge came out 9,728 bytes (the
        # register's) where it is 9,947.
        assert wait_until(lambda: d.daemon.budget.used == 0, 10)
        try:
            sent = [swap_out(0)]
            assert wait_until(lambda: d.daemon.budget.used > 0, 10)
            charge = d.daemon.budget.used  # what one of them is charged once decoded
            assert 32 * (128 + 40) < charge < 16 * 1024
            while d.daemon.budget.used + charge <= share:
                sent.append(swap_out(len(sent)))
                assert wait_until(lambda: d.daemon.budget.used == len(sent) * charge, 10)
            with pytest.raises(Busy) as err:
                greedy.wait(swap_out(len(sent)))
            assert err.value.message == "too many request bytes in flight"
            assert err.value.details == {"limit": budget}
            assert len(sent) == share // charge  # exactly what fits in the share
            assert d.daemon.budget.used == len(sent) * charge
            assert other.lookup(["r0-0".ljust(128, "k")]) == 1  # another connection's share is its own
        finally:
            held.gate.set()
        assert [greedy.wait(i)["stored"] for i in sent] == [32] * len(sent)
        assert wait_until(lambda: d.daemon.budget.used == 0), d.daemon.budget.used
        assert greedy.ping() > 0


def test_a_request_whose_work_raised_gives_its_charge_back_without_the_cyclic_gc(tmp_path: Path) -> None:
    """A request whose work raised a typed error (swap_ins before any register: not_registered)
    gives its charge back once answered. Raised out of the work task, the error's traceback
    held the frame that held the task that held the error: a cycle that kept each refused
    request's decoded keys until the cyclic GC ran. With the GC off, only breaking it frees them."""
    import gc

    with InProcessDaemon(tmp_path / "s", file_layout="files") as d, Client(d.endpoint, timeout=10) as c:
        gc.collect()
        gc.disable()
        try:
            for i in range(5):
                with pytest.raises(NotRegistered):
                    c.swap_in([f"k{i}-{j}" for j in range(32)], list(range(32)))
            assert wait_until(lambda: d.daemon.budget.used == 0, 5), d.daemon.budget.used
        finally:
            gc.enable()


def test_replies_a_connection_does_not_read_count_against_its_share(tmp_path: Path) -> None:
    """Issue 22, finding 6: replies of 4 KiB or more that ZMQ still holds for a peer that does
    not read are charged to that peer's share; once they fill it, its requests are answered
    busy (a few hundred bytes each), while another connection is served; the charge comes
    back when the peer leaves."""
    import os

    blocks = 8192
    layout = CacheLayout("unread-replies", num_layers=1, num_blocks=blocks, block_size=1, num_kv_heads=1, head_dim=8)
    budget = 8 * 1024 * 1024
    share = budget // 4
    keys = tuple(f"k{i}" for i in range(blocks))
    with HostKVCache.create(layout) as cache, InProcessDaemon(tmp_path / "s", file_layout="files", max_inflight_request_bytes=budget) as d, \
            Client(d.endpoint, timeout=30) as engine:
        engine.register(cache)
        assert engine.swap_out(list(range(blocks)), list(keys), wait="persisted").stored == blocks
        registry = d.daemon.metrics.registry

        def count(name: str, **labels: str) -> float:
            return sum(sample.value for family in registry.collect() for sample in family.samples
                       if sample.name == name and labels.items() <= sample.labels.items())

        ctx = zmq.Context()
        slow = ctx.socket(zmq.DEALER)
        slow.setsockopt(zmq.ROUTING_ID, b"slow-reader")
        slow.setsockopt(zmq.RCVHWM, 1)
        slow.setsockopt(zmq.RCVBUF, 4096)
        slow.setsockopt(zmq.LINGER, 0)
        slow.connect(d.endpoint)
        base = count("kvswap_requests_total")
        frame = m.encode_request(m.SwapOut(id=1, keys=keys, block_ids=tuple(range(blocks)), token=engine._token,
                                           pid=os.getpid()))
        try:
            for n in range(1, 201):  # one at a time: each answered with a 57 KB reply (every key "exists"), or busy
                slow.send(frame)
                assert wait_until(lambda: count("kvswap_requests_total") >= base + n, 10, interval=0.002)
            unsent = d.daemon.budget.unsent(b"slow-reader")
            busy = count("kvswap_errors_total", code="busy")
            print(f"unsent replies held for the peer: {unsent} bytes (its share {share}), {busy:.0f} of 200 "
                  "requests answered busy")
            assert share // 2 <= unsent <= share  # tracked, filled, and no further
            assert busy >= 100  # the rest were refused
            assert engine.lookup(list(keys[:8])) == 8  # the engine's connection has its own share
        finally:
            slow.close()
            ctx.term()
        assert wait_until(lambda: d.daemon.budget.unsent(b"slow-reader") == 0, 10)
        assert wait_until(lambda: d.daemon.budget.used == 0)
