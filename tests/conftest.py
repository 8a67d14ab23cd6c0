"""Fixtures: a real kvswapd subprocess on loopback with a real directory, and an engine-side
cache in shared memory."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from kvswap.protocol import CacheLayout, Client, HostKVCache
from support import DaemonProcess, free_port

#: Under CI=true, a skip for a component the test set-up installs fails the run.
pytest_plugins = ["ci_skips"]


@pytest.fixture
def storage_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def daemon(storage_dir: Path) -> Iterator[DaemonProcess]:
    d = DaemonProcess(storage_dir, free_port(), free_port()).start()
    yield d
    code = d.stop()
    assert code == 0, f"kvswapd exited with {code}:\n{d.log()}"


@pytest.fixture
def layout() -> CacheLayout:
    return CacheLayout("test-model", num_layers=3, num_blocks=32, block_size=8, num_kv_heads=2, head_dim=16)


@pytest.fixture
def cache(layout: CacheLayout) -> Iterator[HostKVCache]:
    with HostKVCache.create(layout) as c:
        c.fill_random(seed=1)
        yield c


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[Client]:
    with Client(daemon.endpoint, timeout=10) as c:
        yield c
