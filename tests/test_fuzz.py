"""Protocol fuzz against one live daemon: >= 2,000 hostile frames (random bytes, truncated
msgpack, wrong types, huge lists, bad keys, out-of-range block ids, valid ops with garbage
fields). Every frame gets exactly one well-formed answer — a typed error, or ok for a valid
request — the daemon never exits, and a ping after every batch is answered.
benchmarks/fuzz_long.py runs the same for 100,000+ frames."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import HealthCheck, given, settings

from fuzz_frames import LAYOUT, FuzzSession, batch_strategy, canonical_frames
from kvswap.protocol import Client, HostKVCache
from support import DaemonProcess, free_port

MIN_FRAMES = 2_000


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, HostKVCache]]:
    d = DaemonProcess(tmp_path_factory.mktemp("fuzz") / "store", free_port(), free_port()).start()
    with HostKVCache.create(LAYOUT) as cache:
        cache.fill_random(seed=11)
        with Client(d.endpoint, timeout=10) as c:
            c.register(cache)
            c.swap_out([0, 1, 2], ["kept0", "kept1", "kept2"], wait="persisted")
        yield d, cache
    assert d.stop() == 0, d.log()


def test_every_hostile_frame_gets_one_typed_answer(fuzzed, capsys: pytest.CaptureFixture) -> None:
    daemon, cache = fuzzed
    session = FuzzSession(daemon.endpoint)

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
    # The daemon is still up, still registered, and still has what was stored before the fuzz.
    assert daemon.alive
    with Client(daemon.endpoint, timeout=10) as c:
        assert c.stats()["registered"] is True
        assert c.lookup(["kept0", "kept1", "kept2"]) in (0, 3)  # a fuzzed 'clear' or 'delete' may remove them
