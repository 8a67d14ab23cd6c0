"""KV events without a daemon: the wire codec (both encodings), swap_out's block_meta checks,
and the ledger, whose events must rebuild exactly what the tiers reported, whatever order the
reports come in, through overflow resets too."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvswap.daemon import kv_events
from kvswap.daemon.kv_events import EventLedger
from kvswap.protocol import messages as m
from kvswap.protocol.errors import BadRequest
from kvswap.protocol.kv_events import (
    AllBlocksCleared,
    BlockMeta,
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
    metas_from_wire,
)
from kvswap.protocol.kv_events_subscriber import TierView

hashes = st.one_of(st.binary(min_size=1, max_size=64), st.integers(0, 2**64 - 1))
maybe_str = st.one_of(st.none(), st.text(max_size=20))
stored_events = st.builds(
    BlockStored, st.lists(hashes, min_size=1, max_size=5).map(tuple), st.one_of(st.none(), hashes),
    st.lists(st.integers(0, 2**32 - 1), max_size=20).map(tuple), st.integers(0, 1024),
    st.sampled_from(["CPU", "STORAGE"]), st.sampled_from([None, "LOCAL", "REMOTE"]), maybe_str, maybe_str)
removed_events = st.builds(BlockRemoved, st.lists(hashes, min_size=1, max_size=5).map(tuple),
                           st.sampled_from(["CPU", "STORAGE"]), st.sampled_from([None, "LOCAL"]), maybe_str)
events = st.lists(st.one_of(stored_events, removed_events, st.just(AllBlocksCleared())), max_size=20)


@settings(max_examples=200, deadline=None)
@given(events, st.floats(0, 2e9, allow_nan=False), st.one_of(st.none(), st.integers(0, 64)))
def test_the_map_encoding_decodes_to_the_same_events(batch, ts, rank):
    assert decode_batch(encode_batch(ts, batch, "map", rank)) == (ts, batch, rank)


@settings(max_examples=200, deadline=None)
@given(events, st.floats(0, 2e9, allow_nan=False))
def test_the_array_encoding_keeps_everything_but_locality_and_ownership(batch, ts):
    def plain(e):
        if isinstance(e, BlockStored):
            return BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.medium,
                               lora_name=e.lora_name)
        if isinstance(e, BlockRemoved):
            return BlockRemoved(e.block_hashes, e.medium)
        return e

    assert decode_batch(encode_batch(ts, batch, "array")) == (ts, [plain(e) for e in batch], None)


def test_the_map_encoding_is_vllms_field_for_field():
    """The bytes vLLM 0.32's msgspec encoder writes for the same events (omit_defaults leaves
    the unset optional fields out; lora_id is always written)."""
    event = BlockStored((b"\x01" * 32,), None, (5, 6), 16, "CPU", "LOCAL", "kvswap:host")
    raw = msgpack.unpackb(encode_batch(1.5, [event, BlockRemoved((7,), "CPU"), AllBlocksCleared()]))
    assert raw == [1.5, [
        {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": None, "token_ids": [5, 6],
         "block_size": 16, "lora_id": None, "medium": "CPU", "lora_name": None, "locality": "LOCAL",
         "ownership": "kvswap:host"},
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU"},
        {"type": "AllBlocksCleared"}]]
    assert list(raw[1][0]) [:8] == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                                     "lora_id", "medium", "lora_name"]  # msgspec writes fields in order


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"\x91\x01", b"\x92\x01\x91\x05",
                                     b"\x92\x01\x91\x81\xa4type\xa3Bad"])
def test_a_payload_that_is_not_an_event_batch_is_a_value_error(payload):
    with pytest.raises(ValueError):
        decode_batch(payload)


metas = st.builds(BlockMeta, st.lists(hashes, min_size=1, max_size=64).map(tuple), st.one_of(st.none(), hashes),
                  st.lists(st.integers(0, 2**32 - 1), max_size=64).map(tuple), st.integers(0, 65536),
                  st.one_of(st.none(), st.text(max_size=256)))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), metas), min_size=1, max_size=8))
def test_block_meta_survives_the_wire(entries):
    keys = [f"k{i}" for i in range(len(entries))]
    frame = m.encode_request(m.SwapOut(id=1, block_ids=tuple(range(len(keys))), keys=tuple(keys),
                                       block_meta=tuple(None if e is None else e.to_wire() for e in entries)))
    request = m.decode_request(frame)
    assert isinstance(request, m.SwapOut)
    assert request.metas() == tuple(entries)


@pytest.mark.parametrize("entry, message", [
    ("x", "must be a map or nil"),
    ({}, "block_hashes must be a list of 1..64"),
    ({"block_hashes": []}, "block_hashes must be a list of 1..64"),
    ({"block_hashes": [b"x"] * 65}, "block_hashes must be a list of 1..64"),
    ({"block_hashes": [b""]}, "a block hash is 1..64 bytes"),
    ({"block_hashes": [b"x" * 65]}, "a block hash is 1..64 bytes"),
    ({"block_hashes": [-1]}, "a block hash is"),
    ({"block_hashes": [True]}, "a block hash is"),
    ({"block_hashes": [b"x"], "parent_block_hash": "text"}, "a block hash is"),
    ({"block_hashes": [b"x"], "token_ids": [1, -2]}, "token_ids must be"),
    ({"block_hashes": [b"x"], "token_ids": [0] * 8193}, "token_ids must be"),
    ({"block_hashes": [b"x"], "block_size": -1}, "block_size must be"),
    ({"block_hashes": [b"x"], "lora_name": 5}, "lora_name must be"),
    ({"block_hashes": [b"x"], "extra": 1}, "unknown fields"),
])
def test_bad_block_meta_is_a_bad_request_naming_the_key(entry, message):
    with pytest.raises(BadRequest, match=message) as info:
        metas_from_wire([None, entry], ["a", "b"])
    assert info.value.details.get("field") == "block_meta"


def test_block_meta_needs_one_entry_per_key():
    with pytest.raises(BadRequest):  # the client refuses to send it
        m.encode_request(m.SwapOut(id=3, block_ids=(0, 1), keys=("a", "b"), block_meta=(None,)))
    frame = msgpack.packb({"v": 1, "id": 3, "op": "swap_out", "block_ids": [0, 1], "keys": ["a", "b"],
                           "block_meta": [None]})
    with pytest.raises(m.DecodeError) as info:  # and the daemon answers it
        m.decode_request(frame)
    assert info.value.error.code == "bad_request" and info.value.request_id == 3


def test_a_swap_out_without_block_meta_is_byte_identical_to_before():
    frame = m.encode_request(m.SwapOut(id=1, block_ids=(0,), keys=("a",)))
    assert b"block_meta" not in frame


# -- the ledger ---------------------------------------------------------------------------------

TIERS = ("host", "file", "remote")
OWNER = {"host": "kvswap:host", "file": "kvswap:file", "remote": "kvswap:remote"}
report = st.tuples(st.sampled_from(["stored", "removed", "cleared"]), st.sampled_from(TIERS),
                   st.sampled_from(["ns1", "ns2"]), st.lists(st.sampled_from([f"k{i}" for i in range(6)]),
                                                             max_size=4))


def _drain(ledger: EventLedger, view: TierView) -> int:
    n = 0
    while batch := ledger.take(0):
        for event in batch:
            view.apply(event)
        n += len(batch)
    return n


def _model_view(model: dict[tuple[str, str], set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {OWNER[t]: set() for t in TIERS}
    for (tier, _ns), keys in model.items():
        out[OWNER[tier]] |= keys
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(report, max_size=40), st.lists(st.integers(0, 40), max_size=5))
def test_a_subscriber_rebuilds_what_the_tiers_reported_from_the_ledgers_events(reports, drain_points):
    """Namespaces use disjoint keys here (ns2's keys are ns1's with a suffix), as their hashes
    are in practice; each prefix of the report sequence drained at random points."""
    ledger, view = EventLedger(), TierView()
    model: dict[tuple[str, str], set[str]] = {(t, ns): set() for t in TIERS for ns in ("ns1", "ns2")}
    for i, (what, tier, ns, keys) in enumerate(reports):
        keys = [k + ("" if ns == "ns1" else "-2") for k in keys]
        if what == "stored":
            ledger.stored(tier, ns, keys)
            model[(tier, ns)].update(keys)
        elif what == "removed":
            ledger.removed(tier, ns, keys)
            model[(tier, ns)].difference_update(keys)
        else:
            ledger.cleared(tier, ns)
            model[(tier, ns)].clear()
        if i in drain_points:
            _drain(ledger, view)
            assert {o: view.keys(o) for o in OWNER.values()} == _model_view(model)
    _drain(ledger, view)
    assert {o: view.keys(o) for o in OWNER.values()} == _model_view(model)
    assert {t: set(ks) for t, ks in ledger.holders("ns1").items()} == {t: model[(t, "ns1")] for t in TIERS}


def test_the_first_batch_is_a_reset_then_changes_in_order():
    ledger = EventLedger()
    assert ledger.take(0) == [AllBlocksCleared()]
    ledger.stored("host", "ns", ["a", "b"])
    ledger.stored("file", "ns", ["a"])
    ledger.stored("host", "ns", ["a"])  # already held there: no event
    ledger.removed("file", "ns", ["a", "zz"])  # zz never stored: no event
    batch = ledger.take(0)
    assert [type(e).__name__ for e in batch] == ["BlockStored", "BlockStored", "BlockStored", "BlockRemoved"]
    assert [(e.medium, e.block_hashes) for e in batch] == [
        ("CPU", (b"a",)), ("CPU", (b"b",)), ("STORAGE", (b"a",)), ("STORAGE", (b"a",))]
    assert ledger.take(0) == []


def test_clear_is_all_blocks_cleared_only_when_nothing_else_is_held():
    ledger = EventLedger()
    ledger.take(0)
    ledger.stored("host", "ns", ["a", "b"])
    ledger.stored("file", "ns", ["a", "b", "c"])
    ledger.take(0)
    ledger.cleared("host", "ns")  # the file tier still holds records: removals, in one event
    assert ledger.take(0) == [BlockRemoved((b"a", b"b"), "CPU", "LOCAL", "kvswap:host")]
    ledger.cleared("file", "ns")  # the last of them
    assert ledger.take(0) == [AllBlocksCleared()]
    ledger.cleared("file", "ns")  # nothing left: nothing said
    assert ledger.take(0) == []


def test_names_come_from_block_meta_and_the_chain_and_go_with_the_record():
    ledger = EventLedger()
    ledger.take(0)
    ledger.describe("ns", 32)
    h = [bytes([i]) * 32 for i in range(3)]
    ledger.expect("ns", ["a", "b", "c", "d"], [BlockMeta((h[0],), None, (1, 2)), BlockMeta((h[1], h[2])), None, None])
    ledger.stored("file", "ns", ["a", "b", "c", "d"])
    a, b, c, d = ledger.take(0)
    assert (a.block_hashes, a.parent_block_hash, a.token_ids, a.block_size) == ((h[0],), None, (1, 2), 32)
    assert (b.block_hashes, b.parent_block_hash) == ((h[1], h[2]), h[0])
    assert (c.block_hashes, c.parent_block_hash, c.token_ids) == ((b"c",), h[2], ())
    assert d.parent_block_hash == b"c"
    ledger.removed("file", "ns", ["b"])
    assert ledger.take(0) == [BlockRemoved((h[1], h[2]), "STORAGE", "LOCAL", "kvswap:file")]
    ledger.stored("file", "ns", ["b"])  # stored again later without a swap_out naming it: by key
    (again,) = ledger.take(0)
    assert again.block_hashes == (b"b",)


def test_metas_of_records_that_never_land_are_forgotten(monkeypatch):
    monkeypatch.setattr(kv_events, "MAX_PENDING_METAS", 4)
    ledger = EventLedger()
    ledger.expect("ns", [f"k{i}" for i in range(10)], [BlockMeta((bytes([i]),)) for i in range(10)])
    assert len(ledger._names) == 4 and len(ledger._pending) == 4


def test_names_past_their_memory_budget_are_not_kept_and_the_key_names_the_record(monkeypatch):
    big = BlockMeta((b"\x01" * 32,), None, tuple(range(1000)))
    monkeypatch.setattr(kv_events, "MAX_NAME_BYTES", 2 * kv_events._name_cost(big))
    ledger = EventLedger()
    ledger.take(0)
    ledger.expect("ns", ["a", "b", "c"], [big, BlockMeta((b"\x02" * 32,), None, tuple(range(1000))), big])
    assert ledger.names_dropped == 1 and ledger.name_bytes == 2 * kv_events._name_cost(big)
    ledger.stored("host", "ns", ["a", "b", "c"])
    a, b, c = ledger.take(0)
    assert a.token_ids == big.token_ids and c.block_hashes == (b"c",) and c.token_ids == ()
    ledger.removed("host", "ns", ["a", "b", "c"])
    assert [e.block_hashes for e in ledger.take(0)] == [(b"\x01" * 32, b"\x02" * 32, b"c")]
    assert ledger.name_bytes == 0  # the names went with their records


def test_an_overflowing_queue_becomes_a_reset_with_the_whole_state(monkeypatch):
    monkeypatch.setattr(kv_events, "MAX_QUEUED_EVENTS", 5)
    monkeypatch.setattr(kv_events, "MAX_BATCH_EVENTS", 3)
    ledger, view = EventLedger(), TierView()
    _drain(ledger, view)
    ledger.stored("host", "ns", [f"k{i}" for i in range(20)])
    ledger.removed("host", "ns", ["k0", "k1"])
    assert ledger.resets == 1 and len(ledger._queue) == 0  # dropped, not grown
    ledger.stored("file", "ns", ["k5"])  # during the pending reset: part of the state it publishes
    first = ledger.take(0)
    assert first[0] == AllBlocksCleared() and len(first) == 3
    ledger.removed("host", "ns", ["k19"])  # after the reset: published after the state
    for event in first:
        view.apply(event)
    _drain(ledger, view)
    assert view.keys("kvswap:host") == {f"k{i}" for i in range(2, 19)}
    assert view.keys("kvswap:file") == {"k5"}


# -- the name a record header keeps -----------------------------------------------------------------

from kvswap.backends import record  # noqa: E402


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=1, max_size=4000), st.sampled_from([1024, 65536, 1 << 20]))
def test_an_annotation_is_kept_where_it_fits_and_never_changes_what_the_record_is(annotation, payload_len):
    ns = bytes(range(16))
    header = record.encode_header(ns, "key", payload_len, 1234, annotation=annotation)
    assert len(header) == record.header_len_for(payload_len)
    decoded = record.decode_header(header)  # the core reads as before, annotation or not
    assert (decoded.key, decoded.payload_len, decoded.checksum) == ("key", payload_len, 1234)
    fits = len(annotation) <= record.annotation_room(len(header))
    assert record.decode_annotation(header) == (annotation if fits else None)
    if not fits:
        assert header == record.encode_header(ns, "key", payload_len, 1234, decoded.created_ns)


def test_a_damaged_annotation_is_dropped_and_the_record_still_reads():
    header = bytearray(record.encode_header(bytes(16), "k", 1 << 16, 7, annotation=b"\x81\xa1x\x01"))
    header[record.HEADER_CORE_BYTES + 13] ^= 0xFF
    assert record.decode_header(header).key == "k"
    assert record.decode_annotation(header) is None
    assert record.decode_annotation(header[:record.HEADER_CORE_BYTES + 5]) is None  # cut short


def test_the_ledger_recalls_a_name_from_a_header_and_ignores_garbage():
    ledger = EventLedger()
    ledger.take(0)
    meta = BlockMeta((b"\x07" * 32,), b"\x06" * 32, (1, 2, 3), 16, None)
    ledger.expect("ns", ["k"], [meta])
    saved = ledger.annotation("ns", "k")
    restarted = EventLedger()
    restarted.take(0)
    restarted.recall("ns", "k", saved)
    restarted.recall("ns", "bad", b"\xc1\xc1")
    restarted.recall("ns", "worse", msgpack.packb({"block_hashes": "no"}))
    restarted.stored("file", "ns", ["k", "bad", "worse"])
    k, bad, worse = restarted.take(0)
    assert (k.block_hashes, k.parent_block_hash, k.token_ids, k.block_size) == (
        meta.block_hashes, meta.parent_block_hash, meta.token_ids, 16)
    assert bad.block_hashes == (b"bad",) and worse.block_hashes == (b"worse",)
    assert ledger.annotation("ns", "unknown") == b""
