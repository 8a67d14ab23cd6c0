"""deploy/: the systemd unit (systemd-analyze verify), the Kubernetes example, the Prometheus
configuration and rules (promtool check and promtool's rule unit tests) and the Grafana
dashboard's PromQL (parsed by promtool). Tools that are absent skip their test with the
reason; scripts/test.sh installs promtool."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvswap.daemon.cli import main as kvswapd_command
from kvswap.daemon.config import Config

from support import INSTALLED_BY_TEST_SETUP

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
UNIT = DEPLOY / "systemd" / "kvswapd@.service"
ENV_EXAMPLE = DEPLOY / "systemd" / "kvswapd.env.example"
K8S = DEPLOY / "kubernetes" / "api-server-with-kvswapd.yaml"
PROM = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "kvswap.json"

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason=f"promtool not installed (Debian package prometheus; {INSTALLED_BY_TEST_SETUP})")


def kvswapd_env_vars() -> set[str]:
    """KVSWAP_<FLAG> for every kvswapd flag: the variables the daemon reads."""
    return {f"KVSWAP_{p.name.upper()}" for p in kvswapd_command.params if p.name}


def unit_settings(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


# -- systemd --------------------------------------------------------------------------------------


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip(f"systemd-analyze not installed (Debian package systemd; {INSTALLED_BY_TEST_SETUP})")
    # verify checks that ExecStart exists: point it at this checkout's kvswapd.
    kvswapd = shutil.which("kvswapd") or str(Path(sys.executable).resolve())
    text = UNIT.read_text().replace("ExecStart=/usr/local/bin/kvswapd", f"ExecStart={kvswapd}")
    assert f"ExecStart={kvswapd}" in text
    (tmp_path / "kvswapd@.service").write_text(text)
    r = subprocess.run([analyze, "verify", str(tmp_path / "kvswapd@0.service")], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    complaints = [line for line in (r.stdout + r.stderr).splitlines() if "kvswapd@" in line]
    assert r.returncode == 0 and complaints == [], r.stdout + r.stderr


def test_unit_is_hardened_restarts_and_outlasts_the_drain() -> None:
    s = unit_settings(UNIT.read_text())
    expected = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes", "ProtectHome": "yes",
                "Restart": "on-failure", "KillSignal": "SIGTERM", "RestartPreventExitStatus": "2",
                "EnvironmentFile": "/etc/kvswap/kvswapd-%i.env", "CapabilityBoundingSet": ""}
    assert {k: s.get(k, [None])[0] for k in expected} == expected
    assert s["ReadWritePaths"] == ["/var/lib/kvswap"]
    assert set(s["RestrictAddressFamilies"][0].split()) >= {"AF_UNIX", "AF_INET", "AF_INET6"}
    assert "CUDA_VISIBLE_DEVICES=%i" in s["Environment"]
    # systemd's SIGKILL must not cut the daemon's own drain short.
    assert int(s["TimeoutStopSec"][0]) > Config.drain_timeout_s
    # PrivateDevices would hide /dev/nvidia*, RemoveIPC the engine's shared memory.
    assert "PrivateDevices" not in s and "RemoveIPC" not in s


def test_env_files_name_only_real_settings() -> None:
    known = kvswapd_env_vars()
    used = set(re.findall(r"^#?(KVSWAP_[A-Z_]+)=", ENV_EXAMPLE.read_text(), re.M))
    used |= set(re.findall(r"^Environment=(KVSWAP_[A-Z_]+)=", UNIT.read_text(), re.M))
    assert {"KVSWAP_CACHE_QUEUE_PORT", "KVSWAP_METRICS_PORT", "KVSWAP_CONFIG"} <= used
    assert used - known == set()


# -- Kubernetes -----------------------------------------------------------------------------------


def test_kubernetes_sidecar_probes_ports_and_store_agree() -> None:
    docs = {d["kind"]: d for d in yaml.safe_load_all(K8S.read_text())}
    pod = docs["Deployment"]["spec"]["template"]
    spec = pod["spec"]
    sidecar = next(c for c in spec["initContainers"] if c["name"] == "kvswapd")
    server = next(c for c in spec["containers"] if c["name"] == "api-server")
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    assert set(env) - kvswapd_env_vars() == set()

    assert sidecar["restartPolicy"] == "Always"  # a native sidecar: up before the server, down after it
    metrics = next(p for p in sidecar["ports"] if p["containerPort"] == int(env["KVSWAP_METRICS_PORT"]))
    for probe, path in (("startupProbe", "/readyz"), ("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        assert sidecar[probe]["httpGet"] == {"path": path, "port": metrics["name"]}, probe
    notes = pod["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
    assert notes["prometheus.io/port"] == env["KVSWAP_METRICS_PORT"]

    args = server["args"]
    assert args[args.index("--cache-queue-port") + 1] == env["KVSWAP_CACHE_QUEUE_PORT"]
    mounts = {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}
    store = next(v for v in spec["volumes"] if mounts.get(v["name"]) == env["KVSWAP_STORAGE_DIR"])
    assert "emptyDir" in store or "persistentVolumeClaim" in store
    assert mounts["dshm"] == "/dev/shm" and {"name": "dshm", "mountPath": "/dev/shm"} in server["volumeMounts"]
    assert spec["shareProcessNamespace"] is True
    assert spec["terminationGracePeriodSeconds"] > Config.drain_timeout_s
    assert sidecar["securityContext"]["allowPrivilegeEscalation"] is False

    # From outside the pod: the metrics port, never the control socket.
    allowed = {p["port"] for rule in docs["NetworkPolicy"]["spec"]["ingress"] for p in rule["ports"]}
    assert int(env["KVSWAP_METRICS_PORT"]) in allowed and int(env["KVSWAP_CACHE_QUEUE_PORT"]) not in allowed


# -- Prometheus -----------------------------------------------------------------------------------


@needs_promtool
def test_promtool_checks_config_and_rules() -> None:
    r = subprocess.run(["promtool", "check", "config", str(PROM / "prometheus.yml")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "SUCCESS: 1 rule files found" in r.stdout + r.stderr, r.stdout + r.stderr
    r = subprocess.run(["promtool", "check", "rules", str(PROM / "kvswap-rules.yml")], capture_output=True, text=True,
                       timeout=60)
    rules = sum(len(g["rules"]) for g in yaml.safe_load((PROM / "kvswap-rules.yml").read_text())["groups"])
    assert r.returncode == 0 and f"SUCCESS: {rules} rules found" in r.stdout + r.stderr, r.stdout + r.stderr


@needs_promtool
def test_promtool_unit_tests_of_the_alerts_pass() -> None:
    r = subprocess.run(["promtool", "test", "rules", "kvswap-rules.test.yml"], cwd=PROM, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_alerts_cover_what_an_operator_needs() -> None:
    alerts = {r["alert"]: r for g in yaml.safe_load((PROM / "kvswap-rules.yml").read_text())["groups"]
              for r in g["rules"] if "alert" in r}
    assert set(alerts) >= {"KvswapDaemonDown", "KvswapStoreNearCapacity", "KvswapCorruptRecords",
                           "KvswapHighErrorRate", "KvswapHighBusyRate", "KvswapRemoteTierUnhealthy"}
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


# -- Grafana --------------------------------------------------------------------------------------


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def as_plain_promql(expr: str) -> str:
    """Grafana's variables replaced by what they stand for, so promtool can parse it."""
    return expr.replace("$__rate_interval", "1m").replace("$__range", "1h").replace('"$instance"', '".*"')


