"""16 clients doing mixed swap_out / swap_in / lookup against one real daemon for 10 s: every
request answered exactly once, every loaded byte right, nobody stuck. Latency and memory are
printed for the record, never asserted (benchmarks/load.py runs the same for longer).

Sixteen engines on one daemon is past its default of 16 connections (one engine needs a few),
counting the load driver's own control connection: the daemon here allows 32, as an operator
sharing one daemon between engines would set it."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from kvswap.testing.load_driver import run_load
from support import DaemonProcess, free_port


@pytest.fixture
def daemon(storage_dir: Path) -> Iterator[DaemonProcess]:
    d = DaemonProcess(storage_dir, free_port(), free_port(), extra_args=["--max-connections", "32"]).start()
    yield d
    code = d.stop()
    assert code == 0, f"kvswapd exited with {code}:\n{d.log()}"


def test_sixteen_clients_mixed_load(daemon: DaemonProcess, capsys: pytest.CaptureFixture) -> None:
    assert daemon.proc is not None
    report = run_load(daemon.endpoint, daemon.proc.pid, clients=16, duration_s=10.0, seed=7, answers=daemon.answers)
    with capsys.disabled():
        print("\n" + report.summary())
    assert report.hung_workers == 0
    assert report.total("sent") > 0 and all(w.sent > 0 for w in report.workers)  # every client got work done
    assert report.total("lost") == 0
    assert report.total("duplicated") == 0
    assert report.daemon_answers == report.requests_sent  # no answer sent that did not arrive
    assert report.total("strays") == 0
    assert report.wrong_answers == []
    assert report.total("mismatched_blocks") == 0
    assert report.total("verified_blocks") > 0
    assert set(report.errors) <= {"busy"}, report.errors
    assert daemon.alive
