"""The connector's lookups never hold vLLM's scheduler (kvswap/engines/vllm/lookups.py): asked
once, they answer None ("ask again") until every rank's daemon replied, then the prefix all of
them hold. Real daemons over real sockets; no vLLM needed."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import DaemonProcess, free_port, wait_until

from kvswap.engines.vllm import lookups as lookups_module
from kvswap.engines.vllm.lookups import Lookups
from kvswap.protocol import CacheLayout, Client, HostKVCache, KvswapError

LAYOUT = CacheLayout("lookups", num_layers=1, num_blocks=16, block_size=4, num_kv_heads=1, head_dim=8)
KEYS = [f"{i:02x}" * 8 for i in range(8)]


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[list[DaemonProcess]]:
    """Two daemons, one per rank: rank 0 holds 6 of the keys, rank 1 the first 4."""
    daemons = [DaemonProcess(tmp_path / f"rank{r}", free_port(), free_port()).start() for r in range(2)]
    caches = []
    try:
        for daemon, stored in zip(daemons, (6, 4)):
            cache = HostKVCache.create(LAYOUT)
            caches.append(cache)
            cache.fill_random(seed=stored)
            with Client(daemon.endpoint, timeout=30) as c:
                c.register(cache)
                assert c.swap_out(list(range(stored)), KEYS[:stored], wait="persisted").stored == stored
        yield daemons
    finally:
        for daemon in daemons:
            daemon.stop()
        for cache in caches:
            cache.close()


def _connected(daemons: list[DaemonProcess], timeout: float = 5) -> list[Client]:
    """Clients whose connections are up, as the scheduler's are once the engine serves."""
    clients = [Client(d.endpoint, timeout=timeout) for d in daemons]
    for c in clients:
        c.ping()
    return clients


def _answer(lookups: Lookups, req_id: str, keys: list[str], start: int = 0, timeout: float = 30) -> tuple[int, int]:
    """Ask until answered, as the scheduler does once a step: (hits, how many calls said None)."""
    waited = 0
    deadline = time.monotonic() + timeout
    while (hits := lookups.ask(req_id, keys, start)) is None:
        waited += 1
        assert time.monotonic() < deadline
    return hits, waited


def test_first_ask_sends_and_the_answer_is_the_prefix_every_rank_holds(ranks: list[DaemonProcess]) -> None:
    answers: list[tuple[float, int, int]] = []
    clients = _connected(ranks)
    lookups = Lookups(clients, timeout=5, on_answer=lambda s, k, h: answers.append((s, k, h)))
    try:
        assert lookups.ask("r1", KEYS) is None  # sent, not waited for
        assert len(lookups) == 1
        hits, _ = _answer(lookups, "r1", KEYS)
        assert hits == 4  # rank 1 holds only 4: a load could not land on every rank past them
        assert len(lookups) == 0 and answers[0][1:] == (8, 4) and answers[0][0] > 0
        # Each rank was asked once, at the same time (one lookup each, not one after the other).
        assert [d.metric("kvswap_requests_total", op="lookup", outcome="ok") for d in ranks] == [1, 1]
        # Sent when the request arrives (from its first block); the scheduler then asks from past
        # the engine's own cache hit (1 block here), and the same reply answers it.
        lookups.prefetch("r2", KEYS)
        assert _answer(lookups, "r2", KEYS, start=1)[0] == 3
        assert [d.metric("kvswap_requests_total", op="lookup", outcome="ok") for d in ranks] == [2, 2]
        # The engine's cache holds more than the daemons do (5 blocks; rank 1 holds 4): what they
        # hold past it is unknown, so it is asked again from there.
        lookups.prefetch("r3", KEYS)
        assert _answer(lookups, "r3", KEYS, start=5)[0] == 0  # rank 1 holds nothing past block 4
        assert wait_until(lambda: [d.metric("kvswap_requests_total", op="lookup", outcome="ok")
                                   for d in ranks] == [4, 4])
        # A request whose engine cache now holds less than when it asked starts over.
        lookups.prefetch("r4", KEYS[2:])
        assert lookups.ask("r4", KEYS[1:]) is None
        assert _answer(lookups, "r4", KEYS[1:])[0] == 3
        assert wait_until(lambda: [d.metric("kvswap_requests_total", op="lookup", outcome="ok")
                                   for d in ranks] == [6, 6])
    finally:
        lookups.close()
        for c in clients:
            c.close()


