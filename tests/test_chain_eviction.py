"""Eviction keeps prefix chains whole (issue 14): the rule as a pure unit (kvswap.backends.chains),
the file and host stores under it, and a real daemon filled past its cap whose every stored
record is reachable by a lookup of its chain. The host tier here is the one the daemon runs:
the RAM tier's records in the host arena (kvswap.backends.ram_tier)."""

from __future__ import annotations

import heapq
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvswap.backends import chains
from kvswap.backends.chains import ChainOrder, Children
from kvswap.backends.file_backend import Capacity, FileBackend
from kvswap.backends.ram_tier import RamBackend
from kvswap.protocol import CacheLayout, Client, HostKVCache, NoSpace
from disk_records import records_on_disk
from support import DaemonProcess, free_port


def ticks():
    """A clock that moves one nanosecond per call, so stamps are predictable."""
    now = [1000]

    def clock() -> int:
        now[0] += 1
        return now[0]

    return clock


def drain(order: ChainOrder) -> list:
    victims = []
    while (name := order.victim()) is not None:
        victims.append(name)
        order.remove(name)
    return victims


# -- the rule, as a pure unit ---------------------------------------------------------------------


def test_worked_example_evicts_tails_first_across_requests():
    order = ChainOrder(clock=ticks())
    order.chain("abc", reserve=True)
    for name in "abc":  # written head first, as a swap_out does
        order.add(name)
    order.chain("cd", reserve=True)  # a later request extends the chain; c exists
    order.add("d")
    assert drain(order) == ["d", "c", "b", "a"]


def test_plain_lru_would_evict_the_head_first():
    """The bug this module fixes, shown with the old order kept for the benchmark."""
    order = ChainOrder("lru", clock=ticks())
    order.chain("abc", reserve=True)
    for name in "abc":
        order.add(name)
    assert drain(order) == ["a", "b", "c"]


def test_older_chains_go_before_newer_ones_and_a_touch_renews_a_whole_chain():
    order = ChainOrder(clock=ticks())
    for chain in ("ab", "xy", "pq"):
        order.chain(chain, reserve=True)
        for name in chain:
            order.add(name)
    order.chain("ab")  # a lookup hit both: ab is now the newest chain
    assert drain(order) == ["y", "x", "q", "p", "b", "a"]


def test_stranded_records_go_before_any_reachable_one():
    order = ChainOrder(clock=ticks())
    order.chain("abc", reserve=True)
    for name in "abc":
        order.add(name)
    order.chain("xy", reserve=True)
    for name in "xy":
        order.add(name)
    order.remove("a")  # another daemon deleted it: b and c are unreachable
    assert order.stranded == 1 and order.unreachable() == 2
    assert order.victim() == "b"
    order.remove("b")
    assert order.victim() == "c" and order.unreachable() == 1
    order.remove("c")
    assert order.unreachable() == 0 and drain(order) == ["y", "x"]


def test_a_record_after_an_evicted_one_is_not_worth_writing():
    order = ChainOrder(clock=ticks())
    order.chain(["k0", "k1", "k2"], reserve=True)
    order.add("k0")
    assert not order.orphaned("k1")  # its predecessor is stored
    order.add("k1")
    order.remove("k1")  # evicted before k2 was written
    assert order.orphaned("k2")
    order.release("k2")
    assert not order.orphaned("k2")  # released: a later put (say a promotion) is not refused


def test_a_chain_named_again_makes_its_stranded_records_reachable():
    """Issue 22 (12a): a -> b -> c stored, a removed (b stranded), then a swap_out names
    [a, b, c] again: a is about to be written, so b is reachable and c is the leaf to evict."""
    order = ChainOrder(clock=ticks())
    order.chain("abc", reserve=True)
    for name in "abc":
        order.add(name)
    order.remove("a")
    assert order.stranded == 1 and order.unreachable() == 2
    order.chain("abc", reserve=True)
    assert order.stranded == 0 and order.unreachable() == 0
    assert order.victim() == "c"
    order.release("a")  # a's write failed after all: b is stranded again
    assert order.stranded == 1 and order.victim() == "b"


