"""``kvswap status`` against a live daemon: the table and --json from the real command, and
the rates through the one seam ``collect`` offers (what happens between the two samples)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from kvswap.daemon.tools.status import collect, human_bytes, human_duration, normalize_endpoint, parse_exposition
from kvswap.protocol import CacheLayout, Client, HostKVCache

from support import DaemonProcess, free_port

STATUS = [sys.executable, "-m", "kvswap.daemon.tools.admin", "status"]


def run_status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*STATUS, *args], capture_output=True, text=True, timeout=60)


def test_json_reports_registration_tiers_staging_and_work(daemon: DaemonProcess, client: Client,
                                                          cache: HostKVCache, layout: CacheLayout) -> None:
    reply = client.register(cache)
    client.swap_out(list(range(5)), [f"s{i}" for i in range(5)], wait="persisted")
    stored = client.stats()["tiers"]["file"]

    r = run_status(str(daemon.port), "--json", "--interval", "0.2")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["endpoint"] == daemon.endpoint and report["registered"] is True
    reg = report["registration"]
    assert reg["namespace"] == reply["namespace"] and reg["model"] == "test-model"
    assert reg["pid"] == os.getpid()
    assert (reg["blocks"], reg["block_size"], reg["record_bytes"]) == (32, 8, reply["record_bytes"])
    assert report["tiers"]["file"]["records"] == 5 and report["tiers"]["file"]["bytes"] == stored["bytes"]
    assert report["staging"]["write"]["slots"] >= report["staging"]["write"]["free"] >= 0
    assert report["pending_writes"] == 0 and report["requests_in_flight"] == 1  # the stats call itself
    rates = report["rates"]
    # The metrics port comes from stats, so the metric rates are there without --metrics-url.
    assert report["metrics_url"] == daemon.metrics_url + "/metrics" and report["metrics_error"] is None
    assert rates["source"] == "stats+metrics"
    # The RAM tier is on by default: it is reported beside the file tier.
    assert {k: rates["deltas"][k] for k in ("stored_records", "stored_bytes")} == {
        "stored_records": {"file": 0.0, "host": 0.0}, "stored_bytes": {"file": 0.0, "host": 0.0}}


def test_table_is_readable_and_says_what_is_missing(daemon: DaemonProcess, client: Client,
                                                    cache: HostKVCache) -> None:
    r = run_status(daemon.endpoint, "--interval", "0")
    assert r.returncode == 0, r.stderr
    assert "Registration  none (no engine has registered)" in r.stdout
    assert "Rates" not in r.stdout  # one sample, no rates

    reply = client.register(cache)
    client.swap_out([0, 1, 2], ["t0", "t1", "t2"], wait="persisted")
    stored_bytes = client.stats()["tiers"]["file"]["bytes"]
    r = run_status(f"127.0.0.1:{daemon.port}", "--interval", "0.2", "--metrics-url", daemon.metrics_url + "/metrics")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"kvswapd 0.1.0  {daemon.endpoint}  up ")
    assert f"  namespace   {reply['namespace']}" in lines
    assert f"  blocks      32 x 8 tokens, record 3.0 KiB ({reply['record_bytes']} B, 6 regions)" in lines
    file_row = next(line for line in lines if line.startswith("  file "))
    assert file_row.split()[:4] == ["file", "3", *human_bytes(stored_bytes).split()]
    assert "In flight     0 requests, 0 records waiting to be written, 0 write tasks" in lines
    assert any(line.startswith("  requests/s    stats ") for line in lines)


def test_rates_count_exactly_the_work_between_the_samples(daemon: DaemonProcess, cache: HostKVCache,
                                                          layout: CacheLayout) -> None:
    with Client(daemon.endpoint, timeout=10) as engine, Client(daemon.endpoint, timeout=10) as operator:
        engine.register(cache)
        engine.swap_out([0, 1], ["r0", "r1"], wait="persisted")
        record_bytes = operator.stats()["registration"]["record_bytes"]

        def work(_: float) -> None:  # instead of sleeping: 4 blocks out, 2 in, one lookup
            engine.swap_out([2, 3, 4, 5], ["r2", "r3", "r4", "r5"], wait="persisted")
            assert engine.swap_in(["r0", "r1"], [10, 11]).loaded == 2
            assert engine.lookup(["r0", "r1", "r2", "nope"]) == 3

        report = collect(operator, 1.0, daemon.metrics_url + "/metrics", pause=work)
    deltas = report["rates"]["deltas"]
    assert report["rates"]["source"] == "stats+metrics"
    assert deltas["stored_records"] == {"file": 4.0, "host": 4.0}  # the RAM tier is on by default
    assert deltas["bytes"] == {"out": 4.0 * record_bytes, "in": 2.0 * record_bytes}
    assert deltas["swap_out_blocks"] == {"stored": 4.0} and deltas["swap_in_blocks"] == {"loaded": 2.0}
    assert deltas["requests"]["swap_out"] == 1 and deltas["requests"]["swap_in"] == 1
    assert deltas["lookup_keys"] == {"hit": 3.0, "miss": 1.0} and report["rates"]["lookup_hit_ratio"] == 0.75
    per_s = report["rates"]["per_s"]
    assert math.isclose(per_s["stored_records"]["file"] * report["rates"]["interval_s"], 4.0)


def test_unreachable_daemon_is_an_error_not_a_hang() -> None:
    r = run_status(str(free_port()), "--timeout", "1")
    assert r.returncode == 1
    assert r.stderr.startswith("kvswap status: tcp://127.0.0.1:") and "unavailable" in r.stderr


def test_helpers() -> None:
    assert normalize_endpoint("55501") == "tcp://127.0.0.1:55501"
    assert normalize_endpoint("gpu0:55501") == "tcp://gpu0:55501"
    assert normalize_endpoint("ipc:///run/kvswap.sock") == "ipc:///run/kvswap.sock"
    assert [human_bytes(n) for n in (0, 1023, 3072, 5 * 2**30)] == ["0 B", "1023 B", "3.0 KiB", "5.0 GiB"]
    assert [human_duration(s) for s in (5, 65, 3723.4, 90061)] == ["5s", "1m 05s", "1h 02m 03s", "1d 01h 01m"]
    assert parse_exposition('a_total{x="1",y="q\\"z"} 2\n# HELP a\nb 3.5\nbad line\n') == {
        ("a_total", (("x", "1"), ("y", 'q\\"z'))): 2.0, ("b", ()): 3.5}
