"""Hostile frames for the protocol fuzz test (tests/test_fuzz.py) and its long run
(benchmarks/fuzz_long.py), and the session that sends them to a live daemon and checks that
every frame gets exactly one well-formed, typed answer.

A frame whose request id can be read (a msgpack map with an integer ``id`` in 0..2**64-1)
must be answered once under that id; any other frame once under ``id: null``. Every request
id the fuzzer sends is unique, so a second answer to any of them is caught. Frames built by
changing one thing in a valid request also carry the error code that change must produce.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import msgpack
import zmq
from hypothesis import strategies as st

from kvswap.protocol.errors import ERRORS_BY_CODE
from kvswap.protocol.layout import CacheLayout
from kvswap.protocol.limits import MAX_BLOCK_ID, MAX_KEYS_PER_REQUEST, MAX_MESSAGE_BYTES, MAX_TIMEOUT_MS
from kvswap.protocol.messages import REQUEST_TYPES

#: The cache the fuzz session registers: small, so block ids from 32 up are out of range.
LAYOUT = CacheLayout("fuzz-model", num_layers=2, num_blocks=32, block_size=4, num_kv_heads=1, head_dim=8)
NUM_BLOCKS = LAYOUT.num_blocks
#: A region list that matches LAYOUT, so a registration gets as far as its handles.
VALID_REGIONS = [{"name": r.name, "handle": 0, "offset": 0, "stride": r.block_bytes} for r in LAYOUT.regions]
#: Stands for "a fresh unique request id" in a frame body; replaced when the frame is sent.
FRESH_ID = "<fresh id>"
#: Codes a frame without a readable id can get: it failed to decode before its id was known.
NULL_ID_CODES = frozenset({"bad_request", "too_large"})
ENVELOPE = frozenset({"v", "id", "op", "timeout_ms"})


@dataclass(frozen=True)
class Frame:
    kind: str
    body: Any = None  # packed with msgpack (FRESH_ID replaced) unless raw is set
    raw: bytes | None = None
    cut: float | None = None  # keep this fraction of the packed bytes: truncated msgpack
    expect: str | None = None  # "ok", one error code, or None: any typed answer
    prefix: tuple[bytes, ...] = ()  # leading ZMQ frames, echoed back by the ROUTER


def readable_id(payload: bytes) -> int | None:
    """The id a daemon can answer under: the protocol's rule, restated independently. A frame
    past a shape limit (docs/protocol.md, Limits) is answered with a null id."""
    if len(payload) > MAX_MESSAGE_BYTES:
        return None
    items = 0

    def count(container: Any) -> Any:
        nonlocal items
        items += len(container) + 1
        return container

    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_str_len=1024, max_bin_len=1024,
                              max_array_len=2 * 8192, max_map_len=64, max_ext_len=0, list_hook=count,
                              object_hook=count)
    except Exception:
        return None
    if items > 65_536:
        return None
    raw = msg.get("id") if isinstance(msg, dict) else None
    return raw if type(raw) is int and 0 <= raw <= 2**64 - 1 else None


def _fill(body: Any, fresh: int) -> Any:
    if isinstance(body, dict):
        return {k: (fresh if v == FRESH_ID and k == "id" else v) for k, v in body.items()}
    return body


def materialize(frame: Frame, fresh: int) -> bytes:
    if frame.raw is not None:
        return frame.raw
    payload = msgpack.packb(_fill(frame.body, fresh), use_bin_type=True)
    if frame.cut is not None:
        payload = payload[: int(len(payload) * frame.cut)]
    return payload


# -- strategies -------------------------------------------------------------------------------

#: Integers msgpack can carry (int64 and uint64).
packable_int = st.integers(-(2**63), 2**64 - 1)
valid_keys_alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:=+-"
valid_key = st.builds(lambda head, tail: head + tail,
                      st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_"),
                      st.text(valid_keys_alphabet, max_size=24))
bad_key = st.one_of(
    st.sampled_from(["", ".", "..", "../etc/passwd", "/abs/path", "a/b", "a\\b", "a b", "k\x00", "-lead", ".hidden",
                     ":colon", "é", "k" * 129, "\u202e", "a\nb"]),
    st.text(max_size=12).filter(lambda s: not s or s[0] not in valid_keys_alphabet[:63]
                                or any(c not in valid_keys_alphabet for c in s)),
    st.integers(-5, 5), st.none(), st.binary(max_size=6), st.floats(), st.lists(packable_int, max_size=2),
)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=12),
                    st.binary(max_size=12))
garbage = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.text(max_size=6), inner, max_size=4),
    st.dictionaries(st.integers(-3, 3), inner, min_size=1, max_size=2),  # non-string keys: unparseable
), max_leaves=10)
bad_request_id = st.one_of(st.integers(-(2**63), -1), st.floats(), st.text(max_size=8), st.booleans(), st.none(),
                           st.lists(st.integers(0, 3), max_size=2), st.binary(max_size=4))
bad_block_id = st.one_of(st.integers(-(2**63), -1), st.integers(MAX_BLOCK_ID + 1, 2**64 - 1), st.booleans(),
                         st.floats(), st.text(max_size=4), st.none())
bad_timeout = st.one_of(st.integers(-(2**63), -1), st.integers(MAX_TIMEOUT_MS + 1, 2**64 - 1), st.floats(),
                        st.text(max_size=4), st.booleans(), st.lists(packable_int, max_size=1))
prefix = st.one_of(st.just(()), st.just(()), st.just(()), st.lists(st.binary(max_size=8), min_size=1,
                                                                        max_size=2).map(tuple))


@st.composite
def valid_request(draw) -> dict[str, Any]:
    """A request the daemon must accept (it can still answer it with an error: not here)."""
    op = draw(st.sampled_from(["ping", "hello", "stats", "flush", "lookup", "delete", "swap_out", "swap_in"]))
    body: dict[str, Any] = {"v": 1, "id": FRESH_ID, "op": op}
    if draw(st.booleans()):
        body["timeout_ms"] = draw(st.integers(5_000, 60_000))
    if op == "hello" and draw(st.booleans()):
        body["client"] = draw(st.text(max_size=40))
    if op in ("lookup", "delete", "swap_out", "swap_in"):
        keys = draw(st.lists(valid_key, max_size=8))
        body["keys"] = keys
        if op in ("swap_out", "swap_in"):
            body["block_ids"] = draw(st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=len(keys), max_size=len(keys)))
        if op == "swap_out" and draw(st.booleans()):
            body["wait"] = draw(st.sampled_from(["copied", "persisted"]))
    return body


@st.composite
def one_mutation(draw) -> Frame:
    """A valid request with exactly one thing wrong, and the code that thing must produce."""
    body = draw(valid_request())
    op = body["op"]
    choices = ["version", "op", "timeout", "unknown_field", "request_id"]
    if op in ("lookup", "delete", "swap_out", "swap_in"):
        choices += ["keys_type", "bad_key", "too_many_keys"]
    if op in ("swap_out", "swap_in"):
        choices += ["missing", "blocks_type", "bad_block", "too_many_blocks", "out_of_range", "length_mismatch"]
    if op == "swap_out":
        choices.append("wait")
    if op == "hello":
        choices.append("client")
    what = draw(st.sampled_from(choices))
    if what == "version":
        version = draw(st.one_of(st.sampled_from([0, 2, -1, 255, "1", True, None, 1.0, [1]]), st.integers(2, 2**32)))
        body["v"] = version
        if version is None and draw(st.booleans()):
            del body["v"]
        return Frame("mutation", body, expect="unsupported_version")
    if what == "op":
        body["op"] = draw(st.one_of(st.text(max_size=12).filter(lambda s: s not in REQUEST_TYPES),
                                    packable_int, st.none(), st.lists(packable_int, max_size=2)))
        if body["op"] is None and draw(st.booleans()):
            del body["op"]
        return Frame("mutation", body, expect="unknown_op")
    if what == "timeout":
        body["timeout_ms"] = draw(bad_timeout)
        return Frame("mutation", body, expect="bad_request")
    if what == "unknown_field":
        allowed = ENVELOPE | set(REQUEST_TYPES[op].checks)
        body[draw(st.text(max_size=10).filter(lambda s: s not in allowed))] = draw(scalars)
        return Frame("mutation", body, expect="bad_request")
    if what == "request_id":
        if draw(st.booleans()):
            del body["id"]
        else:
            body["id"] = draw(bad_request_id)
        return Frame("mutation", body, expect="bad_request")
    if what == "keys_type":
        body["keys"] = draw(st.one_of(st.text(max_size=5), packable_int, st.none(), st.dictionaries(
            st.text(max_size=3), packable_int, max_size=2), st.binary(max_size=4)))
        return Frame("mutation", body, expect="bad_request")
    if what == "bad_key":
        keys = list(body["keys"]) or [draw(valid_key)]
        keys[draw(st.integers(0, len(keys) - 1))] = draw(bad_key)
        body["keys"] = keys
        if "block_ids" in body:
            body["block_ids"] = [0] * len(keys)
        return Frame("mutation", body, expect="invalid_key")
    if what == "too_many_keys":
        count = draw(st.sampled_from([MAX_KEYS_PER_REQUEST + 1, MAX_KEYS_PER_REQUEST + 77, 100_000]))
        body["keys"] = ["k"] * count
        return Frame("mutation", body, expect="too_large")  # counted before pairing with block_ids
    if what == "missing":
        del body[draw(st.sampled_from(["keys", "block_ids"]))]
        return Frame("mutation", body, expect="bad_request")
    if what == "blocks_type":
        body["block_ids"] = draw(st.one_of(packable_int, st.text(max_size=4), st.none(),
                                           st.dictionaries(st.text(max_size=2), packable_int, max_size=2)))
        return Frame("mutation", body, expect="bad_request")
    if what == "bad_block":
        blocks = list(body["block_ids"]) or [0]
        blocks[draw(st.integers(0, len(blocks) - 1))] = draw(bad_block_id)
        body["block_ids"] = blocks
        body["keys"] = [f"k{i}" for i in range(len(blocks))]
        return Frame("mutation", body, expect="bad_request")
    if what == "too_many_blocks":
        body["block_ids"] = [0] * draw(st.sampled_from([MAX_KEYS_PER_REQUEST + 1, 100_000]))
        if op == "swap_in":  # swap_in checks keys first; make them fine so block_ids are counted
            body["keys"] = ["k"] * len(body["keys"])
        return Frame("mutation", body, expect="too_large")
    if what == "out_of_range":
        keys = list(body["keys"]) or [draw(valid_key)]
        blocks = [0] * len(keys)
        blocks[draw(st.integers(0, len(keys) - 1))] = draw(st.integers(NUM_BLOCKS, MAX_BLOCK_ID))
        body["keys"], body["block_ids"] = keys, blocks
        return Frame("mutation", body, expect="out_of_range")
    if what == "length_mismatch":
        body["block_ids"] = list(body["block_ids"]) + [0] * draw(st.integers(1, 3))
        return Frame("mutation", body, expect="bad_request")
    if what == "wait":
        body["wait"] = draw(st.one_of(st.sampled_from(["", "Copied", "persist", "none"]), packable_int, st.none(),
                                      st.booleans()))
        return Frame("mutation", body, expect="bad_request")
    if what == "client":
        body["client"] = draw(st.one_of(packable_int, st.none(), st.text(min_size=257, max_size=300),
                                        st.lists(st.text(max_size=2), max_size=2)))
        return Frame("mutation", body, expect="bad_request")
    raise AssertionError(what)


@st.composite
def garbage_request(draw) -> Frame:
    """A known op whose fields (and envelope, sometimes) are anything at all."""
    op = draw(st.sampled_from(sorted(REQUEST_TYPES)))
    body: dict[Any, Any] = {"v": 1, "id": FRESH_ID, "op": op}
    names = list(REQUEST_TYPES[op].checks) + ["timeout_ms", "wait", "extra"]
    for name in draw(st.lists(st.sampled_from(names), unique=True, max_size=4)):
        body[name] = draw(garbage)
    if op in ("unregister", "clear"):
        # Never valid: the session keeps its registration, and what it stored before the fuzz.
        body["extra"] = 1
    if op == "register":
        body.setdefault("layout", draw(st.one_of(garbage, st.just(LAYOUT.to_wire()), layout_garbage())))
        body.setdefault("handles", draw(st.one_of(garbage, handles_garbage())))
        body.setdefault("regions", draw(st.one_of(garbage, st.just(VALID_REGIONS))))
    if draw(st.integers(0, 9)) == 0:
        body["v"] = draw(scalars)
    return Frame("garbage_request", body)


@st.composite
def layout_garbage(draw) -> dict[str, Any]:
    """A layout with plausible names and implausible values (huge layer counts included)."""
    wire = LAYOUT.to_wire()
    for name in draw(st.lists(st.sampled_from(sorted(wire)), unique=True, min_size=1, max_size=3)):
        wire[name] = draw(st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from([0, 1, 2**31, 10**9]), scalars))
    return wire


@st.composite
def handles_garbage(draw) -> list[dict[str, Any]]:
    name = draw(st.one_of(st.sampled_from(["../../etc/passwd", "/dev/shm/x", "kvswap-nope", "", ".", "a" * 300]),
                          st.text(max_size=20)))
    return [{"kind": draw(st.sampled_from(["shm", "cuda_ipc", "file", ""])), "name": name,
             "size": draw(st.one_of(st.integers(-(2**63), 2**64 - 1), scalars))}]


@st.composite
def register_attempt(draw) -> Frame:
    """A well-formed register whose layout or memory handle cannot be accepted: it must get
    as far as the daemon's checks and fail them, never map anything."""
    layout = draw(st.one_of(st.just(LAYOUT.to_wire()), layout_garbage()))
    body = {"v": 1, "id": FRESH_ID, "op": "register", "layout": layout, "handles": draw(handles_garbage()),
            "regions": VALID_REGIONS}
    return Frame("register", body, expect="invalid_layout")


