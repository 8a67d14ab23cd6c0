"""Typed errors on the wire, shared by the daemon (to answer) and the clients (to raise).

Every error that crosses the wire is one of the classes of :mod:`kvswap.common.errors`, all
re-exported here (import them from this module). The daemon turns an exception into
``{"code": ..., "message": ..., "details": {...}}`` with :func:`to_wire`; a client turns that
map back into the same class with :func:`from_wire`. ``ERRORS_BY_CODE`` is the one table that
ties wire codes to classes, both ways.
"""

from __future__ import annotations

from typing import Any, Final

from kvswap.common.errors import (
    BadRequest,
    Busy,
    Corrupt,
    Internal,
    InvalidKey,
    InvalidLayout,
    IOFailure,
    KvswapError,
    NoSpace,
    NotRegistered,
    OutOfRange,
    RegistrationHeld,
    Timeout,
    TooLarge,
    Unauthorized,
    Unavailable,
    UnknownOp,
    UnsupportedVersion,
)

__all__ = [
    "ERRORS_BY_CODE",
    "to_wire",
    "from_wire",
    "KvswapError",
    "BadRequest",
    "UnknownOp",
    "UnsupportedVersion",
    "TooLarge",
    "InvalidKey",
    "OutOfRange",
    "NotRegistered",
    "InvalidLayout",
    "RegistrationHeld",
    "Busy",
    "Timeout",
    "NoSpace",
    "IOFailure",
    "Corrupt",
    "Unavailable",
    "Unauthorized",
    "Internal",
]

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
