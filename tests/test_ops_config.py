"""What an operator sees when the configuration is wrong, and at start-up: one line naming the
value's source, exit 2 (exit 3 for a failed start-up); JSON under ``--log-format json``;
``--print-config`` that can be saved as a file; IPv6; the metrics bind address. Real
``kvswapd`` subprocesses, real sockets, real HTTP."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvswap.daemon.cli import main as kvswapd_command
from kvswap.daemon.tools.admin import main as kvswap_command
from kvswap.protocol import CacheLayout, Client, HostKVCache

from support import DaemonProcess, free_port, wait_until

KVSWAPD = [sys.executable, "-m", "kvswap.daemon"]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSWAP_") and k != "FILE_BACKEND_STORAGE_DIR"}
    return {**env, **extra}


def kvswapd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*KVSWAPD, *args], env=env or clean_env(), capture_output=True, text=True, timeout=60)


def ports() -> list[str]:
    return ["--cache-queue-port", str(free_port()), "--metrics-port", str(free_port())]


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


# -- exit 2: one line, naming the source ------------------------------------------------------------


BLOCK_REDIS = """
import sys
class _NoRedis:
    def find_spec(self, name, path=None, target=None):
        if name == "redis" or name.startswith("redis."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoRedis())
"""


def test_remote_url_without_the_redis_package_is_one_line_naming_the_package(tmp_path: Path) -> None:
    shim = tmp_path / "no-redis"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(BLOCK_REDIS)
    env = clean_env(PYTHONPATH=os.pathsep.join([str(shim), *filter(None, [os.environ.get("PYTHONPATH")])]))
    probe = subprocess.run([sys.executable, "-c", "import redis"], env=env, capture_output=True, text=True, timeout=30)
    assert probe.returncode != 0 and "No module named 'redis'" in probe.stderr  # the shim does block it

    r = kvswapd("--remote-url", "redis://127.0.0.1:6379/0", "--storage-dir", str(tmp_path / "s"), *ports(), env=env)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert "needs the redis package (pip install 'kvswap[remote]')" in lines[0]
    assert "valid remote URLs" not in lines[0]  # the URL was valid: no list of forms
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("text,message", [
    ("write_threads = 2.7\n", "write_threads = 2.7: expected an integer"),
    ('cache_queue_port = "55500"\n', "cache_queue_port = '55500': expected an integer"),
    ('promote_to_host = "no"\n', "promote_to_host = 'no': expected true or false"),
    ("fsync = 1\n", "fsync = 1: expected a string"),
    ("drain_timeout_s = \"5\"\n", "drain_timeout_s = '5': expected a number"),
])
def test_config_file_values_of_the_wrong_type_exit_2_naming_file_and_key(tmp_path: Path, text: str,
                                                                          message: str) -> None:
    cfg = tmp_path / "file.toml"
    cfg.write_text(text)
    r = CliRunner().invoke(kvswapd_command, ["--config", str(cfg), "--print-config"], env=clean_env())
    assert r.exit_code == 2, r.output
    assert f"{cfg}: {message}" in r.output and len(r.output.splitlines()) == 1, r.output


def test_config_file_values_of_the_right_type_are_taken(tmp_path: Path) -> None:
    cfg = tmp_path / "file.toml"
    cfg.write_text('write_threads = 3\ncache_queue_port = 55511\npromote_to_host = false\ndrain_timeout_s = 5\n'
                   'write_staging_bytes = "64MiB"\nread_staging_bytes = 8388608\n')
    r = CliRunner().invoke(kvswapd_command, ["--config", str(cfg), "--print-config"], env=clean_env())
    assert r.exit_code == 0, r.output
    assert "write_threads = 3  #" in r.output and "promote_to_host = false  #" in r.output
    assert "drain_timeout_s = 5.0  #" in r.output and f"write_staging_bytes = {64 << 20}  #" in r.output


def test_a_bad_environment_value_names_the_variable_not_the_flag() -> None:
    runner = CliRunner()
    r = runner.invoke(kvswapd_command, ["--print-config"], env=clean_env(KVSWAP_FSYNC="maybe"))
    assert r.exit_code == 2
    assert r.output.count("\n") == 1 and "KVSWAP_FSYNC=maybe: 'maybe' is not one of" in r.output, r.output
    assert "--fsync" not in r.output
    r = runner.invoke(kvswapd_command, ["--fsync", "maybe", "--print-config"], env=clean_env(KVSWAP_FSYNC="maybe"))
    assert r.exit_code == 2 and "'--fsync'" in r.output and "KVSWAP_FSYNC" not in r.output, r.output


def test_exit_2_errors_are_json_under_log_format_json(tmp_path: Path) -> None:
    r = kvswapd("--log-format", "json", "--fsync", "maybe")
    assert r.returncode == 2
    (line,) = r.stderr.splitlines()
    record = json.loads(line)
    assert record["level"] == "error" and record["exit_code"] == 2 and record["source"] == "--fsync"
    assert "'maybe' is not one of" in record["msg"]

    r = kvswapd("--print-config", env=clean_env(KVSWAP_LOG_FORMAT="json", KVSWAP_WRITE_THREADS="lots"))
    (line,) = r.stderr.splitlines()
    assert r.returncode == 2 and json.loads(line)["source"] == "KVSWAP_WRITE_THREADS"

    cfg = tmp_path / "k.toml"
    cfg.write_text('log_format = "json"\nwrite_threads = 2.7\n')
    r = kvswapd("--config", str(cfg))
    (line,) = r.stderr.splitlines()
    record = json.loads(line)
    assert r.returncode == 2 and record["msg"].endswith(f"{cfg}: write_threads = 2.7: expected an integer")
    assert record["source"] == f"{cfg}: write_threads"

    r = kvswapd("--fsync", "maybe")  # and plain text without it
    assert r.returncode == 2 and not r.stderr.startswith("{") and len(r.stderr.splitlines()) == 1


def test_one_port_for_both_endpoints_is_refused_at_config_time(tmp_path: Path) -> None:
    port = str(free_port())
    r = kvswapd("--cache-queue-port", port, "--metrics-port", port, "--storage-dir", str(tmp_path / "s"))
    assert r.returncode == 2
    (line,) = r.stderr.splitlines()
    assert f"cache_queue_port and metrics_port are both {port}" in line and "already in use" not in line
    assert "command line (--cache-queue-port)" in line and "command line (--metrics-port)" in line
    assert not (tmp_path / "s").exists()
    # Port 0 for both is fine: each gets its own free port.
    assert CliRunner().invoke(kvswapd_command, ["--cache-queue-port", "0", "--metrics-port", "0", "--print-config"],
                              env=clean_env()).exit_code == 0


@pytest.mark.parametrize("host,reason", [
    ("not-a-host", "is not an IP address or a host name that resolves"),
    ("[::1]", "needs no brackets"),
    ("", "is empty"),
])
def test_a_host_that_cannot_be_bound_is_one_clear_line(host: str, reason: str) -> None:
    r = CliRunner().invoke(kvswapd_command, ["--host", host, "--print-config"], env=clean_env())
    assert r.exit_code == 2 and reason in r.output and len(r.output.splitlines()) == 1, r.output
    assert "No such device" not in r.output
    r = CliRunner().invoke(kvswapd_command, ["--metrics-host", host or "nowhere.invalid", "--print-config"],
                           env=clean_env())
    assert r.exit_code == 2 and "metrics_host" in r.output, r.output


def test_unknown_kvswap_variables_are_warned_about_known_ones_are_not(tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    env = clean_env(KVSWAP_FSNYC="data", KVSWAP_ENDPOINTS="tcp://127.0.0.1:1", KVSWAP_METRICS_URLS="http://x",
                    KVSWAP_GPU_BACKEND="auto", KVSWAP_CACHE_QUEUE_PORT=str(port))
    proc = subprocess.Popen([*KVSWAPD, "--metrics-port", str(metrics_port), "--storage-dir", str(tmp_path / "s")],
                            env=env, stderr=subprocess.PIPE, text=True)
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=5) as c:
            c.wait_ready(30)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    warnings = [line for line in err.splitlines() if "unknown environment variable" in line]
    assert len(warnings) == 1 and "KVSWAP_FSNYC ignored (did you mean KVSWAP_FSYNC?)" in warnings[0], err
    assert " WARNING " in warnings[0]


# -- start-up failures: exactly one line ------------------------------------------------------------


def test_a_failed_start_up_prints_exactly_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        text = kvswapd("--cache-queue-port", port, "--metrics-port", str(free_port()), "--storage-dir",
                       str(tmp_path / "s"))
        as_json = kvswapd("--log-format", "json", "--cache-queue-port", str(free_port()), "--metrics-port", port,
                          "--storage-dir", str(tmp_path / "s"))
    assert text.returncode == 3
    (line,) = text.stderr.splitlines()  # no "direct I/O", no "kvswapd stopped" around it
    assert " ERROR kvswap.daemon: start-up failed: cannot bind the cache-queue port" in line and "already in use" in line
    assert as_json.returncode == 3
    (line,) = as_json.stderr.splitlines()
    record = json.loads(line)
    assert record["exit_code"] == 3 and "cannot bind the metrics port" in record["msg"]

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = kvswapd("--storage-dir", str(blocker / "store"), *ports())
    assert r.returncode == 3
    (line,) = r.stderr.splitlines()
    assert "storage directory" in line and "cannot be used" in line


# -- --print-config ---------------------------------------------------------------------------------


def test_print_config_masks_url_passwords_and_does_not_pin_the_default_storage_dir(tmp_path: Path) -> None:
    tomllib = pytest.importorskip("tomllib")
    r = kvswapd("--remote-url", "redis://app:s3cr%40t@10.0.0.9:6380/2?timeout=0.5", "--print-config",
                env=clean_env(FILE_BACKEND_STORAGE_DIR=str(tmp_path / "fd")))
    assert r.returncode == 0, r.stderr
    assert "s3cr" not in r.stdout
    saved = tomllib.loads(r.stdout)
    assert saved["remote_url"] == "redis://***@10.0.0.9:6380/2?timeout=0.5"  # the rest of the URL is kept
    assert "storage_dir" not in saved and f'# storage_dir = "{tmp_path / "fd"}"' in r.stdout
    # Saved and used as a config file, the directory still follows FILE_BACKEND_STORAGE_DIR.
    cfg = tmp_path / "saved.toml"
    cfg.write_text("\n".join(line for line in r.stdout.splitlines() if not line.startswith("remote_url")))
    again = kvswapd("--config", str(cfg), "--print-config", env=clean_env(FILE_BACKEND_STORAGE_DIR=str(tmp_path / "b")))
    assert again.returncode == 0, again.stderr
    assert f'# storage_dir = "{tmp_path / "b"}"  # environment (FILE_BACKEND_STORAGE_DIR)' in again.stdout
    # A storage_dir given explicitly is a setting like any other, and is printed as one.
    r = kvswapd("--storage-dir", str(tmp_path / "mine"), "--print-config")
    assert tomllib.loads(r.stdout)["storage_dir"] == str(tmp_path / "mine")


# -- IPv6 and the metrics bind address --------------------------------------------------------------


def http_status(url: str) -> int | str:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except (urllib.error.URLError, OSError) as err:
        return type(getattr(err, "reason", err)).__name__


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_ipv6_host_serves_and_kvswap_status_reaches_it(tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    proc = subprocess.Popen([*KVSWAPD, "--host", "::1", "--cache-queue-port", str(port), "--metrics-port",
                             str(metrics_port), "--storage-dir", str(tmp_path / "s")], env=clean_env(),
                            stderr=subprocess.PIPE, text=True)
    try:
        with Client(f"tcp://[::1]:{port}", timeout=5) as c:
            c.wait_ready(30)
        assert http_status(f"http://[::1]:{metrics_port}/readyz") == 200
        r = CliRunner().invoke(kvswap_command, ["status", f"tcp://[::1]:{port}", "--interval", "0", "--json"])
        assert r.exit_code == 0, r.output
        report = json.loads(r.stdout)
        assert report["endpoint"] == f"tcp://[::1]:{port}" and report["storage_dir"] == str(tmp_path / "s")
        assert report["metrics_url"] == f"http://[::1]:{metrics_port}/metrics"  # found from stats
        r = CliRunner().invoke(kvswap_command, ["status", f"[::1]:{port}", "--interval", "0", "--json"])
        assert r.exit_code == 0 and json.loads(r.stdout)["endpoint"] == f"tcp://[::1]:{port}", r.output
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert f"serving tcp://[::1]:{port}, metrics http://[::1]:{metrics_port}/metrics" in err


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_metrics_host_binds_the_metrics_endpoint_apart_from_the_control_socket(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "s", free_port(), free_port(), extra_args=["--metrics-host", "::1"]).start()
    try:
        assert http_status(f"http://[::1]:{d.metrics_port}/readyz") == 200
        assert http_status(f"http://127.0.0.1:{d.metrics_port}/readyz") == "ConnectionRefusedError"
        with Client(d.endpoint, timeout=5) as c:  # the control socket stays on 127.0.0.1
            stats = c.stats()
        assert stats["metrics_host"] == "::1" and stats["metrics_port"] == d.metrics_port
    finally:
        assert d.stop() == 0, d.log()


# -- metrics and the engine's normal exit -----------------------------------------------------------


def test_process_metrics_are_served(daemon: DaemonProcess) -> None:
    assert daemon.metric("process_resident_memory_bytes") > 10 * 2**20
    assert daemon.metric("process_open_fds") >= 3
    assert daemon.metric("process_max_fds") >= daemon.metric("process_open_fds")
    assert daemon.metric("process_cpu_seconds_total") > 0


ENGINE = r"""
import sys
from kvswap.protocol import CacheLayout, Client, HostKVCache
layout = CacheLayout("exit-test", num_layers=2, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=8)
with HostKVCache.create(layout) as cache, Client(sys.argv[1], timeout=10) as kv:
    if sys.argv[2] == "with":
        with kv.registered(cache) as reply:
            assert reply["record_bytes"] == layout.record_bytes
            kv.swap_out([0, 1], ["a0", "a1"], wait="persisted")
    else:
        kv.register(cache)
        kv.swap_out([0, 1], ["a0", "a1"], wait="persisted")