def test_a_failed_write_strands_what_follows_it():
    order = ChainOrder(clock=ticks())
    order.chain("abc", reserve=True)
    order.add("a")
    order.add("c")  # written before b by another thread: fine while b is pending
    assert order.stranded == 0
    order.release("b")  # b's write failed
    assert order.stranded == 1 and order.victim() == "c"


def test_pinned_leaves_are_skipped_and_inner_records_never_taken_instead():
    order = ChainOrder(clock=ticks())
    order.chain("ab", reserve=True)
    order.add("a")
    order.add("b")
    assert order.victim(skip=lambda n: n == "b") is None  # evicting a would strand b
    assert order.victim() == "b"


def test_links_that_loop_fall_back_to_lru():
    order = ChainOrder(clock=ticks())
    order.chain("ab", reserve=True)
    order.add("a")
    order.add("b")
    order.chain("ba")  # nonsense keys: a follows b and b follows a
    assert order.victim() in ("a", "b") and len(drain(order)) == 2


def test_records_found_on_disk_keep_their_order_and_go_before_known_ones():
    order = ChainOrder(clock=ticks())
    order.add("fresh")
    assert order.merge_older([("old", 10**12), ("older", 10**11), ("fresh", 5)]) == 2
    assert drain(order) == ["older", "old", "fresh"]


def test_stale_heap_entries_are_compacted():
    order = ChainOrder(clock=ticks())
    order.chain("ab", reserve=True)
    order.add("a")
    order.add("b")
    for _ in range(1000):
        order.chain("ab")
    assert len(order._heap) <= 2 * len(order) + 64
    assert drain(order) == ["b", "a"]


# -- the stores -----------------------------------------------------------------------------------

NS = "cd" * 16
RECORD = 1000


def payload(i: int) -> memoryview:
    return memoryview(bytes([i % 256]) * RECORD)


def host_store(records: int):
    """A host-tier store over an arena of ``records`` slots in all (one of them the staging
    share an arena must have), every slot faulted in; and its backend."""
    backend = RamBackend((records - 1) * 4096)
    backend.make_arena(RECORD, staging_slots=1).grow_all()
    return backend, backend.open_store(NS, {}, RECORD)


def _swap_out(store, keys: list[str]) -> int:
    """What the daemon does for a swap_out: name the chain, then write each new record."""
    store.expect_chain(keys)
    stored = 0
    for i, key in enumerate(keys):
        if store.contains(key):
            continue
        try:
            store.put(key, payload(i))
            stored += 1
        except NoSpace:
            pass
    return stored


@pytest.mark.parametrize("tier", ["file", "host"])
def test_a_chain_longer_than_the_cap_keeps_its_head_and_nothing_else(tmp_path, tier):
    if tier == "file":
        store = FileBackend(str(tmp_path), capacity=Capacity(max_bytes=10 * (256 + RECORD)), layout="files").open_store(NS, {}, RECORD)
        store.scan()
    else:
        _, store = host_store(10)
    keys = [f"long-{i}" for i in range(25)]
    _swap_out(store, keys)
    stored = store.usage()["records"]
    assert 0 < stored <= 10
    assert store.contains_prefix(keys) == stored  # a head, no stray tail record
    assert store.stats()["unreachable"] == 0


def test_a_replaced_host_record_keeps_its_place_in_the_chain():
    backend, store = host_store(3)
    _swap_out(store, ["a", "b", "c"])
    store.put("b", payload(9))  # the same key stored again (a promotion, say): b still follows a
    assert store.stats()["unreachable"] == 0 and backend.problems() == []
    store.put("y", payload(3))
    store.put("z", payload(4))  # room for three: the chain's tail goes, then b, not the head a
    assert [store.contains(k) for k in "abcyz"] == [True, False, False, True, True]


