"""Typed errors shared by the daemon (to answer) and the clients (to raise).

Every error that crosses the wire is one of these classes. The daemon turns an exception into
``{"code": ..., "message": ..., "details": {...}}`` with :func:`to_wire`; a client turns that
map back into the same class with :func:`from_wire`. ``ERRORS_BY_CODE`` is the one table that
ties wire codes to classes, both ways.
"""

from __future__ import annotations

from typing import Any, Final


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


ERRORS_BY_CODE: Final[dict[str, type[KvswapError]]] = {
    cls.code: cls
    for cls in (
        BadRequest,
        UnknownOp,
        UnsupportedVersion,
        TooLarge,
        InvalidKey,
        OutOfRange,
        NotRegistered,
        InvalidLayout,
        RegistrationHeld,
        Busy,
        Timeout,
        NoSpace,
        IOFailure,
        Corrupt,
        Unavailable,
        Unauthorized,
        Internal,
    )
}


def to_wire(error: KvswapError) -> dict[str, Any]:
    return {"code": error.code, "message": error.message, "details": error.details}


def from_wire(payload: Any) -> KvswapError:
    """Rebuild the exception a daemon sent. An unknown code (a newer daemon) becomes the root
    class carrying that code, so callers can still read it."""
    if not isinstance(payload, dict):
        return Internal("malformed error payload", payload=repr(payload)[:200])
    code = payload.get("code")
    message = str(payload.get("message", ""))
    details = payload.get("details") or {}
    if not isinstance(details, dict):
        details = {"details": details}
    cls = ERRORS_BY_CODE.get(code) if isinstance(code, str) else None
    # Details are set after construction: a peer's map may hold keys ("message", non-strings)
    # that cannot be keyword arguments.
    err = (cls or KvswapError)(message)
    err.details = {str(k): v for k, v in details.items()}
    if cls is None:
        err.code = str(code) if code is not None else "internal"
    return err
