"""Replay of repeated prefixes under a cap of half the working set: hit rate with the old LRU
order next to the chain-aware order (issue 14), same requests, same run.

    python benchmarks/prefix_replay.py [--requests 4000] [--groups 8] [--docs 12] [--doc-blocks 4-24]
                                       [--zipf 1.1] [--seed 14] [--cap-fraction 0.5] [--tiers host,file]
                                       [--workload documents|conversations]

The ``documents`` workload is a tree of prefixes, as an LLM server sees them: ``--groups``
system prompts of 8 blocks, each extended by ``--docs`` documents of ``--doc-blocks`` blocks; a
request picks a document by Zipf popularity (``--zipf``, 0: uniform) and appends 4 blocks of its
own (never reused). The working set is the distinct prefix records; the store's cap is
``--cap-fraction`` of it. ``conversations`` replays multi-turn chats whose history grows.

The gain grows with the length of a chain against the cap: the order matters for the chains at
the eviction frontier, which LRU leaves with a tail and no head. Long documents show it
(``--groups 2 --docs 4 --doc-blocks 32-96``); many short ones hardly.

Each request is replayed against one store the way the daemon drives it: ``lookup`` (the leading
keys stored, then the hit prefix touched as a whole), ``swap_in`` of the hit prefix (reads, then
a persisted touch), ``swap_out`` of the whole chain (named as one chain, then each missing record
written; a refused record is ``no_space``). Both orders run the same code: the old one is the
store option ``eviction="lru"`` (every put or read most recent, a lookup touching its keys head
first, no chain links), which is what the tiers did before the change (the old host tier did
not touch on lookup at all). The host tier is the daemon's: a ``RamBackend`` and the arena
it makes, of cap-many slots (one of them the staging share every pool has), every slot
faulted in, its eviction order the pool's ``eviction`` option.

Printed per tier and order: the hit rate over the prefix blocks requested, its ratio to LRU, the
records stored at the end and how many of them a lookup of some request's chain can still reach,
and the wall time. Numbers, not assertions; the machine may be shared.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass

from kvswap.backends import record
from kvswap.backends.base import Store
from kvswap.backends.file_backend import Capacity, FileBackend
from kvswap.backends.ram_tier import RamBackend
from kvswap.protocol.errors import NoSpace

NAMESPACE = "5e" * 16
PAYLOAD = 4096
SYSTEM_BLOCKS = 8
SUFFIX_BLOCKS = 4


@dataclass
class Result:
    tier: str
    order: str
    hit_blocks: int
    prefix_blocks: int
    stored: int
    reachable: int
    refused: int
    seconds: float

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.prefix_blocks if self.prefix_blocks else 0.0


def workload(args: argparse.Namespace) -> tuple[list[tuple[list[str], int]], int]:
    """The requests as (keys, prefix length), and the number of distinct prefix records."""
    if args.workload == "conversations":
        return conversations(args)
    rng = random.Random(args.seed)
    docs = []
    for g in range(args.groups):
        system = [f"s{g}-{i}" for i in range(SYSTEM_BLOCKS)]
        for d in range(args.docs):
            docs.append(system + [f"s{g}-d{d}-{i}" for i in range(rng.randint(*args.doc_blocks))])
    distinct = len({key for doc in docs for key in doc})
    weights = [1.0 / (rank + 1) ** args.zipf for rank in range(len(docs))]
    order = list(range(len(docs)))
    rng.shuffle(order)  # popularity is not tied to the group
    requests = []
    for n in range(args.requests):
        doc = docs[order[rng.choices(range(len(docs)), weights)[0]]]
        requests.append((doc + [f"r{n}-{i}" for i in range(SUFFIX_BLOCKS)], len(doc)))
    return requests, distinct


def conversations(args: argparse.Namespace) -> tuple[list[tuple[list[str], int]], int]:
    """Multi-turn chats: a request picks a conversation (Zipf) and sends its whole history plus
    a new turn of 2..8 blocks, which becomes part of the history; a history past 64 blocks ends
    and the conversation starts over under new keys. The repeated prefix is the history; the
    working set is the most history alive at once."""
    rng = random.Random(args.seed)
    count = args.groups * args.docs
    weights = [1.0 / (rank + 1) ** args.zipf for rank in range(count)]
    history: list[list[str]] = [[] for _ in range(count)]
    generation = [0] * count
    requests, live = [], 0
    for n in range(args.requests):
        c = rng.choices(range(count), weights)[0]
        if len(history[c]) > 64:
            history[c], generation[c] = [], generation[c] + 1
        turn = [f"v{c}.{generation[c]}-{len(history[c]) + i}" for i in range(rng.randint(2, 8))]
        requests.append((history[c] + turn, len(history[c])))
        history[c] = history[c] + turn
        live = max(live, sum(len(h) for h in history))
    return requests, live  # the working set: the most history alive at once


def open_store(tier: str, order: str, cap_records: int, root: str) -> Store:
    if tier == "host":
        # The daemon's RAM tier, as tests/test_chain_eviction.py's host_store() builds it.
        backend = RamBackend((cap_records - 1) * PAYLOAD, eviction=order)  # cap - 1 cached + 1 staging
        backend.make_arena(PAYLOAD, staging_slots=1).grow_all()
        return backend.open_store(NAMESPACE, {}, PAYLOAD)
    stored = record.header_len_for(PAYLOAD) + PAYLOAD
    store = FileBackend(root, capacity=Capacity(max_bytes=cap_records * stored), eviction=order).open_store(
        NAMESPACE, {"bench": "prefix_replay"}, PAYLOAD)
    store.scan()
    return store


def replay(store: Store, requests: list[tuple[list[str], int]]) -> tuple[int, int, int]:
    """Drive one store like the daemon; returns (prefix blocks hit, prefix blocks asked, refused)."""
    data = memoryview(bytes(range(256)) * (PAYLOAD // 256))
    out = memoryview(bytearray(PAYLOAD))
    hit_blocks = asked = refused = 0
    for keys, prefix in requests:
        hits = store.contains_prefix(keys)                       # lookup
        if hits:
            store.touch_chain(keys[:hits])
            loaded = 0                                           # swap_in of the hit prefix
            for key in keys[:hits]:
                if store.get_into(key, out).value != "loaded":
                    break
                loaded += 1
            store.touch_chain(keys[:loaded], persist=True)
            hits = loaded
        hit_blocks += min(hits, prefix)
        asked += prefix
        store.expect_chain(keys)                                 # swap_out of the chain
        for key in keys[hits:]:
            if store.contains(key):
                continue
            try:
                store.put(key, data)
            except NoSpace:
                refused += 1
    return hit_blocks, asked, refused


def reachable(store: Store, requests: list[tuple[list[str], int]]) -> int:
    """Records some request's chain reaches by lookup (the rest are dead weight)."""
    seen: set[str] = set()
    for keys, _ in requests:
        seen.update(keys[: store.contains_prefix(keys)])
    return len(seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--docs", type=int, default=12)
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--zipf", type=float, default=1.1, help="popularity skew of the documents (0: uniform)")
    parser.add_argument("--cap-fraction", type=float, default=0.5)
    parser.add_argument("--doc-blocks", type=lambda v: tuple(int(x) for x in v.split("-")), default=(4, 24),
                        help="length range of a document, in blocks (LOW-HIGH)")
    parser.add_argument("--tiers", default="host,file")
    parser.add_argument("--workload", choices=("documents", "conversations"), default="documents")
    args = parser.parse_args()
    requests, distinct = workload(args)
    cap = max(1, int(distinct * args.cap_fraction))
    print(f"{args.workload}: {len(requests)} requests, {distinct} distinct prefix records (working set), cap {cap} "
          f"records ({args.cap_fraction:.0%}), zipf {args.zipf}, {PAYLOAD}-byte payloads, seed {args.seed}")
    results = []
    for tier in args.tiers.split(","):
        for order in ("lru", "chain"):
            with tempfile.TemporaryDirectory(prefix="kvswap-replay-") as root:
                store = open_store(tier, order, cap, root)
                started = time.perf_counter()
                hit_blocks, asked, refused = replay(store, requests)
                seconds = time.perf_counter() - started
                results.append(Result(tier, order, hit_blocks, asked, store.usage()["records"],
                                      reachable(store, requests), refused, seconds))
                store.close()
    print(f"{'tier':<5} {'order':<6} {'hit rate':>9} {'vs lru':>7} {'stored':>7} {'reachable':>9} "
          f"{'refused':>8} {'seconds':>8}")
    base = {r.tier: r.hit_rate for r in results if r.order == "lru"}
    for r in results:
        ratio = r.hit_rate / base[r.tier] if base.get(r.tier) else float("nan")
        print(f"{r.tier:<5} {r.order:<6} {r.hit_rate:>9.3f} {ratio:>7.2f} {r.stored:>7} {r.reachable:>9} "
              f"{r.refused:>8} {r.seconds:>8.2f}")


if __name__ == "__main__":
    main()