frame_strategy = st.one_of(
    one_mutation(),
    st.builds(lambda raw: Frame("random_bytes", raw=raw), st.binary(max_size=256)),
    st.builds(lambda body, cut: Frame("truncated", body, cut=cut, expect="bad_request"),
              st.one_of(valid_request(), garbage_request().map(lambda f: f.body)), st.floats(0.0, 0.99)),
    st.builds(lambda value: Frame("msgpack_value", value), garbage),
    st.builds(lambda body: Frame("valid", body, expect="ok"), valid_request()),
    # Listed again to be drawn more often: these carry exact expectations, or reach deepest.
    one_mutation(), one_mutation(), one_mutation(),
    garbage_request(), garbage_request(),
    register_attempt(),
).flatmap(lambda f: prefix.map(lambda p: Frame(f.kind, f.body, f.raw, f.cut, f.expect, p)))
batch_strategy = st.lists(frame_strategy, min_size=8, max_size=16)


def canonical_frames() -> list[Frame]:
    """One frame of each family with the exact code it must get, so every run covers them all
    whatever the generator happens to draw."""
    def req(**fields: Any) -> dict[str, Any]:
        return {"v": 1, "id": FRESH_ID, **fields}

    swap_in = req(op="swap_in", keys=["a", "b"], block_ids=[0, 1])
    return [
        Frame("canonical", raw=b"\xc1 not msgpack", expect="bad_request"),
        Frame("canonical", swap_in, cut=0.5, expect="bad_request"),
        Frame("canonical", [1, 2, 3], expect="bad_request"),
        Frame("canonical", req(op="explode"), expect="unknown_op"),
        Frame("canonical", {**req(op="ping"), "v": 2}, expect="unsupported_version"),
        Frame("canonical", req(op="lookup", keys="abc"), expect="bad_request"),
        Frame("canonical", req(op="lookup", keys=["../etc/passwd"]), expect="invalid_key"),
        Frame("canonical", req(op="lookup", keys=["k"] * (MAX_KEYS_PER_REQUEST + 1)), expect="too_large"),
        Frame("canonical", req(op="swap_in", keys=["a"], block_ids=[NUM_BLOCKS]), expect="out_of_range"),
        Frame("canonical", req(op="swap_out", keys=["a"], block_ids=[MAX_BLOCK_ID]), expect="out_of_range"),
        Frame("canonical", req(op="swap_in", keys=["a"], block_ids=[-1]), expect="bad_request"),
        Frame("canonical", req(op="register", layout={**LAYOUT.to_wire(), "num_layers": 10**9},
                               handles=[{"kind": "shm", "name": "x", "size": 1}], regions=VALID_REGIONS),
              expect="invalid_layout"),
        Frame("canonical", req(op="register", layout=LAYOUT.to_wire(),
                               handles=[{"kind": "shm", "name": "../../etc/passwd", "size": 1}],
                               regions=VALID_REGIONS), expect="invalid_layout"),
        Frame("canonical", {**req(op="ping"), "id": 2**64 - 1}, expect="ok"),
        Frame("canonical", {**req(op="ping"), "id": 0}, expect="ok"),
        Frame("canonical", swap_in, expect="ok", prefix=(b"", b"envelope")),
    ]


