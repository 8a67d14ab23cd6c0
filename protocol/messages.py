"""Wire messages, version 1: pure functions over bytes, no I/O.

A request is a msgpack map ``{"v": 1, "id": <uint>, "op": <str>, "timeout_ms": <uint>?,
"deadline_ns": <uint>?, ...}``
with the op's own fields beside the envelope. A reply is ``{"v": 1, "id": <uint>, "ok": true,
"result": {...}}`` or ``{"v": 1, "id": <uint>, "ok": false, "error": {"code", "message",
"details"}}``. A frame whose id cannot be read is answered with ``"id": null``.

Example: ``encode_request(Ping(id=7))`` is ``b"\\x83\\xa1v\\x01\\xa2id\\x07\\xa2op\\xa4ping"``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, Final

import msgpack

from .errors import BadRequest, KvswapError, TooLarge, UnknownOp, UnsupportedVersion, from_wire, to_wire
from .kv_events import BlockMeta, metas_from_wire
from .limits import (
    MAX_BLOCK_ID,
    MAX_ECHO_CHARS,
    MAX_FRAME_ITEMS,
    MAX_KEYS_PER_REQUEST,
    MAX_MAP_ENTRIES,
    MAX_MESSAGE_BYTES,
    MAX_REGIONS,
    MAX_STRING_BYTES,
    MAX_TIMEOUT_MS,
    MAX_WAIT_MS,
    PROTOCOL_VERSION,
    check_count,
    check_keys,
)

MAX_REQUEST_ID: Final = 2**64 - 1
#: The request fields that are not the op's own.
ENVELOPE: Final = ("id", "timeout_ms", "deadline_ns")
WAIT_MODES: Final = ("copied", "persisted")


class DecodeError(Exception):
    """A frame that is not a valid request. ``error`` is the typed error to answer with;
    ``request_id`` is set when the id could be read, so the answer still reaches the caller."""

    def __init__(self, error: KvswapError, request_id: int | None, op: str | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.request_id = request_id
        #: The op, when the frame named a known one (for metrics and logs).
        self.op = op


# -- field checkers: each takes the raw value and returns the typed one, or raises ----------


def _uint(limit: int) -> Callable[[str, Any], int]:
    def check(name: str, value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
            raise BadRequest(f"{name} must be an integer in 0..{limit}", field=name)
        return value

    return check


def _keys(name: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise BadRequest(f"{name} must be a list of strings", field=name)
    check_count(name, len(value))
    return check_keys(value)


def _block_ids(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise BadRequest(f"{name} must be a list of integers", field=name)
    check_count(name, len(value))
    for i, b in enumerate(value):
        if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b <= MAX_BLOCK_ID:
            raise BadRequest(f"{name}[{i}] must be an integer in 0..{MAX_BLOCK_ID}", field=name, index=i)
    return tuple(value)


def _wait(name: str, value: Any) -> str:
    if value not in WAIT_MODES:
        raise BadRequest(f"{name} must be one of {list(WAIT_MODES)}", field=name)
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false", field=name)
    return value


def _map(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRequest(f"{name} must be a map", field=name)
    return value


def _map_list(name: str, value: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise BadRequest(f"{name} must be a list of maps", field=name)
    check_count(name, len(value), MAX_REGIONS)
    return tuple(value)


def _short_str(name: str, value: Any) -> str:
    if not isinstance(value, str) or len(value) > 256:
        raise BadRequest(f"{name} must be a string of at most 256 characters", field=name)
    return value


# -- requests -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    op: ClassVar[str] = ""
    #: Field name -> checker; the dataclass fields after the envelope's.
    checks: ClassVar[dict[str, Callable[[str, Any], Any]]] = {}
    #: Fields added after version 1 shipped: left off the wire at their default, so frames
    #: stay byte-identical for peers that never use them.
    omit_default: ClassVar[frozenset[str]] = frozenset()

    id: int
    timeout_ms: int | None = field(default=None, kw_only=True)
    #: The latest instant, on this host's CLOCK_MONOTONIC in ns, at which the request may still
    #: start or touch engine memory: a deadline that does not wait for the frame to be read (a
    #: daemon stopped or behind must not copy into blocks the engine gave up on).
    deadline_ns: int | None = field(default=None, kw_only=True)

    def body(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):
            if f.name in ENVELOPE:
                continue
            value = getattr(self, f.name)
            if f.name in self.omit_default and value == f.default:
                continue
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def validate(self) -> None:
        """Checks across fields, after each field passed its own."""


@dataclass(frozen=True)
class Hello(Request):
    op = "hello"
    checks = {"client": _short_str}
    client: str = ""


@dataclass(frozen=True)
class Ping(Request):
    op = "ping"


@dataclass(frozen=True)
class Register(Request):
    op = "register"
    # A pid is a C int (os.kill overflows beyond it); Linux caps pids at 2**22 anyway.
    checks = {"layout": _map, "handles": _map_list, "regions": _map_list, "pid": _uint(2**31 - 1)}
    layout: dict[str, Any] = field(default_factory=dict)
    handles: tuple[dict[str, Any], ...] = ()
    regions: tuple[dict[str, Any], ...] = ()
    pid: int = 0


#: Who sends a request that uses the registration (swap_out, swap_in, unregister): the
#: ``token`` its client got from ``register`` and the sender's ``pid``. The client attaches
#: both itself; left off the wire when unset.
_OWNER_CHECKS: Final = {"token": _short_str, "pid": _uint(2**31 - 1)}
_OWNER_FIELDS: Final = frozenset(_OWNER_CHECKS)


@dataclass(frozen=True)
class Unregister(Request):
    op = "unregister"
    checks = dict(_OWNER_CHECKS)
    omit_default = _OWNER_FIELDS
    token: str = ""
    pid: int = 0


def _raw_list(name: str, value: Any) -> tuple[Any, ...]:
    if not isinstance(value, list):
        raise BadRequest(f"{name} must be a list", field=name)
    check_count(name, len(value))
    return tuple(value)


@dataclass(frozen=True)
class SwapOut(Request):
    op = "swap_out"
    checks = {"block_ids": _block_ids, "keys": _keys, "wait": _wait, "partial": _bool, "block_meta": _raw_list,
              **_OWNER_CHECKS}
    omit_default = frozenset({"partial", "block_meta"}) | _OWNER_FIELDS
    block_ids: tuple[int, ...] = ()
    keys: tuple[str, ...] = ()
    wait: str = "copied"
    #: When staging is short, store what fits and report the rest "skipped" instead of
    #: refusing the whole request with ``busy``.
    partial: bool = False
    #: For KV events (protocol/kv_events.py): one entry per key, the engine's block hashes and
    #: tokens of that record (a map), or nil; empty: none sent. Wire maps in, checked by
    #: :meth:`metas`.
    block_meta: tuple[Any, ...] = ()
    token: str = ""
    pid: int = 0

    def validate(self) -> None:
        check_pair(self.keys, self.block_ids)
        self.metas()

    def metas(self) -> tuple[BlockMeta | None, ...]:
        """The checked ``block_meta`` (empty when none was sent), parsed once; raises
        ``BadRequest``."""
        parsed = self.__dict__.get("_metas")
        if parsed is None:
            parsed = metas_from_wire(list(self.block_meta), self.keys) if self.block_meta else ()
            object.__setattr__(self, "_metas", parsed)  # a cache on a frozen message, not a field
        return parsed


@dataclass(frozen=True)
class SwapIn(Request):
    op = "swap_in"
    checks = {"keys": _keys, "block_ids": _block_ids, **_OWNER_CHECKS}
    omit_default = _OWNER_FIELDS
    keys: tuple[str, ...] = ()
    block_ids: tuple[int, ...] = ()
    token: str = ""
    pid: int = 0

    def validate(self) -> None:
        check_pair(self.keys, self.block_ids)


def _peer_address(name: str, value: Any) -> str:
    """A peer daemon's address as its ``--peer-address`` says it: a ZMQ ``tcp://`` endpoint."""
    if not isinstance(value, str) or len(value) > 256 or (value and not value.startswith("tcp://")):
        raise BadRequest(f"{name} must be a tcp:// endpoint of at most 256 characters", field=name)
    return value


