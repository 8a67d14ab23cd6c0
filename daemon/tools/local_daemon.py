"""Start a kvswapd subprocess on free loopback ports, for the demo and the bench."""

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
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvswap.daemon", "--cache-queue-port", str(self.port), "--metrics-port",
             str(self.metrics_port), "--storage-dir", self.storage_dir, *self.extra_args],
            stdout=self.log, stderr=self.log)
        with Client(self.endpoint, timeout=2) as c:
            try:
                c.wait_ready(timeout)
            except Exception:
                self.stop()
                raise RuntimeError(f"kvswapd did not start (exit code {self.proc.poll()})") from None
        return self

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> "LocalDaemon":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
