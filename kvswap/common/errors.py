"""Typed errors: the one exception root, and a class per wire code.

Every layer raises these: the daemon answers with them, the clients raise them, and the
low-level code both sides share (this package: the shared-memory segment, the CUDA driver
binding) raises them too, so a failure deep in a copy still reaches the engine as a typed
error. A class's ``code`` is its name on the wire.

The wire side is the protocol's: :mod:`kvswap.protocol.errors` holds the one table that ties
wire codes to classes (``ERRORS_BY_CODE``) and the wire form (``to_wire``/``from_wire``), and
re-exports every class here; engines and the daemon import them from there. The classes sit
here, beneath the protocol, because ``kvswap.common`` imports nothing of the rest of kvswap.
"""

from __future__ import annotations

from typing import Any


class KvswapError(Exception):
    """Root of every kvswap error. ``code`` is the stable wire name; ``details`` is a flat map
    of the values that explain this instance (limits, offending keys, block ids)."""

    code: str = "internal"
    #: Whether the same request may succeed if sent again later (the operator or engine may
    #: retry). Busy and timeouts are transient; bad input is not.
    retryable: bool = False

    def __init__(self, message: str = "", **details: Any) -> None:
        super().__init__(message or self.code)
        self.message = message or self.code
        self.details = details

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, {self.details!r})"


class BadRequest(KvswapError):
    """The frame is not a valid request: not msgpack, a missing or mistyped field."""

    code = "bad_request"


class UnknownOp(KvswapError):
    code = "unknown_op"


class UnsupportedVersion(KvswapError):
    code = "unsupported_version"


class TooLarge(KvswapError):
    """A message, list or key beyond a protocol limit."""

    code = "too_large"


class InvalidKey(KvswapError):
    code = "invalid_key"


class OutOfRange(KvswapError):
    code = "out_of_range"


class NotRegistered(KvswapError):
    code = "not_registered"


class InvalidLayout(KvswapError):
    """A registration whose memory does not match its layout (size, count, names)."""

    code = "invalid_layout"


class RegistrationHeld(KvswapError):
    """The daemon's cache registration belongs to another live engine: a ``register`` from a
    different process, or a swap or ``unregister`` that is not the holder's. ``details``
    name the holder (``holder_pid``)."""

    code = "registration_held"


class Busy(KvswapError):
    code = "busy"
    retryable = True


class Timeout(KvswapError):
    code = "timeout"
    retryable = True


class NoSpace(KvswapError):
    code = "no_space"
    retryable = True


class IOFailure(KvswapError):
    code = "io_error"
    retryable = True


class Corrupt(KvswapError):
    code = "corrupt"


class Unavailable(KvswapError):
    """The daemon is shutting down, or a tier it needs is unreachable."""

    code = "unavailable"
    retryable = True


class Unauthorized(KvswapError):
    code = "unauthorized"


class Internal(KvswapError):
    """A bug in the daemon. It is still answered, so the engine never waits forever."""

    code = "internal"
