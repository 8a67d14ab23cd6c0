"""/readyz tells the truth about the configured locations (issue 14): a daemon whose only store
and retrieve location is a Redis that dies is not ready until Redis is back; the opt-out keeps
it ready; probe failures warn, rate-limited; failed writes log one line per request with tier
and reason. Real redis-server, real daemon subprocess, real HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvswap.protocol import Client, HostKVCache
from kvswap.testing.remote_servers import RedisServer, redis_skip_reason
from support import DaemonProcess, free_port, wait_until

pytestmark = pytest.mark.skipif(bool(redis_skip_reason()), reason=redis_skip_reason() or "redis")


def log_records(daemon: DaemonProcess) -> list[dict]:
    return [json.loads(line) for line in daemon.log().splitlines() if line.startswith("{")]


def remote_only(tmp_path: Path, server: RedisServer, *extra: str) -> DaemonProcess:
    return DaemonProcess(tmp_path / "store", free_port(), free_port(), extra_args=[
        "--remote-url", server.url + "?timeout=0.5&connect_timeout=0.5", "--remote-check-interval-s", "0.2",
        "--store-locations", "remote", "--retrieve-locations", "remote", "--log-format", "json", *extra]).start()


def test_readyz_fails_while_the_only_store_location_is_down_and_recovers(tmp_path, cache: HostKVCache):
    server = RedisServer(tmp_path).start()
    daemon = remote_only(tmp_path, server)
    try:
        assert wait_until(lambda: daemon.http("/readyz")[0] == 200, timeout=15), daemon.log()
        with Client(daemon.endpoint, timeout=20) as c:
            c.register(cache)
            assert c.swap_out([0, 1], ["r0", "r1"], wait="persisted").status == ["stored", "stored"]

            server.kill()
            assert wait_until(lambda: daemon.http("/readyz")[0] == 503, timeout=15), daemon.log()
            assert daemon.http("/healthz")[0] == 200  # the process is fine; it just cannot serve
            out = c.swap_out([2, 3, 4], ["w0", "w1", "w2"], wait="persisted")
            assert out.status == ["unavailable"] * 3
            # Several probes fail while it is down...
            assert wait_until(lambda: c.stats()["tiers"]["remote"]["failures"] >= 4, timeout=15)

            server.start()
            assert wait_until(lambda: daemon.http("/readyz")[0] == 200, timeout=15), daemon.log()
            assert c.swap_out([5], ["after"], wait="persisted").status == ["stored"]
    finally:
        assert daemon.stop() == 0
        server.stop()
    records = log_records(daemon)
    warnings = [r["msg"] for r in records if r["level"] == "warning"]
    # ...but the probe failures warned once (rate-limited), not once per probe.
    assert sum("probe failed" in m for m in warnings) == 1, warnings
    assert any("not ready: location(s) remote cannot serve" in m for m in warnings)
    assert any(r["msg"].startswith("ready: every store") for r in records)
    # The failed swap_out is one line naming tier and reason, and no key is logged on its own.
    failed = [m for m in warnings if "records not stored" in m]
    assert len(failed) == 1 and "3 of 3" in failed[0] and "tier remote: unavailable x3" in failed[0], failed
    assert not any("w0" in m or "w1" in m for m in warnings)


def test_ready_when_degraded_keeps_readyz_up_through_an_outage(tmp_path, cache: HostKVCache):
    server = RedisServer(tmp_path).start()
    daemon = remote_only(tmp_path, server, "--ready-when-degraded")
    try:
        assert wait_until(lambda: daemon.metric("kvswap_tier_healthy", tier="remote") == 1, timeout=15)
        server.kill()
        assert wait_until(lambda: daemon.metric("kvswap_tier_healthy", tier="remote") == 0, timeout=15)
        assert daemon.http("/readyz") == (200, "ready\n")
    finally:
        assert daemon.stop() == 0
        server.stop()
    assert any("(ready anyway: ready_when_degraded)" in r["msg"] for r in log_records(daemon))