def _namespace(name: str, value: Any) -> str:
    if not isinstance(value, str) or re.fullmatch(r"[0-9a-f]{32}", value) is None:
        raise BadRequest(f"{name} must be a namespace fingerprint (32 lowercase hex digits)", field=name)
    return value


TRANSPORTS: Final = ("mooncake", "inline")


def _transport(name: str, value: Any) -> str:
    if value not in TRANSPORTS:
        raise BadRequest(f"{name} must be one of {list(TRANSPORTS)}", field=name)
    return value


@dataclass(frozen=True)
class Lookup(Request):
    op = "lookup"
    checks = {"keys": _keys, "peer": _peer_address, "wait_ms": _uint(MAX_WAIT_MS)}
    omit_default = frozenset({"peer", "wait_ms"})
    keys: tuple[str, ...] = ()
    #: Prefill/decode disaggregation: a peer daemon's ``--peer-address``; the keys past this
    #: daemon's own prefix are pulled from it before the answer ("": look here only).
    peer: str = ""
    #: How long keys still on their way may be waited for (bounded by the deadline).
    wait_ms: int = 0


@dataclass(frozen=True)
class PeerExport(Request):
    """Daemon to daemon: hold the longest present prefix of ``keys`` (records of
    ``namespace``) for the asking daemon, waiting up to ``wait_ms`` for keys on their way."""

    op = "peer_export"
    checks = {"keys": _keys, "namespace": _namespace, "wait_ms": _uint(MAX_WAIT_MS), "transport": _transport}
    keys: tuple[str, ...] = ()
    namespace: str = ""
    wait_ms: int = 0
    #: What the asking daemon can receive: "mooncake" (a transfer-engine read) or "inline".
    transport: str = "inline"