def test_a_rank_that_stops_answering_costs_a_miss_not_a_wait(ranks: list[DaemonProcess]) -> None:
    errors: list[KvswapError] = []
    clients = _connected(ranks)
    lookups = Lookups(clients, timeout=0.3, on_error=errors.append)
    stopped = ranks[1].proc
    assert stopped is not None
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        slowest = 0.0
        started = time.monotonic()
        while True:
            t = time.perf_counter()
            hits = lookups.ask("r1", KEYS)
            slowest = max(slowest, time.perf_counter() - t)
            if hits is not None:
                break
        # Answered once the client's wait was over (0.3 s deadline + 1 s grace), as a miss, and
        # no call held the scheduler meanwhile.
        assert hits == 0 and errors and errors[0].code == "timeout"
        assert 1.2 <= time.monotonic() - started < 30
        assert slowest < 0.2
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
        lookups.close()
        for c in clients:
            c.close()


def test_the_first_ask_waits_for_the_replies_within_its_budget(ranks: list[DaemonProcess]) -> None:
    clients = _connected(ranks)
    lookups = Lookups(clients, timeout=5, wait_s=5.0)
    try:
        assert lookups.ask("r1", KEYS) == 4  # answered in the first call: no scheduler step lost
    finally:
        lookups.close()
    stopped = ranks[1].proc
    assert stopped is not None
    lookups = Lookups(clients, timeout=5, wait_s=0.05)
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        t = time.perf_counter()
        assert lookups.ask("r2", KEYS) is None  # rank 1 does not answer: the budget, then None
        first = time.perf_counter() - t
        t = time.perf_counter()
        assert lookups.ask("r2", KEYS) is None
        again = time.perf_counter() - t
        # The budget is per request, spent once: a slow daemon costs the scheduler ~50 ms per new
        # request, not per step.
        assert 0.04 <= first < 2 and again < 0.03
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
        lookups.close()
        for c in clients:
            c.close()


def test_a_forgotten_lookup_is_collected_when_its_reply_comes(ranks: list[DaemonProcess]) -> None:
    clients = _connected(ranks)
    lookups = Lookups(clients, timeout=5)
    try:
        assert lookups.ask("gone", KEYS) is None
        lookups.forget("gone")  # the request was aborted
        assert len(lookups) == 0 and len(lookups._abandoned) == 2
        assert wait_until(lambda: lookups.ask("next", KEYS[:2]) is not None and not lookups._abandoned)
        # Nothing of the abandoned lookup is left in the clients.
        assert all(not c._pending and not c._replies and not c._give_up for c in clients)
    finally:
        lookups.close()
        for c in clients:
            c.close()


def test_a_daemon_that_is_down_answers_a_miss_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    errors: list[KvswapError] = []
    client = Client(f"tcp://127.0.0.1:{free_port()}", timeout=5)
    lookups = Lookups([client], timeout=5, on_error=errors.append)
    try:
        t = time.perf_counter()
        assert lookups.ask("r1", KEYS) == 0
        assert time.perf_counter() - t < 0.5  # not the client's 1 s wait for a connection
        assert errors[0].code == "unavailable"
        monkeypatch.setattr(lookups_module, "MAX_IN_FLIGHT", 0)
        assert lookups.ask("r2", KEYS) == 0 and len(errors) == 1  # bounded: not even sent
    finally:
        lookups.close()
        client.close()


def test_the_known_view_answers_prefixes_forgets_failures_and_stays_bounded() -> None:
    from kvswap.engines.vllm.known import KnownKeys

    known = KnownKeys(capacity=5)
    known.add(KEYS[:4])
    assert known.prefix(KEYS) == 4 and known.prefix(KEYS[1:]) == 3 and known.prefix(KEYS[4:]) == 0
    known.forget([KEYS[2]])  # its load failed: recomputed, and asked of the daemons again
    assert known.prefix(KEYS) == 2
    known.add(KEYS[4:8])  # 7 added, 5 kept: the least recently touched go first
    assert len(known) == 5
    assert known.prefix(KEYS[4:]) == 4
    # Touched last before the adds: KEYS[3], then KEYS[0] and KEYS[1] (by prefix()); so 3 and 0 went.
    assert known.prefix(KEYS[:1]) == 0 and known.prefix(KEYS[1:2]) == 1 and known.prefix(KEYS[3:4]) == 0
    with pytest.raises(ValueError):
        KnownKeys(capacity=-1)