"""


def test_an_engine_using_registered_exits_as_info_one_that_does_not_warns(daemon: DaemonProcess) -> None:
    def engine(mode: str) -> None:
        r = subprocess.run([sys.executable, "-c", ENGINE, daemon.endpoint, mode], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr

    engine("with")
    assert daemon.metric("kvswap_registrations_total", event="unregistered") == 1
    assert daemon.metric("kvswap_registered") == 0
    engine("without")  # the control: registered when its process ends
    assert wait_until(lambda: daemon.metric("kvswap_registrations_total", event="engine_exited") == 1, 20)
    log = daemon.log().splitlines()
    released = [line for line in log if "released registration" in line]
    assert len(released) == 2 and " INFO " in released[0] and released[0].endswith(": unregistered")
    gone = [line for line in log if "is gone" in line]
    assert len(gone) == 1 and " WARNING " in gone[0]  # only the engine that did not unregister


async def _async_registered(endpoint: str, layout: CacheLayout) -> dict:
    from kvswap.protocol import AsyncClient

    with HostKVCache.create(layout) as cache:
        async with AsyncClient(endpoint, timeout=10) as kv:
            async with kv.registered(cache):
                inside = await kv.stats()
            after = await kv.stats()
    return {"inside": inside["registered"], "after": after["registered"]}


def test_async_registered_unregisters_at_the_end(daemon: DaemonProcess, layout: CacheLayout) -> None:
    import asyncio

    seen = asyncio.run(_async_registered(daemon.endpoint, layout))
    assert seen == {"inside": True, "after": False}


# -- --help -----------------------------------------------------------------------------------------


def _commands() -> list[tuple[str, click.Command]]:
    out: list[tuple[str, click.Command]] = [("kvswapd", kvswapd_command)]
    out += [(f"kvswap {name}", cmd) for name, cmd in sorted(kvswap_command.commands.items())]
    return out


@pytest.mark.parametrize("name,command", _commands(), ids=[n for n, _ in _commands()])
def test_every_option_has_help_and_one_default(name: str, command: click.Command) -> None:
    ctx = click.Context(command, info_name=name, **command.context_settings)
    options = [p for p in command.params if isinstance(p, click.Option) and p.name not in ("help", "version")]
    assert options
    for option in options:
        assert option.help, f"{name} {option.opts[0]} has no help text"
        record = option.get_help_record(ctx)
        assert record is not None and record[1].count("[default:") <= 1, f"{name} {option.opts[0]}: {record}"
