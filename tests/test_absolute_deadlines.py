"""``deadline_ns``: a swap read after the sender's deadline never starts (docs/protocol.md,
Deadlines).

A deadline counted from a frame's arrival starts late when the daemon reads late. The engine
counts from sending: once the client's wait is over it treats its blocks as its own again
(vLLM's connector reports an async load finished, or reuses a block a save read). So a daemon
that was stopped while the request waited in its socket must not copy it when it resumes: a
real daemon process, SIGSTOPped while the requests are sent, resumed after the client gave up.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from support import DaemonProcess, wait_until

from kvswap.protocol import CacheLayout, Client, HostKVCache, Timeout
from kvswap.protocol import messages as m

LAYOUT = CacheLayout("deadline-ns", num_layers=2, num_blocks=16, block_size=8, num_kv_heads=2, head_dim=16)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_swaps_read_after_their_deadline_never_touch_engine_memory(daemon: DaemonProcess) -> None:
    assert daemon.proc is not None
    pid = daemon.proc.pid
    with HostKVCache.create(LAYOUT) as cache, Client(daemon.endpoint, timeout=30) as client:
        cache.fill_random(seed=3)
        client.register(cache)
        assert client.swap_out([0, 1], ["kept-0", "kept-1"], wait="persisted").stored == 2
        stored = [cache.block_record(b) for b in range(2)]
        expired = daemon.metric("kvswap_expired_on_arrival_total")
        os.kill(pid, signal.SIGSTOP)
        try:
            assert wait_until(lambda: _stopped(pid))
            # Loads into blocks 2 and 3, and a save of block 1 under a new key, both sent to a
            # daemon that cannot read them.
            load = client.send(m.SwapIn, {"keys": ("kept-0", "kept-1"), "block_ids": (2, 3)}, timeout=0.3)
            save = client.send(m.SwapOut, {"block_ids": (1,), "keys": ("late-1",), "wait": "copied"}, timeout=0.3)
            # The client waits out both deadlines (plus its grace) and gives up: from here on
            # the engine may reuse blocks 1, 2 and 3.
            for request_id in (load, save):
                with pytest.raises(Timeout):
                    client.wait(request_id)
                with pytest.raises(KeyError):
                    client.done(request_id)  # collected
            cache.fill_random(seed=4)  # the engine reuses them
            before = [cache.block_record(b) for b in range(4)]
        finally:
            os.kill(pid, signal.SIGCONT)
        # Resumed: the daemon answers both (to a client that no longer waits) without copying.
        assert daemon.alive
        deadline = time.monotonic() + 30
        while daemon.metric("kvswap_expired_on_arrival_total") < expired + 2:
            assert time.monotonic() < deadline, daemon.log()
            time.sleep(0.05)
        assert client.lookup(["late-1"]) == 0  # the save never started
        assert [cache.block_record(b) for b in range(4)] == before  # the load never wrote
        assert "arrived" in daemon.log() and "after its deadline_ns" in daemon.log()
        # A swap sent in time is served as ever.
        assert client.swap_in(["kept-0", "kept-1"], [2, 3]).loaded == 2
        assert cache.block_record(2) == stored[0] and cache.block_record(3) == stored[1]


def test_deadline_ns_travels_and_is_checked() -> None:
    request = m.SwapIn(id=5, keys=("a",), block_ids=(1,), timeout_ms=100, deadline_ns=123_456_789)
    decoded = m.decode_request(m.encode_request(request))
    assert decoded.deadline_ns == 123_456_789 and decoded.timeout_ms == 100
    # Left off the wire when unset: frames of peers that never send it are unchanged.
    assert b"deadline_ns" not in m.encode_request(m.Ping(id=7))
    for bad in (-1, "soon", 1.5, True):
        frame = m._pack({"v": 1, "id": 9, "op": "ping", "deadline_ns": bad})
        with pytest.raises(m.DecodeError) as caught:
            m.decode_request(frame)
        assert caught.value.error.code == "bad_request" and caught.value.error.details.get("field") == "deadline_ns"


def test_the_client_sends_deadline_ns_only_with_swaps() -> None:
    client = Client("tcp://127.0.0.1:1", timeout=2.0)
    try:
        now = time.monotonic_ns()
        swap, _ = client._make(m.SwapIn, {"keys": ("a",), "block_ids": (0,)}, None)
        lookup, _ = client._make(m.Lookup, {"keys": ("a",)}, None)
        assert swap.deadline_ns is not None and now + 1.9e9 <= swap.deadline_ns <= time.monotonic_ns() + 2e9
        # A lookup may come from a router on another host, whose clock is not this one.
        assert lookup.deadline_ns is None
    finally:
        client.close()
