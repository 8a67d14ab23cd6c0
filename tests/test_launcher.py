"""``kvswap launch``: real daemons (CPU, "fake GPUs") beside a stand-in server, all real
processes; the checks are on exit codes, pids that must be gone, and what the server saw."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvswap.daemon.tools.launcher import parse_gpus, plan

from support import free_port, wait_until

LAUNCH = [sys.executable, "-m", "kvswap.daemon.tools.admin", "launch"]

#: The stand-in api_server: pings every daemon through kvswap.protocol.Client on the ports the
#: port scheme gives, records what it saw (pids from --pid-dir, each daemon's environment),
#: then exits with argv[2]; argv[2] == "wait" blocks until a signal instead, "stubborn" ignores
#: SIGTERM and blocks until killed.
SERVER = r"""
import json, os, signal, sys, time
from kvswap.protocol import Client
out, code, pid_dir, ports = sys.argv[1], sys.argv[2], sys.argv[3], [int(p) for p in sys.argv[4:]]
seen = {"pongs": [], "endpoints": os.environ.get("KVSWAP_ENDPOINTS"), "daemons": {}}
for port in ports:
    with Client(f"tcp://127.0.0.1:{port}", timeout=5) as c:
        seen["pongs"].append(c.ping() >= 0)
for name in sorted(os.listdir(pid_dir)):
    pid = int(open(os.path.join(pid_dir, name)).read())
    env = dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)
    seen["daemons"][name] = {"pid": pid, "cuda": env.get("CUDA_VISIBLE_DEVICES")}
seen["server_pid"] = os.getpid()
tmp = out + ".tmp"
json.dump(seen, open(tmp, "w"))
os.replace(tmp, out)
if code == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(1)
if code == "wait":
    def bye(sig, frame):
        open(out + ".signal", "w").write(signal.Signals(sig).name)
        sys.exit(7)
    signal.signal(signal.SIGTERM, bye)
    signal.signal(signal.SIGINT, bye)
    while True:
        time.sleep(1)
