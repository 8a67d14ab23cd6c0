"""The dashboard and the alert rules against a live daemon: every metric they name is one the
daemon exports (with the labels they use), and a real Prometheus server (Debian's
``prometheus`` binary) scrapes the daemon, loads the rules and answers queries about it."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Iterator

import msgpack
import pytest
import yaml
import zmq

from kvswap import __version__
from kvswap.protocol import CacheLayout, Client, HostKVCache, InvalidKey, NotRegistered

from disk_records import record_of
from promql import references
from support import INSTALLED_BY_TEST_SETUP, DaemonProcess, free_port, wait_until
from test_deploy_files import PROM, as_plain_promql, dashboard_exprs

#: Series Prometheus makes itself for every target.
SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
#: Labels Prometheus attaches to every series of a target.
TARGET_LABELS = {"job", "instance"}
#: Named by the alert rules ahead of the daemon: each must be absent today. When the daemon
#: starts exporting one, this test fails so the entry is removed and the name checked for real.
PENDING: dict[str, str] = {}
#: Counters that only gain a series when something fails that this test cannot make fail
#: (a record write on a healthy disk): checked by their declaration in /metrics only.
NO_SAMPLES_EXPECTED = {"kvswap_write_failures_total"}
#: Suffixes of the series a family of each type exposes.
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",), "untyped": ("",)}

N_BLOCKS = 6


def exposition(text: str) -> tuple[dict[str, list[dict[str, str]]], set[str]]:
    """(series name -> label sets of its samples, every series name a declared family allows)."""
    from kvswap.daemon.tools.status import parse_exposition

    samples: dict[str, list[dict[str, str]]] = {}
    for (name, pairs), _ in parse_exposition(text).items():
        samples.setdefault(name, []).append(dict(pairs))
    declared: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(maxsplit=3)
            base = family[: -len("_total")] if kind == "counter" and family.endswith("_total") else family
            declared |= {base + s for s in SUFFIXES.get(kind, ("",))}
    return samples, declared


def rule_exprs() -> tuple[list[tuple[str, str]], set[str]]:
    groups = yaml.safe_load((PROM / "kvswap-rules.yml").read_text())["groups"]
    rules = [r for g in groups for r in g["rules"]]
    return [(r.get("alert") or r["record"], r["expr"]) for r in rules], {r["record"] for r in rules if "record" in r}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, int]]:
    """A daemon that has seen every kind of traffic the dashboard charts: stores, loads,
    lookups, a corrupt record, error replies."""
    root = tmp_path_factory.mktemp("live")
    # No RAM tier: the corrupt record below must be loaded from disk.
    daemon = DaemonProcess(root / "store", free_port(), free_port(), extra_args=["--host-tier-bytes", "0"]).start()
    layout = CacheLayout("dash-model", num_layers=2, num_blocks=16, block_size=4, num_kv_heads=1, head_dim=8)
    keys = [f"d{i}" for i in range(N_BLOCKS)]
    try:
        with HostKVCache.create(layout) as cache, Client(daemon.endpoint, timeout=10) as c:
            cache.fill_random(seed=3)
            with pytest.raises(NotRegistered):
                c.swap_in(keys[:1], [0])
            c.register(cache)
            assert c.swap_out(list(range(N_BLOCKS)), keys, wait="persisted").stored == N_BLOCKS
            assert c.lookup([*keys, "absent"]) == N_BLOCKS
            assert c.swap_in(keys[:2], [8, 9]).loaded == 2
            # Corrupt the last record in place: the next load finds it bad, removes and counts it.
            corrupt = record_of(root / "store", keys[-1])
            corrupt.flip(corrupt.length // 2)
            assert c.swap_in(keys[-1:], [10]).status == ["corrupt"]
            with pytest.raises(InvalidKey):
                c.lookup(["bad key with spaces"])  # refused by the client: never sent
            # A peer without the client's checks sends one; the daemon refuses and counts it.
            peer = zmq.Context.instance().socket(zmq.DEALER)
            peer.setsockopt(zmq.LINGER, 0)
            peer.connect(daemon.endpoint)
            peer.send(msgpack.packb({"v": 1, "id": 1, "op": "lookup", "keys": ["bad key with spaces"]}))
            assert peer.poll(10_000)
            assert msgpack.unpackb(peer.recv())["error"]["code"] == "invalid_key"
            peer.close()
            yield daemon, N_BLOCKS
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_every_metric_the_dashboard_and_rules_name_is_exported(live: tuple[DaemonProcess, int]) -> None:
    daemon, _ = live
    status, text = daemon.http("/metrics")
    assert status == 200
    samples, declared = exposition(text)
    rules, recorded = rule_exprs()
    problems = []
    checked: set[str] = set()
    queries = [*(("dashboard: " + t, e) for t, e in dashboard_exprs()), *(("rule: " + n, e) for n, e in rules)]
    for where, expr in queries:
        refs = references(expr)
        assert refs.metrics, f"{where}: no metric found in {expr!r}"
        labels_seen = set(TARGET_LABELS) | {"le"}
        for name, matchers in refs.metrics.items():
            if name in SYNTHETIC or name in recorded or name in PENDING:
                continue
            checked.add(name)
            if name not in samples and name not in declared:
                problems.append(f"{where}: {name} is not exported")
                continue
            if name not in samples:
                if name not in NO_SAMPLES_EXPECTED:
                    problems.append(f"{where}: {name} is declared but has no series after the test traffic")
                continue
            have = set().union(*samples[name])
            labels_seen |= have
            for label in matchers - TARGET_LABELS - have:
                problems.append(f"{where}: {name} has no label {label!r} (it has {sorted(have)})")
        for label in refs.grouping - labels_seen - {"__name__"}:
            if not set(refs.metrics) & (recorded | NO_SAMPLES_EXPECTED):
                problems.append(f"{where}: groups by {label!r}, which none of its metrics has")
    assert problems == []
    # The check saw the families the dashboard is about, not an empty list.
    assert {"kvswap_bytes_total", "kvswap_request_duration_seconds_bucket", "kvswap_lookup_keys_total",
            "kvswap_stored_bytes", "kvswap_errors_total", "kvswap_corrupt_records_total"} <= checked


def test_the_traffic_shows_in_the_counters(live: tuple[DaemonProcess, int]) -> None:
    daemon, n = live
    assert daemon.metric("kvswap_blocks_total", op="swap_out", status="stored") == n
    assert daemon.metric("kvswap_blocks_total", op="swap_in", status="loaded") == 2
    assert daemon.metric("kvswap_blocks_total", op="swap_in", status="corrupt") == 1
    assert daemon.metric("kvswap_corrupt_records_total", tier="file") == 1
    assert daemon.metric("kvswap_lookup_keys_total", result="hit") == n
    assert daemon.metric("kvswap_errors_total", op="swap_in", code="not_registered") == 1
    # A key refused while decoding: counted once, whichever op label the daemon gives it.
    from kvswap.daemon.tools.status import parse_exposition

    series = parse_exposition(daemon.http("/metrics")[1])
    assert sum(v for (name, labels), v in series.items()
               if name == "kvswap_errors_total" and ("code", "invalid_key") in labels) == 1


# -- a real Prometheus ----------------------------------------------------------------------------


def prom_query(port: int, query: str) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:  # 400 for a query that does not parse: return its error
        return json.loads(err.read())


def prom_get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
            return resp.status, resp.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


@pytest.fixture
def prometheus(live: tuple[DaemonProcess, int], tmp_path: Path) -> Iterator[int]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip(f"prometheus not installed (Debian package prometheus; {INSTALLED_BY_TEST_SETUP})")
    daemon, _ = live
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(PROM / "kvswap-rules.yml")],
        "scrape_configs": [{"job_name": "kvswapd",
                            "static_configs": [{"targets": [f"127.0.0.1:{daemon.metrics_port}"]}]}],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=log)
    log.close()
    try:
        ready = wait_until(lambda: prom_get(port, "/-/ready")[0] == 200 or proc.poll() is not None, 60, 0.2)
        assert ready and proc.poll() is None, (tmp_path / "prometheus.log").read_text(errors="replace")[-3000:]
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_real_prometheus_scrapes_the_daemon_and_loads_the_rules(prometheus: int,
                                                                  live: tuple[DaemonProcess, int]) -> None:
    port, (daemon, n) = prometheus, live

    def result(query: str) -> list:
        body = prom_query(port, query)
        assert body["status"] == "success", body
        return body["data"]["result"]

    assert wait_until(lambda: bool(result("kvswap_build_info")), 60, 0.25), "no scrape of the daemon"
    [info] = result("kvswap_build_info")
    assert info["metric"]["version"] == __version__ and info["metric"]["job"] == "kvswapd"
    assert info["metric"]["instance"] == f"127.0.0.1:{daemon.metrics_port}" and info["value"][1] == "1"
    [up] = result('up{job="kvswapd"}')
    assert up["value"][1] == "1"
    [stored] = result('kvswap_blocks_total{op="swap_out", status="stored"}')
    assert float(stored["value"][1]) == n

    # The rules loaded and evaluate cleanly against real series.
    assert {g["name"] for g in _rule_groups(port)} == {"kvswap.recording", "kvswap.alerts"}
    assert wait_until(lambda: all(r.get("health") == "ok" for g in _rule_groups(port) for r in g["rules"]), 30, 0.25)
    assert wait_until(lambda: bool(result("kvswap:store_usage_ratio")), 60, 0.25)
    [usage] = result('kvswap:store_usage_ratio{tier="file"}')
    assert 0 < float(usage["value"][1]) < 1

    # Every dashboard query is valid PromQL to the real engine.
    for title, expr in dashboard_exprs():
        body = prom_query(port, as_plain_promql(expr))
        assert body["status"] == "success", (title, body)


def _rule_groups(port: int) -> list:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/rules", timeout=5) as resp:
        return json.loads(resp.read())["data"]["groups"]

