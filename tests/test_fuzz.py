"""Protocol fuzz against one live daemon: >= 2,000 hostile frames (random bytes, truncated
msgpack, wrong types, huge lists, bad keys, out-of-range block ids, valid ops with garbage
fields). Every frame gets exactly one well-formed answer — a typed error, or ok for a valid
request — the daemon never exits, and a ping after every batch is answered.
benchmarks/fuzz_long.py runs the same for 100,000+ frames."""

from __future__ import annotations

from typing import Iterator

import pytest
from hypothesis import HealthCheck, given, settings

from kvswap.protocol import Client, HostKVCache
from kvswap.testing.fuzz_frames import LAYOUT, FuzzSession, batch_strategy, canonical_frames
from support import DaemonProcess, free_port

MIN_FRAMES = 2_000
#: Stored before the fuzz; no generated frame can name them (or clear the store).
KEPT = ["stored-before-the-fuzz.0", "stored-before-the-fuzz.1", "stored-before-the-fuzz.2"]


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, HostKVCache, list[bytes]]]:
    """One daemon for the module, with a small cache registered (it stays registered: the
    generators never send a valid register or unregister)."""
    d = DaemonProcess(tmp_path_factory.mktemp("fuzz") / "store", free_port(), free_port()).start()
    with HostKVCache.create(LAYOUT) as cache:
        cache.fill_random(seed=11)
        with Client(d.endpoint, timeout=10) as c:
            c.register(cache)
            c.swap_out([0, 1, 2], KEPT, wait="persisted")
        yield d, cache, [cache.block_record(b) for b in (0, 1, 2)]
    assert d.stop() == 0, d.log()


def test_every_hostile_frame_gets_one_typed_answer(fuzzed, capsys: pytest.CaptureFixture) -> None:
    daemon, cache, expected = fuzzed
    session = FuzzSession(daemon.endpoint, answers=daemon.answers)

    @settings(max_examples=MIN_FRAMES // 8 + 10, deadline=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(batch_strategy)
    def one_batch(frames) -> None:
        session.run_batch(frames)
        assert daemon.alive, daemon.log()[-3000:]

    try:
        session.run_batch(canonical_frames())
        one_batch()
        session.finish()
    finally:
        session.close()
    with capsys.disabled():
        print(f"\nfuzz: {session.frames} frames; by kind {dict(session.kinds)}; answers {dict(session.codes)}")
    assert session.frames >= MIN_FRAMES
    # Every family of hostile input was answered with its own code (the canonical frames
    # guarantee one of each; the generated ones add the rest).
    assert {"bad_request", "invalid_key", "too_large", "out_of_range", "unknown_op", "unsupported_version",
            "invalid_layout", "ok"} <= set(session.codes)
    # The daemon is still up, still registered, and still serves what was stored before.
    assert daemon.alive
    with Client(daemon.endpoint, timeout=10) as c:
        assert c.stats()["registered"] is True
        assert c.lookup(KEPT) == 3
        loaded = c.swap_in(KEPT, [29, 30, 31])
    assert loaded.status == ["loaded"] * 3
    assert [cache.block_record(b) for b in (29, 30, 31)] == expected