# -- the session ------------------------------------------------------------------------------------


class FuzzFailure(AssertionError):
    pass


@dataclass
class FuzzSession:
    """One DEALER socket to one daemon; sends batches and checks their answers."""

    endpoint: str
    reply_timeout_s: float = 30.0
    #: The daemon's count of answers sent (``DaemonProcess.answers``), for :meth:`finish`.
    answers: Callable[[], float] | None = None
    frames: int = 0
    codes: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.endpoint)
        self._ids = itertools.count(1 << 40)
        self._outstanding: set[int] = set()
        #: Every answer that came off the socket.
        self.replies = 0
        self._answers_before = self.answers() if self.answers is not None else 0.0

    def close(self) -> None:
        self.sock.close()

    def finish(self, quiet_s: float = 0.5) -> None:
        """After the last batch. With ``answers`` (the daemon's own count of the answers it
        sent, read at the start and now), the count must equal the answers that arrived: a
        duplicate sent after its request was answered makes it larger, and nothing waits for
        silence. Without it (a daemon whose metrics are not at hand), nothing may arrive
        within ``quiet_s``."""
        if self.answers is None:
            if self.sock.poll(int(quiet_s * 1000)):
                raise FuzzFailure(f"an answer after every frame was answered: {self.sock.recv_multipart()!r:.300}")
            return
        deadline = time.monotonic() + 10.0
        while (sent := self.answers() - self._answers_before) < self.replies and time.monotonic() < deadline:
            time.sleep(0.05)  # the scrape may run a moment ahead of the last answer's count
        if sent != self.replies:
            late = self.sock.recv_multipart() if self.sock.poll(0) else None
            raise FuzzFailure(f"the daemon sent {sent:.0f} answers, {self.replies} arrived; first extra: {late!r:.300}")
        if self.sock.poll(0):
            raise FuzzFailure(f"an answer after every frame was answered: {self.sock.recv_multipart()!r:.300}")

    def run_batch(self, frames: Iterable[Frame]) -> None:
        """Send the frames, each group followed by a ping, and read until every frame has
        exactly its answer. A group ends early where a frame of arbitrary content carries an
        id already waiting (ids must be unique among the unanswered)."""
        group: list[tuple[Frame, bytes, int | None]] = []
        for frame in frames:
            payload = materialize(frame, next(self._ids))
            rid = readable_id(payload)
            if rid is not None and any(rid == other for _, _, other in group):
                self._run_group(group)
                group = []
            group.append((frame, payload, rid))
        self._run_group(group)

    def _run_group(self, group: list[tuple[Frame, bytes, int | None]]) -> None:
        ping = Frame("ping", {"v": 1, "id": FRESH_ID, "op": "ping"}, expect="ok")
        ping_payload = materialize(ping, next(self._ids))
        by_id: dict[int, Frame] = {}
        nulls: list[Frame] = []
        for frame, payload, rid in [*group, (ping, ping_payload, readable_id(ping_payload))]:
            if rid is None:
                nulls.append(frame)
            else:
                by_id[rid] = frame
            self.sock.send_multipart([*frame.prefix, payload])
            if frame.kind != "ping":
                self.kinds[frame.kind] += 1
                self.frames += 1
        waiting, null_left = set(by_id), len(nulls)
        deadline = time.monotonic() + self.reply_timeout_s
        while waiting or null_left:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1):
                raise FuzzFailure(f"no answer within {self.reply_timeout_s} s to {len(waiting)} requests "
                                  f"({[by_id[i] for i in list(waiting)[:3]]}) and {null_left} id-less frames")
            parts = self.sock.recv_multipart()
            self.replies += 1
            reply = self._check_reply(parts[-1])
            rid = reply["id"]
            if rid is None:
                null_left -= 1
                if null_left < 0:
                    raise FuzzFailure(f"more id-less answers than id-less frames: {reply}")
                if reply["error"]["code"] not in NULL_ID_CODES:
                    raise FuzzFailure(f"an id-less frame got {reply}")
                self.codes[reply["error"]["code"]] += 1
                continue
            answered = by_id.get(rid)
            if answered is None or rid not in waiting:
                raise FuzzFailure(f"answer to an id that is not waiting (duplicate or stray): {reply}")
            waiting.discard(rid)
            if list(parts[:-1]) != list(answered.prefix):
                raise FuzzFailure(f"envelope not echoed: sent {answered.prefix}, got {parts[:-1]}")
            code = "ok" if reply["ok"] else reply["error"]["code"]
            if answered.expect is not None and code != answered.expect:
                raise FuzzFailure(f"{answered.kind} frame {answered.body!r:.300} expected {answered.expect}, "
                                  f"got {reply!r:.500}")
            if answered.kind != "ping":
                self.codes[code] += 1

    @staticmethod
    def _check_reply(data: bytes) -> dict[str, Any]:
        try:
            reply = msgpack.unpackb(data, raw=False)
        except Exception as exc:
            raise FuzzFailure(f"an answer that is not msgpack: {exc}: {data[:100]!r}") from None
        if not isinstance(reply, dict) or reply.get("v") != 1 or "id" not in reply or type(reply.get("ok")) is not bool:
            raise FuzzFailure(f"malformed answer {reply!r:.300}")
        if reply["ok"]:
            if set(reply) != {"v", "id", "ok", "result"} or not isinstance(reply["result"], dict):
                raise FuzzFailure(f"malformed ok answer {reply!r:.300}")
            return reply
        error = reply.get("error")
        if (set(reply) != {"v", "id", "ok", "error"} or not isinstance(error, dict)
                or error.get("code") not in ERRORS_BY_CODE or not isinstance(error.get("message"), str)
                or not error["message"] or not isinstance(error.get("details"), dict)):
            raise FuzzFailure(f"malformed or untyped error answer {reply!r:.300}")
        if error["code"] == "internal":
            raise FuzzFailure(f"the daemon hit a bug: {reply!r:.500}")
        return reply