@dataclass(frozen=True)
class PeerRelease(Request):
    """Daemon to daemon: the records held under ``lease`` were read; free them."""

    op = "peer_release"
    checks = {"lease": _short_str}
    lease: str = ""


@dataclass(frozen=True)
class Delete(Request):
    op = "delete"
    checks = {"keys": _keys}
    keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class Clear(Request):
    op = "clear"


@dataclass(frozen=True)
class Flush(Request):
    op = "flush"


@dataclass(frozen=True)
class Stats(Request):
    op = "stats"


REQUEST_TYPES: Final[dict[str, type[Request]]] = {
    cls.op: cls for cls in (Hello, Ping, Register, Unregister, SwapOut, SwapIn, Lookup, Delete, Clear, Flush, Stats,
                             PeerExport, PeerRelease)
}
#: Fields every op requires (the others default).
REQUIRED: Final[dict[str, tuple[str, ...]]] = {
    "register": ("layout", "handles", "regions"),
    "swap_out": ("block_ids", "keys"),
    "swap_in": ("keys", "block_ids"),
    "lookup": ("keys",),
    "delete": ("keys",),
    "peer_export": ("keys", "namespace"),
    "peer_release": ("lease",),
}

# -- replies --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    id: int | None
    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    error: KvswapError | None = None


# -- codec ----------------------------------------------------------------------------------

#: How many leading entries of a refused frame's map are searched for its id: encoders write
#: the envelope first, and a bounded search keeps the answer to a refused frame cheap.
PEEK_ENTRIES: Final = 8


#: msgpack's words for a string or container past a limit: "70000 exceeds max_map_len(64)".
#: An extension value (max_ext_len is 0) is not past a limit: the schema has no extension types at
#: all, so such a frame is malformed (``bad_request``), not too large.
_OVER_LIMIT: Final = re.compile(r"(\d+) exceeds max_(str|bin|array|map)_len")


