"""The operator tools where a first afternoon went wrong: ``kvswap status`` (metrics found from
stats, HOST:PORT, a report even when /metrics fails, the CURVE hint), ``kvswap launch`` (the
storage directory from the environment, a missing server command, a failed daemon's log, a
server that ignores SIGINT) and ``kvswap gc`` (dry run, skipped namespaces, ``--max-bytes 0``).
Real daemons, real processes, real directories."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from kvswap.backends.file_backend import FileBackend
from kvswap.daemon.tools.admin import main as kvswap
from kvswap.daemon.tools.keygen import write_keypair

from support import DaemonProcess, free_port, wait_until

ADMIN = [sys.executable, "-m", "kvswap.daemon.tools.admin"]


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([*ADMIN, *args], capture_output=True, text=True, timeout=timeout, env=env)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSWAP_") and k != "FILE_BACKEND_STORAGE_DIR"}
    return {**env, **extra}


# -- kvswap status ----------------------------------------------------------------------------------


def test_status_takes_host_port_or_port_for_the_metrics(daemon: DaemonProcess) -> None:
    for given in (f"127.0.0.1:{daemon.metrics_port}", str(daemon.metrics_port), daemon.metrics_url):
        r = run("status", str(daemon.port), "--interval", "0.1", "--json", "--metrics-url", given)
        assert r.returncode == 0, r.stderr
        report = json.loads(r.stdout)
        assert report["metrics_url"] == f"{daemon.metrics_url}/metrics", given
        assert report["rates"]["source"] == "stats+metrics" and report["metrics_error"] is None


def test_status_prints_the_report_when_metrics_fail(daemon: DaemonProcess) -> None:
    dead = free_port()
    r = run("status", str(daemon.port), "--interval", "0.1", "--metrics-url", f"127.0.0.1:{dead}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"kvswapd 0.1.0  {daemon.endpoint}") and "Registration  none" in r.stdout
    assert f"Metrics       http://127.0.0.1:{dead}/metrics: " in r.stdout and "(rates from stats only)" in r.stdout
    assert r.stderr.startswith(f"kvswap status: http://127.0.0.1:{dead}/metrics: ")
    r = run("status", str(daemon.port), "--interval", "0.1", "--json", "--metrics-url", f"127.0.0.1:{dead}")
    report = json.loads(r.stdout)
    assert report["metrics_error"] and report["rates"]["source"] == "stats" and report["storage_dir"]


def test_status_hints_at_curve_when_the_daemon_demands_it(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    for name in ("kvswapd", "operator"):
        write_keypair(str(keys), name)
    authorized = tmp_path / "authorized"
    authorized.mkdir(mode=0o700)
    (authorized / "operator.key").write_bytes((keys / "operator.key").read_bytes())
    client = {"curve_secret_key_file": str(keys / "operator.key_secret"),
              "curve_server_key_file": str(keys / "kvswapd.key")}
    d = DaemonProcess(tmp_path / "store", free_port(), free_port(), client_options=client,
                      extra_args=["--curve-secret-key-file", str(keys / "kvswapd.key_secret"),
                                  "--authorized-keys", str(authorized)]).start()
    try:
        r = run("status", str(d.port), "--interval", "0", "--timeout", "1")
        assert r.returncode == 1
        assert "the daemon demands CURVE: pass --curve-server-key-file" in r.stderr, r.stderr
        ok = run("status", str(d.port), "--interval", "0", "--curve-server-key-file", str(keys / "kvswapd.key"),
                 "--curve-secret-key-file", str(keys / "operator.key_secret"))
        assert ok.returncode == 0 and ok.stdout.startswith("kvswapd "), ok.stderr
    finally:
        assert d.stop() == 0, d.log()
    nobody = run("status", str(free_port()), "--interval", "0", "--timeout", "1")
    assert nobody.returncode == 1 and "nothing accepts connections there" in nobody.stderr
    assert "CURVE" not in nobody.stderr


# -- kvswap launch ----------------------------------------------------------------------------------


#: A stand-in server: writes what the daemon's stats say to argv[1], then exits 0 (or, with
#: argv[3] == "deaf", ignores SIGINT and SIGTERM and waits to be killed).
SERVER = r"""
import json, os, signal, sys, time
from kvswap.protocol import Client
endpoint = os.environ["KVSWAP_ENDPOINTS"].split(",")[0]
with Client(endpoint, timeout=10) as c:
    stats = c.stats()
if sys.argv[2] == "deaf":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
tmp = sys.argv[1] + ".tmp"
json.dump({"storage_dir": stats["storage_dir"], "pid": os.getpid()}, open(tmp, "w"))
os.replace(tmp, sys.argv[1])
while sys.argv[2] == "deaf":
    time.sleep(1)