sys.exit(int(code))
"""


def free_ports(n: int, avoid: set[int] = frozenset()) -> int:
    """A base port with ``n`` consecutive free ports."""
    for _ in range(200):
        base = free_port()
        if base + n > 65535 or avoid & set(range(base, base + n)):
            continue
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range")


def gone(pid: int) -> bool:
    """No such process, or only its zombie (an orphan whose reaper has not run yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


class Launch:
    def __init__(self, tmp: Path, gpus: list[str], code: str = "0", extra: list[str] | None = None,
                 server: list[str] | None = None) -> None:
        self.tmp = tmp
        self.base = free_ports(len(gpus))
        self.metrics_base = free_ports(len(gpus), avoid=set(range(self.base, self.base + len(gpus))))
        self.pid_dir = tmp / "pids"
        self.out = tmp / "server.json"
        ports = [str(self.base + i) for i in range(len(gpus))]
        server = server or [sys.executable, "-c", SERVER, str(self.out), code, str(self.pid_dir), *ports]
        self.argv = [*LAUNCH, "--gpus", ",".join(gpus), "--base-cache-queue-port", str(self.base),
                     "--base-metrics-port", str(self.metrics_base), "--storage-dir", str(tmp / "store-{gpu}"),
                     "--pid-dir", str(self.pid_dir), "--grace-s", "20", "--ready-timeout-s", "60",
                     "--daemon-arg=--drain-timeout-s=5", *(extra or []), "--", *server]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSWAP_")}
        self.proc = subprocess.Popen(self.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait(self, timeout: float = 60) -> tuple[int, str]:
        _, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, err

    def seen(self) -> dict:
        return json.loads(self.out.read_text())



def daemon_pids(err: str) -> dict[str, int]:
    """gpu -> pid, from the launcher's 'started kvswapd gpu=.. pid=..' lines."""
    out = {}
    for line in err.splitlines():
        if "started kvswapd gpu=" in line:
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            out[fields["gpu"]] = int(fields["pid"])
    return out


def test_two_gpus_start_serve_and_leave_nothing_behind(tmp_path: Path) -> None:
    launch = Launch(tmp_path, ["0", "1"])
    code, err = launch.wait()
    assert code == 0, err
    seen = launch.seen()
    # Both daemons answered on base + index, and the server was told where they are.
    assert seen["pongs"] == [True, True]
    assert seen["endpoints"] == f"tcp://127.0.0.1:{launch.base},tcp://127.0.0.1:{launch.base + 1}"
    # Each daemon saw only its GPU; the pid files named the processes the launcher started.
    daemons = seen["daemons"]
    assert sorted(daemons) == ["kvswapd-0.pid", "kvswapd-1.pid", "server.pid"]
    assert daemons["kvswapd-0.pid"]["cuda"] == "0" and daemons["kvswapd-1.pid"]["cuda"] == "1"
    assert daemons["server.pid"]["pid"] == seen["server_pid"]
    assert daemon_pids(err) == {"0": daemons["kvswapd-0.pid"]["pid"], "1": daemons["kvswapd-1.pid"]["pid"]}
    # Nothing is left: every pid is gone, the pid files too; daemons drained cleanly (exit 0).
    assert all(gone(d["pid"]) for d in daemons.values())
    assert list(launch.pid_dir.iterdir()) == []
    assert "stopped 2 kvswapd: kvswapd gpu 0 exit 0, kvswapd gpu 1 exit 0" in err and "killing" not in err
    assert (tmp_path / "store-0").is_dir() and (tmp_path / "store-1").is_dir()


def test_sigterm_is_forwarded_and_the_server_code_returned(tmp_path: Path) -> None:
    launch = Launch(tmp_path, ["3"], code="wait")
    assert wait_until(launch.out.exists, 60)
    launch.proc.send_signal(signal.SIGTERM)
    code, err = launch.wait()
    assert code == 7, err  # the server's own exit code
    assert (tmp_path / "server.json.signal").read_text() == "SIGTERM"
    assert "SIGTERM: forwarding it to the server" in err
    assert all(gone(d["pid"]) for d in launch.seen()["daemons"].values())


def test_a_dead_daemon_stops_the_server_and_the_others(tmp_path: Path) -> None:
    launch = Launch(tmp_path, ["0", "1"], code="wait")
    assert wait_until(launch.out.exists, 60)
    daemons = launch.seen()["daemons"]
    os.kill(daemons["kvswapd-1.pid"]["pid"], signal.SIGKILL)
    code, err = launch.wait()
    assert code == 4, err
    assert f"kvswapd gpu 1 (pid {daemons['kvswapd-1.pid']['pid']}) exited with code 137 while the server ran" in err
    assert (tmp_path / "server.json.signal").read_text() == "SIGTERM"  # the server was asked to stop, not killed
    assert all(gone(d["pid"]) for d in daemons.values())


def test_a_server_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    launch = Launch(tmp_path, ["0"], code="stubborn", extra=["--grace-s", "1"])
    assert wait_until(launch.out.exists, 60)
    seen = launch.seen()
    os.kill(seen["daemons"]["kvswapd-0.pid"]["pid"], signal.SIGKILL)
    code, err = launch.wait()
    assert code == 4, err
    assert f"server (pid {seen['server_pid']}) is still running; killing it" in err
    assert all(gone(d["pid"]) for d in seen["daemons"].values())


def test_a_sigkilled_launcher_leaves_nothing_behind(tmp_path: Path) -> None:
    launch = Launch(tmp_path, ["0", "1"], code="wait")
    assert wait_until(launch.out.exists, 60)
    pids = [d["pid"] for d in launch.seen()["daemons"].values()]
    launch.proc.kill()
    launch.proc.wait()
    # The parent-death signal (SIGTERM) reaches the daemons and the server; they exit.
    assert wait_until(lambda: all(gone(p) for p in pids), 30), [p for p in pids if not gone(p)]
    assert (tmp_path / "server.json.signal").read_text() == "SIGTERM"


def test_a_daemon_that_cannot_start_means_no_server(tmp_path: Path) -> None:
    base = free_ports(2)
    metrics_base = free_ports(2, avoid={base, base + 1})
    out = tmp_path / "server.json"
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", base + 1))  # the second daemon's port is taken
        blocker.listen()
        proc = subprocess.run(
            [*LAUNCH, "--gpus", "0,1", "--base-cache-queue-port", str(base), "--base-metrics-port",
             str(metrics_base), "--storage-dir", str(tmp_path / "s"), "--pid-dir", str(tmp_path / "pids"), "--",
             sys.executable, "-c", "open(__import__('sys').argv[1], 'w').write('ran')", str(out)],
            capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert "kvswapd gpu 1" in proc.stderr and "exited with code 3 before it was ready" in proc.stderr
    assert "already in use" in proc.stderr  # the daemon's own reason, on the same stderr
    assert not out.exists()
    pids = daemon_pids(proc.stderr)
    assert set(pids) == {"0", "1"} and all(gone(p) for p in pids.values())


def test_a_missing_server_command_exits_127_and_starts_no_daemon(tmp_path: Path) -> None:
    launch = Launch(tmp_path, ["0"], server=[str(tmp_path / "no-such-server")])
    code, err = launch.wait()
    assert code == 127, err
    assert "cannot start the server" in err
    assert daemon_pids(err) == {}  # checked before any daemon was started


def test_port_scheme_is_base_plus_index() -> None:
    specs = plan(["4", "5", "GPU-8f0c"], 55500, 55600, "/s/{gpu}-{index}")
    assert [(s.gpu, s.cache_queue_port, s.metrics_port, s.storage_dir) for s in specs] == [
        ("4", 55500, 55600, "/s/4-0"), ("5", 55501, 55601, "/s/5-1"), ("GPU-8f0c", 55502, 55602, "/s/GPU-8f0c-2")]
    assert {s.storage_dir for s in plan(["0", "1"], 1000, 2000, "/shared")} == {"/shared"}


@pytest.mark.parametrize("gpus,cq,mp,sdir,message", [
    (["0", "1"], 55500, 55501, "/s", "overlap"),
    (["0", "1"], 65535, 55600, "/s", "is not a port"),
    (["0", "0"], 55500, 55600, "/s", "names a GPU twice"),
    ([], 55500, 55600, "/s", "names no GPU"),
    (["0"], 55500, 55600, "/s/{rank}", "only {gpu} and {index}"),
])
def test_plans_that_cannot_work_are_refused(gpus: list[str], cq: int, mp: int, sdir: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("{", r"\{").replace("}", r"\}")):
        plan(gpus, cq, mp, sdir)


def test_gpu_list_parsing_and_usage_errors(tmp_path: Path) -> None:
    assert parse_gpus("0, 1,,2") == ["0", "1", "2"]
    assert parse_gpus("GPU-aa,MIG-bb") == ["GPU-aa", "MIG-bb"]
    with pytest.raises(ValueError, match="'x' is not a GPU"):
        parse_gpus("0,x")
    r = subprocess.run([*LAUNCH, "--gpus", "0,1", "--base-cache-queue-port", "100", "--base-metrics-port", "101",
                        "--storage-dir", str(tmp_path), "--", "true"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "overlap" in r.stderr
    assert not list(tmp_path.iterdir())
    r = subprocess.run([*LAUNCH, "--gpus", "0", "--storage-dir", str(tmp_path)], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and "SERVER_COMMAND" in r.stderr