class _ItemBudget:
    """msgpack hook for every map and list of a request: counts their entries and stops the
    decode once MAX_FRAME_ITEMS are spent. Hooks run as each container is finished, so a
    frame of a million nested empty maps stops after MAX_FRAME_ITEMS of them."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_FRAME_ITEMS

    def __call__(self, container: Any) -> Any:
        self.left -= len(container) + 1
        if self.left < 0:
            raise TooLarge(f"the frame holds more than {MAX_FRAME_ITEMS} items", limit=MAX_FRAME_ITEMS)
        return container


def _check_size(frame: bytes | memoryview) -> None:
    if len(frame) > MAX_MESSAGE_BYTES:
        raise TooLarge(f"message of {len(frame)} bytes, the limit is {MAX_MESSAGE_BYTES}",
                       size=len(frame), limit=MAX_MESSAGE_BYTES)


def _unpack_request(frame: bytes | memoryview) -> Any:
    """Decode a request frame within the shape limits; raise a typed error past them."""
    _check_size(frame)
    budget = _ItemBudget()
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=True, max_str_len=MAX_STRING_BYTES,
                               max_bin_len=MAX_STRING_BYTES, max_array_len=2 * MAX_KEYS_PER_REQUEST,
                               max_map_len=MAX_MAP_ENTRIES, max_ext_len=0, list_hook=budget, object_hook=budget)
    except ValueError as exc:
        over = _OVER_LIMIT.match(str(exc))  # a string or container past a limit
        # One whose claimed size the frame could not even hold is a malformed frame instead.
        if over is not None and int(over[1]) * (2 if over[2] == "map" else 1) <= len(frame):
            raise TooLarge(f"the frame breaks a shape limit: {str(exc)[:MAX_ECHO_CHARS]}") from None
        raise BadRequest(f"not a msgpack message: {type(exc).__name__}") from None
    except (TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        # ValueError above covers UnicodeDecodeError and truncated input.
        raise BadRequest(f"not a msgpack message: {type(exc).__name__}") from None


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _build(cls: type[Request], msg: dict[str, Any], request_id: int) -> Request:
    """The field checks of one op, run by the daemon on what it received and by the client on
    what it is about to send, so both refuse the same requests with the same error."""
    timeout_ms = msg.get("timeout_ms")
    if timeout_ms is not None:
        timeout_ms = _uint(MAX_TIMEOUT_MS)("timeout_ms", timeout_ms)
    deadline_ns = msg.get("deadline_ns")
    if deadline_ns is not None:
        deadline_ns = _uint(MAX_REQUEST_ID)("deadline_ns", deadline_ns)
    unknown = set(msg) - {"v", "op", *ENVELOPE} - set(cls.checks)
    if unknown:
        # Names only, shortened: a reply never repeats more than a few KiB of what a peer sent.
        names = sorted(str(n)[:MAX_ECHO_CHARS] for n in unknown)[:16]
        raise BadRequest(f"unknown fields for {cls.op}", fields=names)
    missing = [name for name in REQUIRED.get(cls.op, ()) if name not in msg]
    if missing:
        raise BadRequest(f"missing fields for {cls.op}", fields=missing)
    kwargs = {name: check(name, msg[name]) for name, check in cls.checks.items() if name in msg}
    request = cls(id=request_id, timeout_ms=timeout_ms, deadline_ns=deadline_ns, **kwargs)
    request.validate()
    return request


def encode_request(request: Request) -> bytes:
    """The frame of ``request``. Raises the typed error the daemon would answer with
    (:class:`TooLarge`, :class:`InvalidKey`, :class:`BadRequest`, ...) instead of returning a
    frame it would refuse: a lookup of 9,000 keys fails here, before anything is sent. The
    check is the daemon's own: the frame is decoded by :func:`decode_request`."""
    if not _valid_id(request.id):
        raise BadRequest(f"id must be an integer in 0..{MAX_REQUEST_ID}", field="id")
    msg: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": request.id, "op": request.op}
    if request.timeout_ms is not None:
        msg["timeout_ms"] = request.timeout_ms
    if request.deadline_ns is not None:
        msg["deadline_ns"] = request.deadline_ns
    msg.update(request.body())
    frame = _pack(msg)
    try:
        decode_request(frame)
    except DecodeError as exc:
        raise exc.error from None
    return frame


def _valid_id(raw: Any) -> bool:
    return isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw <= MAX_REQUEST_ID


def _unpacker(frame: bytes | memoryview) -> msgpack.Unpacker:
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(frame), 1), max_str_len=MAX_STRING_BYTES,
                                max_bin_len=MAX_STRING_BYTES, max_array_len=2 * MAX_KEYS_PER_REQUEST,
                                max_map_len=MAX_MAP_ENTRIES, max_ext_len=0)
    unpacker.feed(frame)
    return unpacker


def _container_at(frame: bytes | memoryview, offset: int) -> bool:
    """Whether the msgpack object at ``offset`` is a map or an array (fix, 16- or 32-bit)."""
    first = frame[offset]
    return 0x80 <= first <= 0x9F or 0xDC <= first <= 0xDF


def peek_id(frame: bytes | memoryview) -> int | None:
    """The request id of a frame, if it has a readable one (to address an early refusal).

    Cheap whatever the frame holds, and builds nothing: one pass of msgpack's ``skip`` checks
    the frame is one well-formed object within the shape limits (about 7 ms for the worst 4 MiB
    frame, against up to 1.8 s for a full decode of it without limits), then the first
    PEEK_ENTRIES entries of its map are searched for the id."""
    if len(frame) > MAX_MESSAGE_BYTES:
        return None
    try:
        whole = _unpacker(frame)
        whole.skip()
        if whole.tell() != len(frame):
            return None  # trailing bytes: not one message
        unpacker = _unpacker(frame)
        for _ in range(min(unpacker.read_map_header(), PEEK_ENTRIES)):
            if _container_at(frame, unpacker.tell()):
                return None  # a request's keys are strings; a container is not built here
            if unpacker.unpack() == "id":
                if _container_at(frame, unpacker.tell()):
                    return None
                raw = unpacker.unpack()
                return raw if _valid_id(raw) else None
            unpacker.skip()
    except Exception:  # malformed, over a limit, not a map: no readable id
        return None
    return None


