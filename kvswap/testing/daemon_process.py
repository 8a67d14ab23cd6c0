"""A real kvswapd as a subprocess on loopback, with a real storage directory: what the
end-to-end tests and the benchmarks run against."""

from __future__ import annotations

import signal
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvswap.daemon.tools.local_daemon import free_port, spawn_kvswapd, stop_process
from kvswap.protocol import Client

__all__ = ["DaemonProcess", "free_port"]


@dataclass
class DaemonProcess:
    storage_dir: Path
    port: int
    metrics_port: int
    extra_args: list[str] = field(default_factory=list)
    log_path: Path | None = None
    proc: subprocess.Popen | None = None
    #: Extra Client arguments for the readiness check (the CURVE keys of a CURVE daemon).
    client_options: dict = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def start(self, timeout: float = 20.0) -> "DaemonProcess":
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.log_path = self.storage_dir.parent / f"kvswapd-{self.port}.log"
        log = open(self.log_path, "ab")
        self.proc = spawn_kvswapd(self.port, self.metrics_port, str(self.storage_dir),
                                  ["--engine-check-interval-s", "0.2", *self.extra_args], log)
        log.close()
        with Client(self.endpoint, timeout=2, **self.client_options) as c:
            try:
                c.wait_ready(timeout)
            except Exception:
                self.stop()
                raise AssertionError(f"kvswapd did not become ready:\n{self.log()}")
        return self

    def http(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.metrics_url + path, timeout=5) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """The value of one series from a live /metrics scrape (0 if absent)."""
        _, text = self.http("/metrics")
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            series, _, value = line.rpartition(" ")
            metric, _, label_part = series.partition("{")
            got = ",".join(sorted(label_part.rstrip("}").split(","))) if label_part else ""
            if metric == name and got == want:
                return float(value)
        return 0.0

    def metric_sum(self, name: str) -> float:
        """The sum of every series of one metric (all label values) from a live scrape."""
        _, text = self.http("/metrics")
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rpartition(" ")[2])
        return total

    def answers(self) -> float:
        """How many answers the daemon has sent: it counts every reply it sends, once, in
        ``kvswap_requests_total``. A test compares this with the replies that arrived, to
        catch a duplicate without waiting for one."""
        return self.metric_sum("kvswap_requests_total")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        return None if self.proc is None else stop_process(self.proc, sig, timeout)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None
