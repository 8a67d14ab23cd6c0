"""An engine SIGKILLed in the middle of its swaps: the daemon lets go of everything it held
for it (the registration, the mapping of its shared memory, staging slots, requests in
flight) and serves the next engine without a restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from kvswap.protocol import CacheLayout, Client, HostKVCache

from support import DaemonProcess, shm_exists, wait_until

#: The dying engine keeps this many requests pipelined, so a kill always lands mid-swap.
ENGINE = """
import sys
from kvswap.protocol import CacheLayout, Client, HostKVCache
from kvswap.protocol import messages as m

layout = CacheLayout("dying", num_layers=4, num_blocks=512, block_size=16, num_kv_heads=2, head_dim=64,
                     dtype="float16")
cache = HostKVCache.create(layout)
cache.fill_random(seed=5)
c = Client(sys.argv[1], timeout=30)
c.register(cache)
print(cache.segment.name, flush=True)
half, round_ = 256, 0
pending = []
while True:
    keys = [f"r{round_}-{i}" for i in range(half)]
    pending.append(c.send(m.SwapOut, {"block_ids": tuple(range(half)), "keys": tuple(keys), "wait": "persisted"}))
    pending.append(c.send(m.SwapIn, {"keys": tuple(keys), "block_ids": tuple(range(half, 2 * half))}))
    while len(pending) > 4:
        c.wait(pending.pop(0))
    round_ += 1
    if round_ == 2:
        print("swapping", flush=True)
"""


def daemon_holds(daemon: DaemonProcess) -> str:
    """What the daemon has open or mapped: an engine's segment is held open by descriptor
    (the daemon copies with preadv/pwritev, never through a mapping)."""
    assert daemon.proc is not None
    fds = Path(f"/proc/{daemon.proc.pid}/fd")
    targets = []
    for fd in fds.iterdir():
        try:
            targets.append(os.readlink(fd))
        except FileNotFoundError:
            pass
    return Path(f"/proc/{daemon.proc.pid}/maps").read_text() + "\n".join(targets)


def test_engine_killed_mid_swap_is_released_and_a_new_engine_registers(daemon: DaemonProcess) -> None:
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, daemon.endpoint], stdout=subprocess.PIPE, text=True)
    segment = ""
    try:
        segment = engine.stdout.readline().strip()
        assert segment and shm_exists(segment)
        assert engine.stdout.readline().strip() == "swapping"
        assert segment in daemon_holds(daemon)  # held while the engine lives
        assert wait_until(lambda: daemon.metric("kvswap_requests_in_flight") > 0)
        engine.send_signal(signal.SIGKILL)
        engine.wait()  # reaped: its pid is gone, not a zombie

        assert wait_until(lambda: daemon.metric("kvswap_registered") == 0, timeout=15), daemon.log()
        # Counted once the requests still copying to or from its memory have let go of it.
        assert wait_until(lambda: daemon.metric("kvswap_registrations_total", event="engine_exited") == 1,
                          timeout=15), daemon.log()
        assert segment not in daemon_holds(daemon)  # let go, though the segment still exists
        assert shm_exists(segment)
        # What it had in flight ran out and gave back its staging.
        assert wait_until(lambda: daemon.metric("kvswap_requests_in_flight") == 0, timeout=15)
        with Client(daemon.endpoint, timeout=30) as c:
            c.flush()
            stats = c.stats()
        assert stats["registered"] is False and stats["pending_writes"] == 0
        for pool in ("write", "read"):
            assert daemon.metric("kvswap_staging_slots", pool=pool, state="used") == 0
        # Every swap_in was answered: done before the death, or cut short by the release
        # (not_registered: copies stop at their next block once the registration is closing).
        answered = sum(daemon.metric("kvswap_requests_total", op="swap_in", outcome=o) for o in ("ok", "error"))
        assert answered >= 1
        assert daemon.metric("kvswap_requests_total", op="swap_in", outcome="error") == daemon.metric(
            "kvswap_errors_total", op="swap_in", code="not_registered")
    finally:
        engine.kill()
        engine.wait()
        if segment:
            try:
                os.unlink(f"/dev/shm/{segment}")
            except FileNotFoundError:
                pass

    # The next engine registers a different layout into the same daemon and round-trips bytes.
    layout = CacheLayout("next", num_layers=2, num_blocks=16, block_size=8, num_kv_heads=2, head_dim=16)
    with HostKVCache.create(layout) as cache, Client(daemon.endpoint, timeout=10) as c:
        cache.fill_random(seed=9)
        assert c.register(cache)["record_bytes"] == layout.record_bytes
        expected = [cache.block_record(b) for b in range(4)]
        assert c.swap_out(list(range(4)), ["n0", "n1", "n2", "n3"], wait="persisted").stored == 4
        cache.zero_blocks(list(range(16)))
        assert c.swap_in(["n0", "n1", "n2", "n3"], list(range(8, 12))).loaded == 4
        assert [cache.block_record(b) for b in range(8, 12)] == expected
    assert daemon.metric("kvswap_registered") == 1