def decode_request(frame: bytes | memoryview) -> Request:
    """Parse and validate one request frame; raise :class:`DecodeError` (carrying the id when
    it could be read) for anything else."""
    request_id = None
    known_op = None
    try:
        # A frame past a shape limit is answered with a null id: finding its id would cost a
        # pass over the whole frame, and no client sends one (encode_request refuses it).
        msg = _unpack_request(frame)
        if not isinstance(msg, dict):
            raise BadRequest("a request is a msgpack map")
        raw_id = msg.get("id")
        if isinstance(raw_id, int) and _valid_id(raw_id):
            request_id = raw_id
        else:
            raise BadRequest(f"id must be an integer in 0..{MAX_REQUEST_ID}", field="id")
        version = msg.get("v")
        if type(version) is not int or version != PROTOCOL_VERSION:  # True == 1 in Python
            raise UnsupportedVersion(f"protocol version must be {PROTOCOL_VERSION}", got=repr(msg.get("v"))[:32])
        op = msg.get("op")
        cls = REQUEST_TYPES.get(op) if isinstance(op, str) else None
        if cls is None:
            raise UnknownOp(f"unknown op {str(op)[:64]!r}", known=sorted(REQUEST_TYPES))
        known_op = cls.op
        return _build(cls, msg, request_id)
    except KvswapError as exc:
        raise DecodeError(exc, request_id, known_op) from None


def encode_reply(reply: Reply) -> bytes:
    msg: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": reply.id, "ok": reply.ok}
    if reply.ok:
        msg["result"] = reply.result
    else:
        assert reply.error is not None
        msg["error"] = to_wire(reply.error)
    try:
        return _pack(msg)
    except (TypeError, ValueError, OverflowError):
        if reply.ok:
            raise  # a result msgpack cannot carry is the daemon's bug; the caller answers internal
        # An error's details repeat a peer's values, which can be beyond what msgpack carries
        # (a stride of 2**61 times a block count): say them as text, keep the error's code.
        assert reply.error is not None
        msg["error"]["details"] = {str(k): str(v)[:MAX_ECHO_CHARS] for k, v in reply.error.details.items()}
        return _pack(msg)


def decode_reply(frame: bytes | memoryview) -> Reply:
    _check_size(frame)
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise BadRequest(f"not a msgpack message: {type(exc).__name__}") from None
    if not isinstance(msg, dict) or "ok" not in msg:
        raise BadRequest("a reply is a msgpack map with 'ok'")
    request_id = msg.get("id")
    if msg.get("ok") is True:
        result = msg.get("result") or {}
        return Reply(request_id, True, result if isinstance(result, dict) else {"value": result})
    return Reply(request_id, False, error=from_wire(msg.get("error")))


def decode_peer_reply(frame: bytes | memoryview) -> Reply:
    """A reply from another daemon (a peer_export's carries record bytes), decoded within
    bounds: at most the message limit, keys and records by the request limit, strings short.
    Anything else raises :class:`BadRequest`; a daemon must not trust its peer's frames more
    than an engine's."""
    if len(frame) > MAX_MESSAGE_BYTES + 4096:
        raise BadRequest("reply over the message limit", size=len(frame))
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True, max_str_len=64 * 1024,
                              max_bin_len=MAX_MESSAGE_BYTES, max_array_len=MAX_KEYS_PER_REQUEST,
                              max_map_len=MAX_MAP_ENTRIES, max_ext_len=0)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise BadRequest(f"not a msgpack reply: {type(exc).__name__}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("ok"), bool):
        raise BadRequest("a reply is a msgpack map with 'ok'")
    request_id = msg.get("id")
    if msg["ok"]:
        result = msg.get("result")
        if not isinstance(result, dict):
            raise BadRequest("a reply's result is a map")
        return Reply(request_id if isinstance(request_id, int) else None, True, result)
    return Reply(request_id if isinstance(request_id, int) else None, False, error=from_wire(msg.get("error")))


def check_pair(keys: tuple[str, ...], block_ids: tuple[int, ...]) -> None:
    """swap_out and swap_in pair keys with block ids one to one."""
    if len(keys) != len(block_ids):
        raise BadRequest("keys and block_ids must have the same length", keys=len(keys), block_ids=len(block_ids))


__all__ = [
    "DecodeError",
    "Request",
    "Reply",
    "REQUEST_TYPES",
    "decode_request",
    "encode_request",
    "decode_reply",
    "decode_peer_reply",
    "encode_reply",
    "check_pair",
]