"""


def launch_argv(tmp: Path, *extra: str, server: list[str] | None = None, mode: str = "exit") -> list[str]:
    return [*ADMIN, "launch", "--gpus", "0", "--base-cache-queue-port", str(free_port()), "--base-metrics-port",
            str(free_port()), "--ready-timeout-s", "60", "--daemon-arg=--drain-timeout-s=5", *extra, "--",
            *(server or [sys.executable, "-c", SERVER, str(tmp / "seen.json"), mode])]


def test_launch_takes_the_storage_dir_from_the_environment(tmp_path: Path) -> None:
    fastdeploy, own = tmp_path / "fastdeploy-store", tmp_path / "kvswap-store"
    r = subprocess.run(launch_argv(tmp_path), env=clean_env(FILE_BACKEND_STORAGE_DIR=str(fastdeploy)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "seen.json").read_text())["storage_dir"] == str(fastdeploy)
    r = subprocess.run(launch_argv(tmp_path), env=clean_env(FILE_BACKEND_STORAGE_DIR=str(fastdeploy),
                                                             KVSWAP_STORAGE_DIR=str(own)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "seen.json").read_text())["storage_dir"] == str(own)  # the flag's variable wins


def test_launch_checks_the_server_command_before_starting_daemons(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    for command, code, reason in (([str(tmp_path / "no-such-server")], 127, "not found"),
                                  (["no-such-server-on-path-kvswap"], 127, "not found"),
                                  ([str(tmp_path)], 126, "not executable")):
        r = subprocess.run(launch_argv(tmp_path, "--pid-dir", str(pids), server=command), env=clean_env(),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == code, r.stderr
        assert f"cannot start the server {command[0]}: {reason}" in r.stderr
        assert "started kvswapd" not in r.stderr and list(pids.iterdir()) == []


def test_launch_shows_the_log_of_a_daemon_that_failed(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    r = subprocess.run(launch_argv(tmp_path, "--log-dir", str(logs), "--daemon-arg=--fsync=maybe"), env=clean_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stderr
    assert f"last lines of {logs / 'kvswapd-0.log'}:" in r.stderr
    assert "  | " in r.stderr and "bad configuration: Invalid value for '--fsync'" in r.stderr
    assert not (tmp_path / "seen.json").exists()


def test_launch_escalates_when_the_server_ignores_sigint(tmp_path: Path) -> None:
    proc = subprocess.Popen(launch_argv(tmp_path, "--grace-s", "1", mode="deaf"), env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until((tmp_path / "seen.json").exists, 90), "the server never started"
        server_pid = json.loads((tmp_path / "seen.json").read_text())["pid"]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGKILL, err  # the server's own end: killed
    lines = err.splitlines()
    forwarded = next(i for i, line in enumerate(lines) if "SIGINT: forwarding it to the server" in line)
    term = next(i for i, line in enumerate(lines) if "sending it SIGTERM" in line)
    kill = next(i for i, line in enumerate(lines) if "sending it SIGKILL" in line)
    assert forwarded < term < kill
    assert not os.path.exists(f"/proc/{server_pid}") or "Z" in open(f"/proc/{server_pid}/stat").read().split()[2]


# -- kvswap gc --------------------------------------------------------------------------------------


def _store(root: Path, namespace: str, n: int) -> list[str]:
    store = FileBackend(str(root), layout="files").open_store(namespace, {"model_id": "m"}, 1024)  # a file per record
    paths = []
    for i in range(n):
        store.put(f"k-{i}", memoryview(bytes([i]) * 1024))
        path = store.path_of(f"k-{i}")[1]
        os.utime(path, (1000 + i, 1000 + i))
        paths.append(path)
    return paths


def test_gc_dry_run_deletes_nothing_and_says_what_would_go(tmp_path: Path) -> None:
    paths = _store(tmp_path, "aa" * 16, 6)
    size = os.path.getsize(paths[0])
    r = CliRunner().invoke(kvswap, ["gc", str(tmp_path), "--max-bytes", str(2 * size), "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    assert report["dry_run"] is True and report["removed"] == 4 and report["after_bytes"] == 2 * size
    assert all(os.path.exists(p) for p in paths)
    text = CliRunner().invoke(kvswap, ["gc", str(tmp_path), "--max-bytes", str(2 * size), "--dry-run"])
    assert "would remove 4 records (0.0 MiB) (dry run: nothing was deleted)" in text.output
    real = CliRunner().invoke(kvswap, ["gc", str(tmp_path), "--max-bytes", str(2 * size)])
    assert real.exit_code == 0 and "removed 4 records" in real.output
    assert [os.path.exists(p) for p in paths] == [False] * 4 + [True] * 2


def test_gc_exits_1_when_a_namespace_was_skipped(tmp_path: Path) -> None:
    _store(tmp_path, "aa" * 16, 3)
    held = os.open(tmp_path / ("aa" * 16) / "evict.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a running daemon evicts for it
    try:
        r = CliRunner().invoke(kvswap, ["gc", str(tmp_path), "--max-bytes", "1024"])
    finally:
        os.close(held)
    assert r.exit_code == 1 and "skipped namespace" in r.output


def test_gc_refuses_max_bytes_0_without_all(tmp_path: Path) -> None:
    paths = _store(tmp_path, "aa" * 16, 3)
    r = CliRunner().invoke(kvswap, ["gc", str(tmp_path), "--max-bytes", "0"])
    assert r.exit_code == 2 and "add --all" in r.output
    assert all(os.path.exists(p) for p in paths)
    r = CliRunner().invoke(kvswap, ["gc", str(tmp_path), "--max-bytes", "0", "--all"])
    assert r.exit_code == 0 and "removed 3 records" in r.output
    assert not any(os.path.exists(p) for p in paths)