def test_a_host_record_stranded_by_a_refusal_on_another_thread_is_dropped():
    """A swap_out's records are written on several threads: b may be kept before a, and then a
    is refused (its predecessor x was evicted). b is unreachable; the pool must not keep it."""
    backend, store = host_store(4)
    store.put("x", payload(0))
    store.expect_chain(["x", "a", "b"])
    store.put("b", payload(2))  # a is still to come: b is kept
    assert store.contains("b")
    assert store.delete("x")  # evicted meanwhile
    with pytest.raises(NoSpace):
        store.put("a", payload(1))
    assert not store.contains("b") and store.usage()["records"] == 0
    assert store.stats()["unreachable"] == 0 and backend.problems() == []


def test_a_restart_keeps_the_chain_order_in_the_files_mtimes(tmp_path):
    backend = FileBackend(str(tmp_path), layout="files")
    store = backend.open_store(NS, {}, RECORD)
    store.scan()
    _swap_out(store, ["a", "b", "c", "d"])
    store.close()
    again = FileBackend(str(tmp_path), capacity=Capacity(max_bytes=4 * (256 + RECORD)), layout="files").open_store(NS, {}, RECORD)
    again.scan()
    assert again.try_lead()
    again.evict(2 * (256 + RECORD), "capacity")
    assert [again.contains(k) for k in "abcd"] == [True, True, False, False]


class CountingHeap:
    """The heapq functions chains.py uses, counting each call: a measure of the work done
    under the index lock that does not depend on the machine's speed."""

    def __init__(self) -> None:
        self.calls = 0

    def __getattr__(self, name):
        real = getattr(heapq, name)

        def counted(*args):
            self.calls += 1
            return real(*args)

        return counted


def test_refused_records_cost_their_chain_not_the_whole_heap(tmp_path, monkeypatch):
    """Issue 22 (8): after a restart every record is a leaf, and each refused record (its
    predecessor gone) popped and re-pushed every one of them under the index lock looking for
    stranded records: 230 refusals at 40k records took 15 s, and lookups waited meanwhile."""
    records = 3000
    writer = FileBackend(str(tmp_path), layout="files").open_store(NS, {}, RECORD)
    writer.scan()
    for i in range(records):  # a directory of records the next store finds as leaves
        writer.put(f"old-{i}", payload(i))
    writer.close()
    store = FileBackend(str(tmp_path), layout="files").open_store(NS, {}, RECORD)
    assert store.scan() == records
    store.put("head", payload(0))
    keys = ["head"] + [f"k{i}" for i in range(40)]
    store.expect_chain(keys)
    for key in keys[30:]:  # written first by other write threads
        store.put(key, payload(1))
    assert store.delete("head")  # just deleted: the rest of the chain is refused
    heap = CountingHeap()
    monkeypatch.setattr(chains, "heapq", heap)
    refused = 0
    for key in keys[1:30]:
        with pytest.raises(NoSpace):
            store.put(key, payload(2))
        refused += 1
    stats = store.stats()
    assert refused == 29 and stats["chain_refused"] == 29
    assert stats["evicted_stranded"] == len(keys[30:]) and not any(store.contains(k) for k in keys)  # the stranded tail went
    assert stats["records"] == records and stats["unreachable"] == 0
    assert heap.calls <= 4 * len(keys), heap.calls  # the chain's length, not the store's size


