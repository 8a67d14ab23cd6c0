"""The client keeps the promise of protocol/limits.py: a request the daemon would refuse is
refused by ``encode_request`` with the same typed error, before anything is sent.

One implementation of the field checks serves both sides, so each case here is checked three
ways: the client raises, the daemon's decoder raises the same code and details for the same
fields sent raw, and a client with no daemon behind it raises at once (it never waited for a
reply)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgpack
import pytest
from support import DaemonProcess, free_port

from kvswap.protocol import AsyncClient, Client
from kvswap.protocol import messages as m
from kvswap.protocol.errors import (
    BadRequest,
    InvalidKey,
    KvswapError,
    NotRegistered,
    TooLarge,
)
from kvswap.protocol.limits import (
    DEFAULT_TIMEOUT_MS,
    MAX_BLOCK_ID,
    MAX_KEYS_PER_REQUEST,
    MAX_TIMEOUT_MS,
)

# (request the client is asked to send, the same fields as a raw frame, error, details)
REFUSED = [
    ("9,000-key lookup", m.Lookup(id=5, keys=("k",) * 9000),
     {"op": "lookup", "keys": ["k"] * 9000}, TooLarge, {"field": "keys", "count": 9000, "limit": 8192}),
    ("too many delete keys", m.Delete(id=5, keys=("k",) * (MAX_KEYS_PER_REQUEST + 1)),
     {"op": "delete", "keys": ["k"] * (MAX_KEYS_PER_REQUEST + 1)}, TooLarge,
     {"field": "keys", "count": MAX_KEYS_PER_REQUEST + 1, "limit": MAX_KEYS_PER_REQUEST}),
    ("key with a slash", m.Lookup(id=5, keys=("ok", "a/b")), {"op": "lookup", "keys": ["ok", "a/b"]},
     InvalidKey, {"index": 1, "key": "a/b"}),
    ("key too long", m.Lookup(id=5, keys=("a" * 129,)), {"op": "lookup", "keys": ["a" * 129]},
     InvalidKey, {"index": 0, "length": 129}),
    ("block id past the limit", m.SwapIn(id=5, keys=("a",), block_ids=(MAX_BLOCK_ID + 1,)),
     {"op": "swap_in", "keys": ["a"], "block_ids": [MAX_BLOCK_ID + 1]}, BadRequest,
     {"field": "block_ids", "index": 0}),
    ("keys and block ids differ", m.SwapOut(id=5, keys=("a", "b"), block_ids=(1,)),
     {"op": "swap_out", "keys": ["a", "b"], "block_ids": [1], "wait": "copied"}, BadRequest,
     {"keys": 2, "block_ids": 1}),
    ("bad wait", m.SwapOut(id=5, keys=("a",), block_ids=(1,), wait="never"),
     {"op": "swap_out", "keys": ["a"], "block_ids": [1], "wait": "never"}, BadRequest, {"field": "wait"}),
    ("timeout past the limit", m.Ping(id=5, timeout_ms=MAX_TIMEOUT_MS + 1),
     {"op": "ping", "timeout_ms": MAX_TIMEOUT_MS + 1}, BadRequest, {"field": "timeout_ms"}),
]


@pytest.mark.parametrize("name,request_,raw,error,details", REFUSED, ids=[r[0] for r in REFUSED])
def test_encode_request_refuses_what_the_daemon_refuses(name, request_, raw, error, details) -> None:
    with pytest.raises(error) as local:
        m.encode_request(request_)
    assert local.value.details == details
    frame = msgpack.packb({"v": 1, "id": 5, **raw})
    with pytest.raises(m.DecodeError) as remote:
        m.decode_request(frame)
    assert type(remote.value.error) is error
    assert remote.value.error.details == details
    assert remote.value.error.message == local.value.message


def test_encode_request_of_a_valid_request_is_unchanged() -> None:
    assert m.encode_request(m.Ping(id=7)) == b"\x83\xa1v\x01\xa2id\x07\xa2op\xa4ping"
    assert m.encode_request(m.Lookup(id=1, keys=("h:00ff",))) == (
        b"\x84\xa1v\x01\xa2id\x01\xa2op\xa6lookup\xa4keys\x91\xa6h:00ff")
    keys = tuple(f"k{i}" for i in range(MAX_KEYS_PER_REQUEST))
    assert len(m.decode_request(m.encode_request(m.Lookup(id=1, keys=keys))).keys) == MAX_KEYS_PER_REQUEST


def test_encode_request_refuses_an_id_past_uint64() -> None:
    with pytest.raises(BadRequest) as err:
        m.encode_request(m.Ping(id=2**64))
    assert err.value.details == {"field": "id"}


def test_encode_request_refuses_a_frame_over_the_byte_limit() -> None:
    # Each field passes its own checks, but the frame is over MAX_MESSAGE_BYTES.
    layout = {"model_id": "m"}
    regions = tuple({"name": "r" * 1000, "handle": 0, "offset": i, "stride": 1} for i in range(4096))
    with pytest.raises(TooLarge) as err:
        m.encode_request(m.Register(id=1, layout=layout, handles=({"kind": "shm"},), regions=regions))
    assert err.value.details["limit"] == 4 * 1024 * 1024


def test_client_raises_before_sending(tmp_path: Path) -> None:
    """No daemon listens: a request that would be sent fails as unreachable after its poll,
    one the daemon would refuse fails with its own error at once."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with Client(endpoint, timeout=0.3) as client:
        started = time.monotonic()
        with pytest.raises(TooLarge) as err:
            client.lookup(["k"] * 9000)
        assert err.value.details == {"field": "keys", "count": 9000, "limit": 8192}
        with pytest.raises(InvalidKey):
            client.swap_in(["../etc/passwd"], [0])
        assert not client._pending  # nothing was sent, nothing waits for a reply
        with pytest.raises(KvswapError) as unreachable:
            client.lookup(["k"])
        assert unreachable.value.code in ("unavailable", "timeout")
        assert time.monotonic() - started < 60  # sanity only: the local refusals did not wait


def test_async_client_raises_before_sending() -> None:
    async def main() -> None:
        async with AsyncClient(f"tcp://127.0.0.1:{free_port()}", timeout=0.3) as client:
            with pytest.raises(TooLarge):
                await client.lookup(["k"] * 9000)
            assert not client._waiters
            assert client._reader is None  # the request never got as far as the socket

    asyncio.run(main())


def test_daemon_never_sees_a_refused_request(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "s", free_port(), free_port()).start()
    try:
        with Client(d.endpoint, timeout=5) as client:
            before = d.metric("kvswap_errors_total", op="lookup", code="too_large")
            with pytest.raises(TooLarge):
                client.lookup(["k"] * 9000)
            with pytest.raises(NotRegistered):
                client.lookup(["k"])  # this one was sent, and counted
            assert d.metric("kvswap_requests_total", op="lookup", outcome="error") == 1
            assert d.metric("kvswap_errors_total", op="lookup", code="not_registered") == 1
            assert d.metric("kvswap_errors_total", op="lookup", code="too_large") == before == 0
    finally:
        assert d.stop() == 0


def test_default_timeout_is_the_protocol_default() -> None:
    from kvswap.daemon.config import Config

    assert Client(f"tcp://127.0.0.1:{free_port()}").timeout * 1000 == DEFAULT_TIMEOUT_MS
    assert Config().default_timeout_ms == DEFAULT_TIMEOUT_MS
