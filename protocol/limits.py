"""Protocol limits and the key grammar. A message beyond a limit is refused with a typed
error (``too_large``/``invalid_key``) by the daemon, and the client refuses to send it."""

from __future__ import annotations

import re
from typing import Final

from .errors import InvalidKey, TooLarge

PROTOCOL_VERSION: Final = 1

#: Largest frame the daemon reads; ZMQ enforces it too (``ZMQ_MAXMSGSIZE``), so a larger one
#: is dropped by the socket before it costs memory.
MAX_MESSAGE_BYTES: Final = 4 * 1024 * 1024
#: Keys (and block ids) in one swap_out, swap_in, lookup or delete.
MAX_KEYS_PER_REQUEST: Final = 8192
MAX_KEY_LENGTH: Final = 128
#: Handles and regions in one registration (two per layer plus scales, with room to spare).
MAX_REGIONS: Final = 4096
#: Largest block id accepted on the wire; the registered pool size bounds it further.
MAX_BLOCK_ID: Final = 2**31 - 1
#: Deadline bounds for one request, in milliseconds. The clients' default deadline, and the
#: daemon's for a request that brings none (``--default-timeout-ms``).
DEFAULT_TIMEOUT_MS: Final = 30_000
MAX_TIMEOUT_MS: Final = 3_600_000

# Shape limits a request frame must meet before it is decoded in full. msgpack checks each
# string and container against them as it reads its header, so a frame past them is refused
# before anything is built: a decode costs at most a bounded number of objects, whatever the
# frame holds (a 2.4 MB frame of 350k map keys took 0.25 s of the event loop before these).
#: Bytes of one string (or binary) anywhere in a request: keys are 128, names 256.
MAX_STRING_BYTES: Final = 1024
#: Entries of one map anywhere in a request (the envelope, a layout, a handle, a region).
MAX_MAP_ENTRIES: Final = 64
#: Entries of every container of one request together (a register of MAX_REGIONS regions
#: needs about 45,000; a swap of MAX_KEYS_PER_REQUEST keys about 16,400).
MAX_FRAME_ITEMS: Final = 65_536
#: Largest reply the daemon sends. A swap_out of MAX_KEYS_PER_REQUEST keys, each with an
#: error code for its status, is about 110 KB; error replies are at most a few KiB, because
#: nothing a peer sent is echoed beyond MAX_ECHO_CHARS characters.
MAX_REPLY_BYTES: Final = 256 * 1024
#: Longest ``wait_ms`` of a lookup or a peer_export: how long keys still on their way (a
#: prefill's swap_out in flight) may be waited for. The request's own deadline bounds it too.
MAX_WAIT_MS: Final = 60_000
#: Largest reply to ``peer_export``, the one reply that carries record bytes (the inline
#: transport): the message limit, like a request frame, not MAX_REPLY_BYTES.
MAX_PEER_REPLY_BYTES: Final = MAX_MESSAGE_BYTES
#: Room for the rest of an inline peer_export reply (keys, headers, the map itself) beside
#: the record bytes.
PEER_REPLY_OVERHEAD: Final = 64 * 1024
#: Characters of a peer's own input (a field name, an op, a key) repeated in an error reply.
MAX_ECHO_CHARS: Final = 128

#: Keys are engine block hashes (hex, base64url or ``prefix:hash`` forms). The alphabet has no
#: path separators and cannot start with a dot, and the daemon never uses a key as a path
#: anyway: file names are hashes of keys.
_KEY_RE: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:=+-]*")


def check_key(key: object, index: int | None = None) -> str:
    """Return ``key`` if it is a valid key, else raise :class:`InvalidKey`."""
    if not isinstance(key, str):
        raise InvalidKey("key must be a string", index=index)
    if not key or len(key) > MAX_KEY_LENGTH:
        raise InvalidKey(f"key length must be 1..{MAX_KEY_LENGTH}", index=index, length=len(key))
    if _KEY_RE.fullmatch(key) is None:
        raise InvalidKey("key has characters outside [A-Za-z0-9_.:=+-] or starts with one of .:=+-",
                         index=index, key=key[:MAX_KEY_LENGTH])
    return key


#: Every byte a key may hold, and the newline :func:`check_keys` joins keys with.
_KEY_BYTES: Final = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:=+-\n"
#: A key after the first that is empty or starts with a byte only its middle may hold.
_BAD_START: Final = re.compile(rb"\n[.:=+\n-]")


def check_keys(keys: list) -> tuple[str, ...]:
    """``keys`` as a tuple if every one is a valid key (:func:`check_key`), else the
    :class:`InvalidKey` that :func:`check_key` raises for the first bad one, with its index.

    Decided over all keys at once, at C speed: joined with newlines (a non-string fails the
    join), the text must be ASCII with no byte outside the key alphabet, hold exactly one
    newline between each two keys (so no key holds one), have no key empty or starting with
    ``.:=+-`` (no newline followed by one of those or by a newline, nor one at either end),
    and no key longer than MAX_KEY_LENGTH. The lookup of 1,000 keys is on the event loop for
    every request: key by key took 0.83 ms, this 0.09 ms (issue 27). Where the fast check
    fails, the keys are checked one by one, for the error::

        check_keys(["a1", "b:2"]) == ("a1", "b:2")
        check_keys(["a1", ".b"])   # InvalidKey, index 1
    """
    try:
        joined = "\n".join(keys)
    except TypeError:
        joined = None
    if joined is not None and joined.isascii() and keys:
        raw = joined.encode("ascii")
        if (not raw.translate(None, _KEY_BYTES) and raw.count(b"\n") == len(keys) - 1
                and keys[0][:1] not in ("", ".", ":", "=", "+", "-") and not raw.endswith(b"\n")
                and _BAD_START.search(raw) is None and max(map(len, keys)) <= MAX_KEY_LENGTH):
            return tuple(keys)
    return tuple(check_key(k, i) for i, k in enumerate(keys))


def check_count(name: str, count: int, limit: int = MAX_KEYS_PER_REQUEST) -> None:
    if count > limit:
        raise TooLarge(f"{name} has {count} entries, the limit is {limit}", field=name, count=count, limit=limit)