def test_refused_host_records_cost_their_chain_not_the_whole_heap(monkeypatch):
    """The RAM tier's twin of the test above: its stranded-record drop under the pool's lock
    asked the whole heap whenever every stranded record was held (a swap_in scattering from
    them), popping and re-pushing every leaf per refused record."""
    records = 2000
    _, store = host_store(records + 64)  # room for all: no eviction needed on the way
    for i in range(records):
        store.put(f"old-{i}", payload(i))
    store.put("head", payload(0))
    keys = ["head"] + [f"k{i}" for i in range(40)]
    store.expect_chain(keys)
    for key in keys[30:]:  # written first by other write threads
        store.put(key, payload(1))
    held = [store.hold(k) for k in keys[30:]]  # a swap_in is reading the tail
    assert store.delete("head")
    heap = CountingHeap()
    monkeypatch.setattr(chains, "heapq", heap)
    for key in keys[1:30]:
        with pytest.raises(NoSpace):
            store.put(key, payload(2))
    assert heap.calls <= 4 * len(keys), heap.calls
    for slot in held:
        slot.release()  # the held stranded records go when released
    stats = store.stats()
    assert not any(store.contains(k) for k in keys)
    assert store.usage()["records"] == records and stats["unreachable"] == 0


@pytest.mark.parametrize("tier", ["file", "host"])
def test_rewriting_a_chains_head_under_pressure_keeps_the_chain(tmp_path, tier):
    """Issue 22 (12a), in the stores: the write of the head a evicts, and the victims must be
    the oldest leaves (x, then c), not b, which a's write makes reachable again."""
    if tier == "file":
        store = FileBackend(str(tmp_path), capacity=Capacity(max_bytes=3 * (256 + RECORD)), layout="files").open_store(NS, {}, RECORD)
        store.scan()
        fillers = ["x"]
    else:
        _, store = host_store(4)  # the pool holds four records
        fillers = ["x", "y"]
    assert _swap_out(store, ["a", "b", "c"]) == 3
    assert store.delete("a")
    for key in fillers:  # the store is full again
        store.put(key, payload(9))
    store.expect_chain(["a", "b", "c"])  # what the daemon does: name the chain, skip what is stored
    missing = [k for k in "abc" if not store.contains(k)]
    assert missing == ["a"]
    store.put("a", payload(0))
    assert store.contains("a") and store.contains("b") and not store.contains("x")
    kept = sum(store.contains(k) for k in "abc")
    assert store.contains_prefix(["a", "b", "c"]) == kept  # the chain's records kept are its head
    assert store.stats()["unreachable"] == 0


# -- a real daemon under pressure -----------------------------------------------------------------

RECORD_BYTES = 3 * 2 * 8 * 2 * 16 * 2  # the layout below: 3 layers, k and v, 8 tokens x 2 heads x 16 dims, fp16
CAP_RECORDS = 12


@pytest.fixture
def big_cache():
    layout = CacheLayout("chain-model", num_layers=3, num_blocks=64, block_size=8, num_kv_heads=2, head_dim=16)
    assert layout.record_bytes == RECORD_BYTES
    with HostKVCache.create(layout) as c:
        c.fill_random(seed=7)
        yield c


def _fill_under_pressure(c: Client, rng: random.Random, long_step: int | None = None) -> list[list[str]]:
    """Many chains, some extended by later requests, lookups and swap_ins between, then one
    chain longer than the whole cap: in one request, or with ``long_step`` as a conversation
    growing by that many blocks a request (each naming the whole chain so far, ``partial``: the
    blocks the cap evicted count as new, and more than the write staging would be too large).
    Returns every chain as its last request named it."""
    chains: list[list[str]] = []
    for n in range(24):
        if chains and rng.random() < 0.3:  # a later turn extends an earlier conversation
            j = rng.randrange(len(chains))
            chains[j] = chains[j] + [f"c{j}-x{n}-{i}" for i in range(rng.randint(1, 4))]
            keys = chains[j]
        else:
            keys = [f"c{len(chains)}-{i}" for i in range(rng.randint(2, 9))]
            chains.append(keys)
        out = c.swap_out(list(range(len(keys))), keys, wait="persisted")
        assert out.failed == out.status.count("no_space"), out.status  # pressure, never an error
        if rng.random() < 0.5:
            old = chains[rng.randrange(len(chains))]
            hits = c.lookup(old)
            if hits:
                c.swap_in(old[:hits], list(range(40, 40 + hits)))
    long = [f"long-{i}" for i in range(3 * CAP_RECORDS)]
    for end in range(long_step or len(long), len(long) + (long_step or len(long)), long_step or len(long)):
        keys = long[:end]
        c.swap_out(list(range(len(keys))), keys, wait="persisted", partial=long_step is not None)
    return chains + [long]


