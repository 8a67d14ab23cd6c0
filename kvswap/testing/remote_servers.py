"""Real remote stores on loopback for the remote-tier tests and the throughput benchmark:
``redis-server`` (alone or as a three-node cluster) and Mooncake Store's ``mooncake_master``,
each on free ports, started and killed by the caller.

Mooncake needs no separate metadata server here: clients use ``metadata=P2PHANDSHAKE`` and
exchange transfer metadata directly. (``mooncake_master --enable_http_metadata_server`` would
serve ``http://HOST:PORT/metadata`` for deployments that want one.)
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

from kvswap.daemon.tools.local_daemon import free_port

from .polling import wait_until
from .skips import INSTALLED_BY_TEST_SETUP


def redis_server_path() -> str | None:
    return shutil.which("redis-server")


def redis_skip_reason() -> str:
    if redis_server_path() is None:
        return f"redis-server is not installed (Debian package redis-server; {INSTALLED_BY_TEST_SETUP})"
    if importlib.util.find_spec("redis") is None:
        return f"redis-py is not installed (the test extra; {INSTALLED_BY_TEST_SETUP})"
    return ""


def mooncake_master_path() -> str | None:
    """The master binary inside the package (the ``mooncake_master`` on PATH is a Python
    launcher that execs it), else whatever PATH has."""
    spec = importlib.util.find_spec("mooncake")
    if spec and spec.submodule_search_locations:
        candidate = Path(list(spec.submodule_search_locations)[0]) / "mooncake_master"
        if candidate.exists() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("mooncake_master")


def mooncake_skip_reason() -> str:
    if importlib.util.find_spec("mooncake") is None:
        return f"mooncake-transfer-engine-non-cuda is not installed (the test extra; {INSTALLED_BY_TEST_SETUP})"
    if mooncake_master_path() is None:
        return f"the mooncake package has no mooncake_master binary (the test extra; {INSTALLED_BY_TEST_SETUP})"
    from kvswap.backends.mooncake_tier import mooncake_import_error

    problem = mooncake_import_error()
    if problem:
        return f"mooncake.store does not import: {problem} (Debian package libibverbs1; {INSTALLED_BY_TEST_SETUP})"
    return ""


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


class ServerProcess:
    """One server process on a fixed loopback port; restartable on the same port."""

    name = "server"

    def __init__(self, log_dir: Path, port: int | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    def argv(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        return port_open(self.port)

    def start(self, timeout: float = 15.0) -> "ServerProcess":
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} already running"
        log_path = self.log_dir / f"{self.name}-{self.port}.log"
        with open(log_path, "ab") as log:
            proc = self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, cwd=self.log_dir)
        if not wait_until(lambda: proc.poll() is None and self.ready(), timeout=timeout):
            self.kill()
            raise AssertionError(f"{self.name} on port {self.port} did not start:\n{self.log()[-3000:]}")
        return self

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-run, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        path = self.log_dir / f"{self.name}-{self.port}.log"
        return path.read_text(errors="replace") if path.exists() else ""


class RedisServer(ServerProcess):
    name = "redis"

    def __init__(self, log_dir: Path, port: int | None = None, cluster: bool = False) -> None:
        super().__init__(log_dir, port)
        self.cluster = cluster
        self.bus_port = free_port() if cluster else 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def argv(self) -> list[str]:
        argv = [redis_server_path() or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.log_dir)]
        if self.cluster:
            # The bus port defaults to port + 10000, which a free port near the top of the
            # range cannot have: name one.
            argv += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf",
                     "--cluster-port", str(self.bus_port)]
        return argv

    def ready(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5).ping())
        except redis.RedisError:
            return False

    def raw(self):
        import redis

        return redis.Redis(port=self.port, socket_timeout=5)


class RedisClusterServers:
    """Three empty primaries that split the 16384 slots and meet each other: a real Redis
    Cluster without redis-cli."""

    def __init__(self, log_dir: Path) -> None:
        self.nodes = [RedisServer(log_dir, cluster=True) for _ in range(3)]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self, timeout: float = 20.0) -> "RedisClusterServers":
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> "RedisClusterServers":
        for node in self.nodes:
            node.start()
        bounds = [(0, 5460), (5461, 10922), (10923, 16383)]
        for node, (low, high) in zip(self.nodes, bounds):
            node.raw().execute_command("CLUSTER", "ADDSLOTSRANGE", low, high)
        first = self.nodes[0].raw()
        for node in self.nodes[1:]:
            first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, node.bus_port)

        def converged() -> bool:
            for node in self.nodes:
                info = node.raw().execute_command("CLUSTER", "INFO").decode()
                if "cluster_state:ok" not in info or "cluster_known_nodes:3" not in info:
                    return False
            return True
        if not wait_until(converged, timeout=timeout, interval=0.1):
            raise AssertionError("redis cluster did not converge")
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()


class MooncakeMaster(ServerProcess):
    """``mooncake_master`` on loopback: RPC on ``port``, its metrics/admin HTTP server on
    ``metrics_port`` (both 127.0.0.1). Objects live in the clients' segments; the master keeps
    only the map, which a restart loses."""

    name = "mooncake-master"

    def __init__(self, log_dir: Path, port: int | None = None) -> None:
        super().__init__(log_dir, port)
        self.metrics_port = free_port()

    def url(self, **query: object) -> str:
        params = {"metadata": "P2PHANDSHAKE", "protocol": "tcp", **query}
        return f"mooncake://127.0.0.1:{self.port}?" + "&".join(f"{k}={v}" for k, v in params.items())

    def argv(self) -> list[str]:
        return [mooncake_master_path() or "mooncake_master", "--rpc_port", str(self.port), "--rpc_address", "127.0.0.1",
                "--metrics_port", str(self.metrics_port), "--metrics_host", "127.0.0.1",
                "--enable_metric_reporting=false", "--logtostderr"]

    def start(self, timeout: float = 15.0) -> "MooncakeMaster":
        super().start(timeout)
        return self
