"""Signals like uvicorn: SIGTERM, SIGINT and SIGHUP drain; a second one cuts the drain short
(exit 4, requests still running answered ``unavailable``); the handlers in place before the
daemon started are back when ``run`` returns. Real daemon subprocesses, real signals."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import DaemonProcess, free_port, wait_until

from kvswap.daemon.server import EXIT_FORCED
from kvswap.protocol import Client, HostKVCache, Unavailable
from kvswap.protocol import messages as m

CHILD = str(Path(__file__).with_name("daemon_child.py"))


class Child:
    """tests/daemon_child.py as a subprocess, its output in a file the test reads."""

    def __init__(self, tmp_path: Path, mode: str) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        self.log_path = tmp_path / f"child-{mode}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, CHILD, str(self.port), str(self.metrics_port),
                                          str(tmp_path / "store"), mode], stdout=log, stderr=subprocess.STDOUT)
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        with Client(self.endpoint, timeout=2) as c:
            c.wait_ready(20)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def saw(self, text: str, timeout: float = 20) -> bool:
        return wait_until(lambda: text in self.log(), timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_each_signal_drains_and_exits_0(tmp_path: Path, cache: HostKVCache, sig: signal.Signals) -> None:
    d = DaemonProcess(tmp_path / "store", free_port(), free_port()).start()
    with Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        queued = c.swap_out(list(range(8)), [f"k{i}" for i in range(8)])  # copied; written during the drain
        assert queued.queued + queued.stored == 8
    assert d.stop(sig) == 0, d.log()
    log = d.log()
    assert f"{sig.name}: draining" in log and "kvswapd stopped" in log
    assert "drain cut short" not in log
    # Every record copied before the signal was written during the drain.
    d.start()
    try:
        with Client(d.endpoint, timeout=10) as c:
            c.register(cache)
            assert c.lookup([f"k{i}" for i in range(8)]) == 8
    finally:
        assert d.stop() == 0


def test_a_second_signal_cuts_the_drain_short(tmp_path: Path, cache: HostKVCache) -> None:
    child = Child(tmp_path, "hold-writes")
    try:
        with Client(child.endpoint, timeout=60) as c:
            c.register(cache)
            pending = c.send(m.SwapOut, {"block_ids": (0,), "keys": ("held",), "wait": "persisted"}, timeout=60)
            assert child.saw("write held"), child.log()
            child.proc.send_signal(signal.SIGTERM)
            assert child.saw("draining: 1 requests in flight"), child.log()
            assert child.proc.poll() is None  # draining: it waits up to 120 s for the write
            child.proc.send_signal(signal.SIGINT)
            with pytest.raises(Unavailable) as answer:
                c.wait(pending, timeout=20)
            assert answer.value.message == "the daemon shut down before this request finished"
            assert child.proc.wait(30) == EXIT_FORCED, child.log()
        log = child.log()
        assert "SIGINT again: cutting the drain short (1 requests in flight" in log
        assert "drain cut short" in log and "Traceback" not in log
    finally:
        child.kill()


def test_handlers_are_restored_when_run_returns(tmp_path: Path) -> None:
    child = Child(tmp_path, "handlers")
    try:
        child.proc.send_signal(signal.SIGTERM)
        assert child.proc.wait(30) == 0, child.log()
        assert "restored" in child.log() and "not restored" not in child.log(), child.log()
    finally:
        child.kill()
