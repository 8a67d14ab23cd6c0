"""Test support: a real kvswapd subprocess on loopback with a real directory, and small
helpers the tests share."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvswap.daemon.tools.local_daemon import free_port, spawn_kvswapd, stop_process  # noqa: F401  (free_port: for tests)
from kvswap.protocol import Client


#: Ends the skip reason of every test that skips for a component scripts/test.sh installs
#: (Redis, Mooncake's libibverbs, promtool, the test extra's packages). Under CI=true such a
#: skip is a failure (tests/conftest.py): CI installed the component, so a skip means it broke.
INSTALLED_BY_TEST_SETUP = "scripts/test.sh installs it"


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


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def shm_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


class InProcessDaemon:
    """A daemon on a thread of the test process, so a test can patch one seam of it (the
    disk, the clock) and drive it with the real client over a real socket."""

    def __init__(self, storage_dir: Path, **config: object) -> None:
        from kvswap.daemon.config import Config
        from kvswap.daemon.server import Daemon

        self.daemon = Daemon(Config(cache_queue_port=0, metrics_port=0, storage_dir=str(storage_dir), **config))
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.daemon.control_port}"

    def __enter__(self) -> "InProcessDaemon":
        def main() -> None:
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(self.daemon.serve())
            except BaseException as exc:  # surfaced by __exit__
                self.error = exc
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=main, name="kvswapd-test", daemon=True)
        self._thread.start()
        assert wait_until(lambda: self.daemon.serving or self.error is not None, 20), "daemon did not start"
        if self.error is not None:
            raise self.error
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._thread is not None
        self._loop.call_soon_threadsafe(self.daemon.request_exit)
        self._thread.join(30)
        assert not self._thread.is_alive(), "daemon did not stop"
        if self.error is not None:
            raise self.error


class GatedWrites:
    """Wraps Disk.write_file so writes wait until the test opens the gate."""

    def __init__(self, disk) -> None:
        self.disk = disk
        self.original = disk.write_file
        self.gate = threading.Event()
        self.started = threading.Semaphore(0)
        disk.write_file = self

    def __enter__(self) -> "GatedWrites":
        return self

    def __exit__(self, *exc: object) -> None:
        self.gate.set()  # a held write must not outlive a failed test (the daemon waits for it)

    def __call__(self, *args, **kwargs):
        self.started.release()
        assert self.gate.wait(30), "test never opened the write gate"
        return self.original(*args, **kwargs)