def test_dashboard_panels_are_well_formed_and_cover_the_topics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
        assert g["x"] + g["w"] <= 24
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
    exprs = " ".join(e for _, e in dashboard_exprs())
    for needle in ("kvswap_bytes_total", "histogram_quantile(0.5,", "histogram_quantile(0.99,",
                   'kvswap_lookup_keys_total{job="kvswapd", instance=~"$instance", result="hit"}',
                   "kvswap_stored_bytes", "kvswap_errors_total", "kvswap_corrupt_records_total"):
        assert needle in exprs, needle
    assert all('job="kvswapd"' in e for _, e in dashboard_exprs())
    names = [v["name"] for v in dash["templating"]["list"]]
    assert names == ["datasource", "instance"]


@needs_promtool
def test_dashboard_queries_parse_as_promql(tmp_path: Path) -> None:
    exprs = dashboard_exprs()
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": as_plain_promql(e)} for i, (_, e) in enumerate(exprs)]}]}
    (tmp_path / "dashboard-rules.yml").write_text(yaml.safe_dump(rules))
    r = subprocess.run(["promtool", "check", "rules", str(tmp_path / "dashboard-rules.yml")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and f"SUCCESS: {len(exprs)} rules found" in r.stdout + r.stderr, r.stdout + r.stderr


def test_worked_examples_in_docstrings_hold() -> None:
    import doctest

    import promql
    from kvswap.daemon.tools import launcher, status

    for module in (promql, launcher, status):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__