@pytest.mark.parametrize("tier", ["file", "file-files", "host"])
def test_every_stored_record_is_reachable_by_a_lookup_of_its_chain(tmp_path, big_cache, tier):
    file_layout = "files" if tier == "file-files" else "slab"
    tier = tier.partition("-")[0]
    if tier == "file":
        # The daemon's default write threads: a record one thread stores after another
        # thread refused its predecessor must not stay behind, unreachable.
        record_size = 256 + RECORD_BYTES  # small records carry a 256-byte header on disk (a slab slot: the same)
        args = ["--storage-max-bytes", str(CAP_RECORDS * record_size),
                "--host-tier-bytes", "0", "--file-layout", file_layout]
    else:
        # The host pool holds the RAM tier's records in its staging slots too: the cap is the
        # whole pool, 10 write + 1 read + 1 RAM-tier slot of 4 KiB (the largest request here
        # has 10 new blocks; the long chain grows 8 at a time, so it fits the write share).
        args = ["--write-staging-bytes", str(10 * 4096), "--read-staging-bytes", "4096",
                "--host-tier-bytes", "4096", "--store-locations", "host", "--retrieve-locations", "host"]
    d = DaemonProcess(tmp_path / "store", free_port(), free_port(), extra_args=args).start()
    try:
        with Client(d.endpoint, timeout=20) as c:
            c.register(big_cache)
            if tier == "file":  # the cap is enforced by the evicting daemon, once its scan is done
                from support import wait_until
                assert wait_until(lambda: c.stats()["tiers"]["file"]["leader"])
            chains = _fill_under_pressure(c, random.Random(14), None if tier == "file" else 8)
            stats = c.stats()["tiers"][tier]
            if tier == "host":
                assert stats["pool_slots"] == CAP_RECORDS
            elif file_layout == "slab":
                assert stats["slot_bytes"] == record_size  # the cap holds CAP_RECORDS slots
            stored = len(records_on_disk(tmp_path / "store")) if tier == "file" else stats["records"]
            hits = [c.lookup(chain) for chain in chains]
            assert 0 < stored <= CAP_RECORDS
            assert sum(hits) == stored, f"{stored} records stored, {sum(hits)} reachable: {hits}; {stats}"
            assert hits[-1] >= 1  # the newest chain, longer than the cap, kept its head
            assert stats["unreachable"] == 0
    finally:
        assert d.stop() == 0, d.log()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.sampled_from("abcd"), st.sampled_from("abcde")), max_size=40))
def test_children_answers_as_a_map_of_sets_does(ops: list[tuple[bool, str, str]]) -> None:
    """Children keeps one successor inline and sets only for branch points; to its callers it
    is a map of name -> set of successors, whatever the order of adds and discards."""
    children: Children[str] = Children()
    model: dict[str, set[str]] = {}
    for add, parent, child in ops:
        if add:
            children.add(parent, child)
            model.setdefault(parent, set()).add(child)
        else:
            had = child in model.get(parent, set())
            model.get(parent, set()).discard(child)
            emptied = had and not model.get(parent)
            if parent in model and not model[parent]:
                del model[parent]
            assert children.discard(parent, child) is emptied
        for name in "abcde":
            assert set(children.of(name)) == model.get(name, set())
            assert children.has(name) is (name in model)
    again: Children[str] = Children()
    for parent, kids in model.items():
        for child in sorted(kids):
            again.add(parent, child)
    assert again == children  # one form for one map
