"""``kvswapd --config``, ``--print-config`` and ``--log-format``, through the real entry point
(``python -m kvswap.daemon``) in a subprocess."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvswap.daemon.cli import main as kvswapd_command
from kvswap.protocol import Client

from support import free_port


KVSWAPD = [sys.executable, "-m", "kvswap.daemon"]


def kvswapd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVSWAP_") and k != "FILE_BACKEND_STORAGE_DIR"}
    return subprocess.run([*KVSWAPD, *args], env={**clean, **(env or {})}, capture_output=True, text=True, timeout=30)


def sources(output: str) -> dict[str, str]:
    """setting -> the source comment --print-config wrote after it."""
    out = {}
    for line in output.splitlines():
        match = re.match(r"^#?\s*([a-z_]+) = .*  # (.+)$", line)
        if match:
            out[match.group(1)] = match.group(2)
    return out


def test_precedence_is_flag_then_env_then_file_then_default(tmp_path: Path) -> None:
    cfg = tmp_path / "kvswap.toml"
    cfg.write_text('cache_queue_port = 1111\nmetrics-port = 2222\nfsync = "data"\nwrite_threads = 7\n'
                   'write_staging_bytes = "64MiB"\n')
    r = kvswapd("--config", str(cfg), "--fsync", "none", "--print-config",
                env={"KVSWAP_METRICS_PORT": "3333", "KVSWAP_FSYNC": "strict"})
    assert r.returncode == 0, r.stderr
    effective = tomllib.loads(r.stdout)  # the output is itself a usable config file
    src = sources(r.stdout)
    assert (effective["fsync"], src["fsync"]) == ("none", "command line (--fsync)")  # flag beats env and file
    assert (effective["metrics_port"], src["metrics_port"]) == (3333, "environment (KVSWAP_METRICS_PORT)")
    assert (effective["cache_queue_port"], src["cache_queue_port"]) == (1111, f"config file ({cfg})")
    assert (effective["write_threads"], src["write_threads"]) == (7, f"config file ({cfg})")
    assert effective["write_staging_bytes"] == 64 * 2**20
    assert (effective["read_threads"], src["read_threads"]) == (4, "default")
    assert effective["log_format"] == "text"


def test_print_config_names_the_storage_dir_variable_fastdeploy_sets(tmp_path: Path) -> None:
    r = kvswapd("--print-config", env={"FILE_BACKEND_STORAGE_DIR": str(tmp_path / "fd")})
    assert r.returncode == 0, r.stderr
    # Shown, but commented out: saved as a config file it must not pin the directory.
    assert f'# storage_dir = "{tmp_path / "fd"}"  # environment (FILE_BACKEND_STORAGE_DIR)\n' in r.stdout
    assert "storage_dir" not in tomllib.loads(r.stdout)
    assert sources(r.stdout)["storage_dir"] == "environment (FILE_BACKEND_STORAGE_DIR)"


def test_config_file_from_the_environment(tmp_path: Path) -> None:
    cfg = tmp_path / "k.toml"
    cfg.write_text("read_threads = 9\n")
    r = kvswapd("--print-config", env={"KVSWAP_CONFIG": str(cfg)})
    assert r.returncode == 0, r.stderr
    assert tomllib.loads(r.stdout)["read_threads"] == 9
    assert sources(r.stdout)["read_threads"] == f"config file ({cfg})"


def test_unknown_key_fails_start_up_with_its_name(tmp_path: Path) -> None:
    cfg = tmp_path / "typo.toml"
    cfg.write_text("cache_port = 55500\nfsync = \"data\"\n")
    r = kvswapd("--config", str(cfg), "--storage-dir", str(tmp_path / "s"))
    assert r.returncode == 2
    assert f"{cfg}: unknown setting 'cache_port' (did you mean 'cache_queue_port'?)" in r.stderr
    assert not (tmp_path / "s").exists()  # nothing started


def test_bad_files_and_values_fail_with_exit_2_naming_the_file(tmp_path: Path) -> None:
    cases = {
        "broken.toml": ("write_threads = [\n", "is not valid TOML"),
        "table.toml": ("[daemon]\nhost = \"::1\"\n", "unknown setting 'daemon'"),
        "value.toml": ("write_threads = \"many\"\n", "write_threads = 'many'"),
        "bool.toml": ("write_threads = true\n", "write_threads = true is not a valid value"),
        "range.toml": ("cache_queue_port = 70000\n", "cache_queue_port = 70000"),
        "twice.toml": ("read_threads = 2\nread-threads = 3\n", "'read_threads' is set twice"),
    }
    runner = CliRunner()  # in-process: the same click command, without 7 interpreter starts
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        r = runner.invoke(kvswapd_command, ["--config", str(tmp_path / name), "--print-config"])
        assert r.exit_code == 2, (name, r.output)
        assert message in r.output and name in r.output, (name, r.output)  # output: stdout and stderr
    r = runner.invoke(kvswapd_command, ["--config", str(tmp_path / "missing.toml"), "--print-config"])
    assert r.exit_code == 2 and "cannot read" in r.output


def test_print_config_lists_every_flag_and_starts_nothing(tmp_path: Path) -> None:
    port = free_port()
    r = kvswapd("--cache-queue-port", str(port), "--storage-dir", str(tmp_path / "s"), "--print-config")
    assert r.returncode == 0 and r.stderr == ""
    effective = tomllib.loads(r.stdout)
    assert effective["cache_queue_port"] == port and effective["storage_dir"] == str(tmp_path / "s")
    assert not (tmp_path / "s").exists()
    # Every line is a setting or a comment; every kvswapd flag but the two about the config appears.
    help_text = kvswapd("--help").stdout
    flags = {f[2:].replace("-", "_") for f in re.findall(r"^\s+(--[a-z][a-z0-9-]+)", help_text, re.M)}
    assert flags - {"config", "print_config", "version", "help"} <= set(sources(r.stdout))


def test_a_daemon_runs_on_the_settings_of_its_file(tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    store = tmp_path / "from-file"
    cfg = tmp_path / "kvswap.toml"
    cfg.write_text(f'cache_queue_port = {port}\nmetrics_port = {metrics_port}\nstorage_dir = "{store}"\n'
                   'fsync = "data"\nlog_format = "json"\n')
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVSWAP_")}
    proc = subprocess.Popen([*KVSWAPD, "--config", str(cfg)], env=clean, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=5) as c:
            c.wait_ready(20)
            stats = c.stats()
        assert stats["storage_dir"].endswith("from-file") and stats["fsync"] == "data"
        assert store.is_dir()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    records = [json.loads(line) for line in err.splitlines() if line.strip()]
    assert records and all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    serving = [r for r in records if r["msg"].startswith("kvswapd ") and f":{port}" in r["msg"]]
    # The line's fields are JSON fields too, not only words inside msg.
    assert len(serving) == 1 and serving[0]["endpoint"] == f"tcp://127.0.0.1:{port}"
    assert serving[0]["fsync"] == "data" and serving[0]["storage_dir"].endswith("from-file")
    assert records[-1]["msg"] == "kvswapd stopped" and records[-1]["level"] == "info"


def test_json_logs_are_one_object_per_line_even_for_tracebacks(tmp_path: Path) -> None:
    # Start-up fails (the port is taken): an error record, in JSON, and exit code 3.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        r = kvswapd("--log-format", "json", "--cache-queue-port", str(taken), "--metrics-port", str(free_port()),
                    "--storage-dir", str(tmp_path / "s"))
    assert r.returncode == 3
    lines = r.stderr.splitlines()
    records = [json.loads(line) for line in lines]  # every line parses
    errors = [x for x in records if x["level"] == "error"]
    assert len(errors) == 1 and "already in use" in errors[0]["msg"] and errors[0]["logger"] == "kvswap.daemon"
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$", errors[0]["ts"])

    from kvswap.daemon.logs import JsonFormatter
    import logging

    try:
        raise ValueError("two\nlines")
    except ValueError:
        record = logging.LogRecord("kvswap.test", logging.ERROR, __file__, 1, "failed: %s", ("x",), sys.exc_info())
    line = JsonFormatter().format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["msg"] == "failed: x" and parsed["exc"].endswith("ValueError: two\nlines")


def test_text_logs_stay_the_default(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = kvswapd("--cache-queue-port", str(s.getsockname()[1]), "--storage-dir", str(tmp_path / "s"))
    assert r.returncode == 3
    assert re.search(r"^\S+ \S+ ERROR kvswap.daemon: start-up failed: .*already in use", r.stderr, re.M)
