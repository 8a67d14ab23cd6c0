"""Tiers and asymmetric locations through real daemons and real remote servers on loopback:
the prefill/decode flow over Redis and over Mooncake Store, a remote server killed and
restarted mid-run, and start-up validation of the locations."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvswap.protocol import CacheLayout, Client, HostKVCache
from kvswap.testing.remote_servers import MooncakeMaster, RedisServer, mooncake_skip_reason, redis_skip_reason

from support import DaemonProcess, free_port, wait_until

LAYOUT = CacheLayout("pd-test", num_layers=2, num_blocks=32, block_size=16, num_kv_heads=2, head_dim=64)


@pytest.fixture(params=["redis", "mooncake"])
def remote_url(request, tmp_path: Path):
    if request.param == "redis":
        if redis_skip_reason():
            pytest.skip(redis_skip_reason())
        server = RedisServer(tmp_path).start()
        yield server.url
    else:
        if mooncake_skip_reason():
            pytest.skip(mooncake_skip_reason())
        server = MooncakeMaster(tmp_path).start()
        # The decode daemon contributes the pool memory the records live in.
        yield server.url(segment="64MiB")
    server.stop()


def test_decode_stores_to_remote_and_prefill_retrieves_then_serves_from_host(tmp_path: Path, remote_url: str) -> None:
    decode = DaemonProcess(tmp_path / "decode", free_port(), free_port(), extra_args=[
        "--remote-url", remote_url, "--store-locations", "remote", "--retrieve-locations", "remote"]).start()
    prefill = DaemonProcess(tmp_path / "prefill", free_port(), free_port(), extra_args=[
        "--remote-url", remote_url, "--host-tier-bytes", "16M", "--store-locations", "host",
        "--retrieve-locations", "host,remote"]).start()
    keys = [f"turn1-{i}" for i in range(8)]
    try:
        with HostKVCache.create(LAYOUT) as decode_cache, HostKVCache.create(LAYOUT) as prefill_cache, \
                Client(decode.endpoint, timeout=20) as d, Client(prefill.endpoint, timeout=20) as p:
            decode_cache.fill_random(21)
            d.register(decode_cache)
            p.register(prefill_cache)
            out = d.swap_out(list(range(8)), keys, wait="persisted")
            assert out.status == ["stored"] * 8
            expected = [decode_cache.block_record(b) for b in range(8)]

            # The answer came after every store location had the records: the other node finds them.
            assert p.lookup(keys + ["never-stored"]) == 8
            first = p.swap_in(keys, list(range(16, 24)))
            assert first.loaded == 8
            assert [prefill_cache.block_record(b) for b in range(16, 24)] == expected
            assert prefill.metric("kvswap_tier_ops_total", tier="remote", op="get", result="hit") == 8
            assert prefill.metric("kvswap_tier_ops_total", tier="host", op="promote", result="ok") == 8

            prefill_cache.zero_blocks(list(range(32)))
            second = p.swap_in(keys, list(range(8)))
            assert second.loaded == 8
            assert [prefill_cache.block_record(b) for b in range(8)] == expected
            assert prefill.metric("kvswap_tier_ops_total", tier="host", op="get", result="hit") == 8
            assert prefill.metric("kvswap_tier_ops_total", tier="remote", op="get", result="hit") == 8  # unchanged
            assert prefill.metric("kvswap_tier_bytes_total", tier="host", direction="read") == 8 * LAYOUT.record_bytes
            assert decode.metric("kvswap_tier_ops_total", tier="remote", op="put", result="ok") == 8
            assert decode.metric("kvswap_tier_healthy", tier="remote") == 1
            # The decode node stored nothing locally: its file tier is not a store location.
            assert d.stats()["tiers"]["file"]["records"] == 0
    finally:
        assert decode.stop() == 0
        assert prefill.stop() == 0


@pytest.mark.skipif(bool(redis_skip_reason()), reason=redis_skip_reason() or "redis")
def test_remote_killed_mid_run_swaps_go_on_and_it_recovers(tmp_path: Path) -> None:
    server = RedisServer(tmp_path).start()
    daemon = DaemonProcess(tmp_path / "store", free_port(), free_port(), extra_args=[
        "--remote-url", server.url + "?timeout=0.5&connect_timeout=0.5", "--remote-check-interval-s", "0.2"]).start()
    try:
        with HostKVCache.create(LAYOUT) as cache, Client(daemon.endpoint, timeout=20) as c:
            cache.fill_random(5)
            c.register(cache)
            assert c.swap_out([0, 1], ["a0", "a1"], wait="persisted").status == ["stored", "stored"]
            server.kill()

            out = c.swap_out([2, 3], ["b0", "b1"], wait="persisted")
            assert out.status == ["unavailable", "unavailable"]  # the file tier has them; the remote does not
            assert wait_until(lambda: daemon.metric("kvswap_tier_healthy", tier="remote") == 0)
            cache.zero_blocks([10, 11, 12])
            r = c.swap_in(["a0", "a1", "b0"], [10, 11, 12])
            assert r.status == ["loaded", "loaded", "loaded"]  # served by the file tier
            assert cache.block_record(12) == cache.block_record(2)
            assert c.lookup(["a0", "b0", "b1"]) == 3
            assert c.ping() < 5
            assert daemon.metric("kvswap_tier_ops_total", tier="remote", op="put", result="unavailable") >= 2

            server.start()
            assert wait_until(lambda: daemon.metric("kvswap_tier_healthy", tier="remote") == 1, timeout=15)
            assert c.swap_out([4], ["c0"], wait="persisted").status == ["stored"]
            assert daemon.metric("kvswap_tier_ops_total", tier="remote", op="put", result="ok") == 3
    finally:
        assert daemon.stop() == 0
        server.stop()


@pytest.mark.parametrize(("args", "message"), [
    (["--store-locations", "file,nvme"], "unknown tier 'nvme' in --store-locations; valid: host, file"),
    (["--host-tier-bytes", "0", "--retrieve-locations", "host"], "tier 'host' in --retrieve-locations is not configured"),
    (["--store-locations", "remote"], "set --remote-url"),
    (["--retrieve-locations", "file,file"], "--retrieve-locations names file more than once"),
    (["--retrieve-locations", " , "], "empty name in location list"),
    (["--host-tier-bytes", "1M", "--retrieve-locations", "file,host,"], "empty name in location list"),
    (["--remote-url", "memcached://x:1"], "redis://"),
    (["--remote-url", "redis://127.0.0.1:6379/0?colour=blue"], "colour"),
])
def test_bad_locations_fail_start_up_with_their_message(tmp_path: Path, args: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "kvswap.daemon", "--cache-queue-port", str(free_port()),
                             "--metrics-port", str(free_port()), "--storage-dir", str(tmp_path / "s"), *args],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_locations_resolve_to_the_configured_tiers_in_order() -> None:
    from kvswap.daemon.config import Config

    config = Config(storage_dir="/tmp/x", host_tier_bytes=1 << 20, remote_url="redis://127.0.0.1:1/0")
    loc = config.locations()
    assert loc.store == ("host", "file", "remote") and loc.retrieve == ("host", "file", "remote")
    assert loc.promote is True
    asymmetric = Config(storage_dir="/tmp/x", host_tier_bytes=1 << 20, remote_url="redis://127.0.0.1:1/0",
                        store_locations="REMOTE", retrieve_locations="remote, host").locations()
    assert asymmetric.store == ("remote",) and asymmetric.retrieve == ("remote", "host")
    no_host = Config(storage_dir="/tmp/x", retrieve_locations="file").locations()
    assert no_host.promote is False
