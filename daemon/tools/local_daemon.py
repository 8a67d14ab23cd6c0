"""Start a kvswapd subprocess on free loopback ports, for the demo and the bench (and the
tests, whose helper builds on :func:`spawn_kvswapd` and :func:`stop_process`)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from typing import IO, Sequence

from kvswap.protocol.client import Client


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spawn_kvswapd(port: int, metrics_port: int, storage_dir: str, extra_args: Sequence[str] = (),
                  log: IO | int | None = None) -> subprocess.Popen:
    """The one way a kvswapd subprocess is started: this interpreter's ``python -m
    kvswap.daemon`` (so it runs the same checkout), on the given ports and directory."""
    return subprocess.Popen(
        [sys.executable, "-m", "kvswap.daemon", "--cache-queue-port", str(port), "--metrics-port", str(metrics_port),
         "--storage-dir", str(storage_dir), *extra_args],
        stdout=log, stderr=log)


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
    """Send ``sig`` (if it still runs) and wait; SIGKILL after ``timeout``. Returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


class LocalDaemon:
    def __init__(self, storage_dir: str, extra_args: Sequence[str] = (), log: IO | int | None = None) -> None:
        self.storage_dir = storage_dir
        self.port = free_port()
        self.metrics_port = free_port()
        self.extra_args = list(extra_args)
        self.log = subprocess.DEVNULL if log is None else log
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self, timeout: float = 30.0) -> "LocalDaemon":
        self.proc = spawn_kvswapd(self.port, self.metrics_port, self.storage_dir, self.extra_args, self.log)
        with Client(self.endpoint, timeout=2) as c:
            try:
                c.wait_ready(timeout)
            except Exception:
                self.stop()
                raise RuntimeError(f"kvswapd did not start (exit code {self.proc.poll()})") from None
        return self

    def stop(self, timeout: float = 30.0) -> int | None:
        return None if self.proc is None else stop_process(self.proc, timeout=timeout)

    def __enter__(self) -> "LocalDaemon":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
