"""Error classes and the wire-code table (kvswap.protocol.errors): pure units, no I/O."""

from __future__ import annotations

import pytest

from kvswap.common import errors as common_errors
from kvswap.protocol import errors
from kvswap.protocol.errors import (
    ERRORS_BY_CODE,
    BadRequest,
    Busy,
    Corrupt,
    InvalidKey,
    InvalidLayout,
    Internal,
    IOFailure,
    KvswapError,
    NoSpace,
    NotRegistered,
    OutOfRange,
    RegistrationHeld,
    TooLarge,
    Timeout,
    Unauthorized,
    Unavailable,
    UnknownOp,
    UnsupportedVersion,
    from_wire,
    to_wire,
)

#: The wire names are a contract with every client ever shipped: spelled out here, not derived.
EXPECTED_CODES = {
    "bad_request": BadRequest,
    "unknown_op": UnknownOp,
    "unsupported_version": UnsupportedVersion,
    "too_large": TooLarge,
    "invalid_key": InvalidKey,
    "out_of_range": OutOfRange,
    "not_registered": NotRegistered,
    "invalid_layout": InvalidLayout,
    "registration_held": RegistrationHeld,
    "busy": Busy,
    "timeout": Timeout,
    "no_space": NoSpace,
    "io_error": IOFailure,
    "corrupt": Corrupt,
    "unavailable": Unavailable,
    "unauthorized": Unauthorized,
    "internal": Internal,
}
RETRYABLE_CODES = {"busy", "timeout", "no_space", "io_error", "unavailable"}


def _all_subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _all_subclasses(sub)
    return out


# -- the table ----------------------------------------------------------------------------


def test_table_maps_each_wire_code_to_its_class() -> None:
    assert ERRORS_BY_CODE == EXPECTED_CODES
    assert len(ERRORS_BY_CODE) == 17


def test_every_error_class_defined_in_the_module_is_in_the_table() -> None:
    # A subclass that is not in the table would be answered with its code but rebuilt by the
    # client as the bare root class. The classes are defined in kvswap.common.errors (the
    # low-level code both sides share raises them) and re-exported by kvswap.protocol.errors.
    defined = {c for c in _all_subclasses(KvswapError) if c.__module__ == common_errors.__name__}
    assert defined == set(ERRORS_BY_CODE.values())
    assert all(getattr(errors, c.__name__) is c for c in defined | {KvswapError})
    for code, cls in ERRORS_BY_CODE.items():
        assert cls.code == code
        assert issubclass(cls, KvswapError)


def test_retryable_flags() -> None:
    assert {code for code, cls in ERRORS_BY_CODE.items() if cls.retryable} == RETRYABLE_CODES
    assert KvswapError.retryable is False


# -- instances ----------------------------------------------------------------------------


def test_error_carries_message_and_details() -> None:
    err = TooLarge("keys has 9 entries", field="keys", count=9, limit=8)
    assert err.message == "keys has 9 entries"
    assert str(err) == "keys has 9 entries"
    assert err.details == {"field": "keys", "count": 9, "limit": 8}
    assert repr(err) == "TooLarge('keys has 9 entries', {'field': 'keys', 'count': 9, 'limit': 8})"


def test_empty_message_defaults_to_the_code() -> None:
    err = Busy()
    assert err.message == "busy"
    assert str(err) == "busy"
    assert err.details == {}


def test_to_wire_is_a_flat_map() -> None:
    assert to_wire(InvalidKey("bad key", index=3, key="a/b")) == {
        "code": "invalid_key",
        "message": "bad key",
        "details": {"index": 3, "key": "a/b"},
    }
    assert to_wire(Internal()) == {"code": "internal", "message": "internal", "details": {}}


# -- from_wire ----------------------------------------------------------------------------


@pytest.mark.parametrize("code", sorted(EXPECTED_CODES))
def test_from_wire_round_trip_gives_back_class_message_and_details(code: str) -> None:
    cls = EXPECTED_CODES[code]
    sent = cls(f"{code} happened", limit=8, field="keys", items=[1, 2])
    got = from_wire(to_wire(sent))
    assert type(got) is cls
    assert got.code == code
    assert got.message == f"{code} happened"
    assert got.details == {"limit": 8, "field": "keys", "items": [1, 2]}
    assert got.retryable is cls.retryable


def test_from_wire_unknown_code_keeps_its_code() -> None:
    # A newer daemon may send a code this client does not know; the caller can still read it.
    got = from_wire({"code": "quota_exceeded", "message": "over quota", "details": {"quota": 5}})
    assert type(got) is KvswapError
    assert got.code == "quota_exceeded"
    assert got.message == "over quota"
    assert got.details == {"quota": 5}
    assert got.retryable is False
    # The code is set on the instance, never on the shared classes or the table.
    assert KvswapError.code == "internal"
    assert ERRORS_BY_CODE == EXPECTED_CODES


def test_from_wire_non_string_code_is_unknown() -> None:
    got = from_wire({"code": 17, "message": "m"})
    assert type(got) is KvswapError
    assert got.code == "17"


@pytest.mark.parametrize("payload", [None, "busy", 3, ["busy", "m"], b"\x00"])
def test_from_wire_non_map_is_internal(payload: object) -> None:
    got = from_wire(payload)
    assert type(got) is Internal
    assert got.message == "malformed error payload"
    assert got.details == {"payload": repr(payload)[:200]}


def test_from_wire_truncates_the_repr_of_a_huge_payload() -> None:
    got = from_wire("x" * 10_000)
    assert len(got.details["payload"]) == 200


def test_from_wire_defaults_missing_message_and_details() -> None:
    got = from_wire({"code": "busy"})
    assert type(got) is Busy
    assert got.message == "busy"
    assert got.details == {}
    assert from_wire({"code": "busy", "details": None}).details == {}


def test_from_wire_wraps_non_map_details() -> None:
    got = from_wire({"code": "corrupt", "message": "m", "details": [1, 2]})
    assert type(got) is Corrupt
    assert got.details == {"details": [1, 2]}


def test_from_wire_stringifies_a_non_string_message() -> None:
    assert from_wire({"code": "busy", "message": 42}).message == "42"


@pytest.mark.parametrize("details", [{"message": "x"}, {"self": 1}, {b"bin": 1}])
def test_from_wire_never_raises_on_odd_detail_keys(details: dict) -> None:
    got = from_wire({"code": "bad_request", "message": "m", "details": details})
    assert type(got) is BadRequest
    assert got.message == "m"
