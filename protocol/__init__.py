"""What an engine needs to talk to kvswapd: the wire protocol, its typed errors, the cache
layout and the clients. Imports with numpy, msgpack and pyzmq alone (no paddle)."""

from .client import AsyncClient, Client
from .errors import (
    ERRORS_BY_CODE,
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
    Timeout,
    TooLarge,
    Unauthorized,
    Unavailable,
    UnknownOp,
    UnsupportedVersion,
)
from .host_cache import HostKVCache
from .layout import CacheLayout, Region
from .results import SwapInResult, SwapOutResult

__all__ = [
    "AsyncClient",
    "Client",
    "SwapInResult",
    "SwapOutResult",
    "CacheLayout",
    "Region",
    "HostKVCache",
    "ERRORS_BY_CODE",
    "KvswapError",
    "BadRequest",
    "Busy",
    "Corrupt",
    "Internal",
    "InvalidKey",
    "InvalidLayout",
    "IOFailure",
    "NoSpace",
    "NotRegistered",
    "OutOfRange",
    "Timeout",
    "TooLarge",
    "Unauthorized",
    "Unavailable",
    "UnknownOp",
    "UnsupportedVersion",
]
