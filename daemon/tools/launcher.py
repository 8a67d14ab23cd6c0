"""``kvswap launch``: one kvswapd per GPU beside an inference server, as one unit.

    kvswap launch --gpus 0,1 --base-cache-queue-port 55500 --base-metrics-port 55600 \\
        --storage-dir /var/lib/kvswap -- python -m fastdeploy.entrypoints.openai.api_server ...

Port scheme: the daemon of the i-th GPU in ``--gpus`` (counting from 0) listens on
``base-cache-queue-port + i`` and serves metrics on ``base-metrics-port + i``; ``--gpus 4,5``
gives 55500/55600 to GPU 4 and 55501/55601 to GPU 5. Each daemon sees only its GPU
(``CUDA_VISIBLE_DEVICES``).

Sequence: check that the server command exists, start every daemon, wait until each answers
``/readyz``, start the server (an argv list, never a shell), then supervise. SIGINT and SIGTERM
go to the server's process group; a server still running ``--grace-s`` after a forwarded
SIGINT gets SIGTERM, and ``--grace-s`` after that SIGKILL. When the server exits, the daemons
get SIGTERM (they drain), then SIGKILL after ``--grace-s``, and the launcher exits with the
server's code. A daemon that dies takes the server down with it (exit 4): the engine would
otherwise run on without its cache tier. With ``--log-dir``, a daemon that fails has the last
lines of its log repeated on the launcher's stderr.

The launcher waits for signals with ``sigwaitinfo`` on a blocked set (SIGCHLD, SIGINT,
SIGTERM), so it neither polls process state in a sleep loop nor runs code inside a signal
handler; children get an unblocked mask back before they exec.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Final, Sequence

import click

log = logging.getLogger("kvswap.launch")

#: Exit codes besides the server's own.
EXIT_DAEMON_START_FAILED: Final = 3
EXIT_DAEMON_DIED: Final = 4
#: Signals the launcher waits for. SIGCHLD: a child exited; the others are forwarded.
FORWARDED: Final = (signal.SIGINT, signal.SIGTERM)
WATCHED: Final = frozenset({signal.SIGCHLD, *FORWARDED})
_PR_SET_PDEATHSIG: Final = 1
#: Lines of a failed daemon's log file repeated on the launcher's stderr.
LOG_TAIL_LINES: Final = 20
#: What a server that ignores a forwarded signal gets next, ``grace_s`` apart.
ESCALATION: Final = {signal.SIGINT: (signal.SIGTERM, signal.SIGKILL), signal.SIGTERM: (signal.SIGKILL,)}


@dataclass(frozen=True)
class DaemonSpec:
    """What one GPU's daemon gets: its ports and storage directory (not a staging slot)."""

    index: int
    gpu: str
    cache_queue_port: int
    metrics_port: int
    storage_dir: str


def plan(gpus: Sequence[str], base_cache_queue_port: int, base_metrics_port: int, storage_dir: str) -> list[DaemonSpec]:
    """The port scheme: the i-th GPU listed gets ``base + i`` for both ports.

    >>> [(s.gpu, s.cache_queue_port, s.metrics_port) for s in plan(["4", "5"], 55500, 55600, "/s")]
    [('4', 55500, 55600), ('5', 55501, 55601)]

    ``{gpu}`` and ``{index}`` in ``storage_dir`` give each daemon its own directory
    (``/s/{gpu}`` -> ``/s/4``, ``/s/5``); without them every daemon shares one root, which the
    file tier supports (namespaces keep tp ranks apart; equal namespaces share records).
    Raises ``ValueError`` for a port beyond 65535, overlapping ranges or a repeated GPU.
    """
    if not gpus:
        raise ValueError("--gpus names no GPU")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus names a GPU twice: {','.join(gpus)}")
    n = len(gpus)
    for name, base in (("--base-cache-queue-port", base_cache_queue_port), ("--base-metrics-port", base_metrics_port)):
        if not 1 <= base or base + n - 1 > 65535:
            raise ValueError(f"{name} {base} + {n - 1} is not a port (1..65535)")
    cq = range(base_cache_queue_port, base_cache_queue_port + n)
    mp = range(base_metrics_port, base_metrics_port + n)
    if set(cq) & set(mp):
        raise ValueError(f"cache-queue ports {cq.start}..{cq.stop - 1} overlap metrics ports {mp.start}..{mp.stop - 1}")
    try:
        dirs = [storage_dir.format(gpu=gpu, index=i) for i, gpu in enumerate(gpus)]
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"--storage-dir {storage_dir!r}: only {{gpu}} and {{index}} may appear in braces "
                         f"({exc})") from None
    return [DaemonSpec(i, gpu, cq[i], mp[i], dirs[i]) for i, gpu in enumerate(gpus)]


def parse_gpus(value: str) -> list[str]:
    """``"0,1"`` -> ``["0", "1"]``; GPU UUIDs (``GPU-...``, ``MIG-...``) pass through."""
    gpus = [g.strip() for g in value.split(",") if g.strip()]
    for g in gpus:
        if not (g.isdigit() or g.startswith(("GPU-", "MIG-"))):
            raise ValueError(f"{g!r} is not a GPU index or UUID")
    return gpus


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: str | None = None
    proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """The exit code as a shell reports it: the code, or 128 + the signal that ended it."""
        rc = self.proc.returncode if self.proc is not None else None
        return rc if rc is None or rc >= 0 else 128 - rc

    def describe(self) -> str:
        return f"{self.name} (pid {self.pid})"


@dataclass
class Launcher:
    specs: list[DaemonSpec]
    server_argv: list[str]
    host: str = "127.0.0.1"
    daemon_args: list[str] = field(default_factory=list)
    ready_timeout_s: float = 120.0
    grace_s: float = 40.0
    pid_dir: str | None = None
    log_dir: str | None = None
    daemon_argv: list[str] = field(default_factory=lambda: [sys.executable, "-m", "kvswap.daemon"])

    def __post_init__(self) -> None:
        self.daemons: list[Child] = []
        self.server: Child | None = None

    # -- the whole run -------------------------------------------------------------------------------

    def run(self) -> int:
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)
        # A handler (never run: the signal stays blocked and sigwaitinfo takes it) keeps SIGCHLD
        # from being discarded at generation, which the default 'ignore' action permits.
        old_chld = signal.signal(signal.SIGCHLD, lambda *_: None)
        try:
            return self._run()
        finally:
            self._stop_all()
            self._remove_pid_files()
            signal.signal(signal.SIGCHLD, old_chld)
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def _run(self) -> int:
        problem = command_problem(self.server_argv[0], os.environ.get("PATH", os.defpath))
        if problem:  # before any daemon starts: nothing to start and stop again
            log.error("cannot start the server %s: %s", self.server_argv[0], problem)
            return 127 if problem == "not found" else 126
        for spec in self.specs:
            self._start_daemon(spec)
        interrupted, waiting = self._wait_ready()
        if interrupted is not None:
            log.info("interrupted by %s before the server started", signal.Signals(interrupted).name)
            return 128 + interrupted
        failed = self._dead_daemon()
        if failed is not None:
            log.error("%s exited with code %s before it was ready; stopping", failed.describe(), failed.returncode)
            self._show_log_tail(failed)
            return EXIT_DAEMON_START_FAILED
        if waiting:
            late = [f"gpu {s.gpu} (http://{self._probe_host()}:{s.metrics_port}/readyz)" for s in waiting]
            log.error("not ready within %.0f s: %s; stopping", self.ready_timeout_s, ", ".join(late))
            return EXIT_DAEMON_START_FAILED
        log.info("%d kvswapd ready; starting the server: %s", len(self.daemons), shlex.join(self.server_argv))
        try:
            self.server = self._spawn(Child("server", self.server_argv, self._server_env()))
        except OSError as exc:  # what a shell would say: 127 not found, 126 not executable
            log.error("cannot start the server %s: %s", self.server_argv[0], exc.strerror or exc)
            return 127 if isinstance(exc, FileNotFoundError) else 126
        self._write_pid_file("server", self.server.pid)
        return self._supervise()

    def _supervise(self) -> int:
        assert self.server is not None
        # After a forwarded signal: what the server gets next if it is still running at the
        # deadline (a server that ignores SIGINT must not hold the launcher forever).
        escalation: list[int] = []
        deadline: float | None = None
        while True:
            self._reap()
            if self.server.returncode is not None:
                log.info("server exited with code %d; stopping %d kvswapd", self.server.returncode, len(self.daemons))
                self._signal_group(self.server, signal.SIGTERM, stragglers=True)
                return self.server.returncode
            failed = self._dead_daemon()
            if failed is not None:
                log.error("%s exited with code %s while the server ran; stopping the server and the other "
                          "daemons", failed.describe(), failed.returncode)
                self._show_log_tail(failed)
                self._stop(self.server, group=True)
                return EXIT_DAEMON_DIED
            sig = self._wait_signal(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if sig in FORWARDED:
                log.info("%s: forwarding it to the server", signal.Signals(sig).name)
                self._signal_group(self.server, sig)
                if deadline is None:
                    escalation, deadline = list(ESCALATION[signal.Signals(sig)]), time.monotonic() + self.grace_s
            elif deadline is not None and time.monotonic() >= deadline:
                nxt = escalation.pop(0)
                log.warning("the server is still running %.0f s after the last signal; sending it %s",
                            self.grace_s, signal.Signals(nxt).name)
                self._signal_group(self.server, nxt)
                deadline = time.monotonic() + self.grace_s if escalation else None

    # -- daemons -------------------------------------------------------------------------------------

    def _start_daemon(self, spec: DaemonSpec) -> None:
        argv = [*self.daemon_argv, "--host", self.host, "--cache-queue-port", str(spec.cache_queue_port),
                "--metrics-port", str(spec.metrics_port), "--storage-dir", spec.storage_dir, *self.daemon_args]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=spec.gpu)
        child = Child(f"kvswapd gpu {spec.gpu}", argv, env)
        if self.log_dir:
            child.log_path = os.path.join(self.log_dir, f"kvswapd-{spec.gpu}.log")
        self._spawn(child)
        self.daemons.append(child)
        self._write_pid_file(f"kvswapd-{spec.gpu}", child.pid)
        log.info("started kvswapd gpu=%s pid=%d cache_queue_port=%d metrics_port=%d storage_dir=%s",
                 spec.gpu, child.pid, spec.cache_queue_port, spec.metrics_port, spec.storage_dir)

    def _wait_ready(self) -> tuple[int | None, list[DaemonSpec]]:
        """Poll every daemon's /readyz until all answer 200, one exits, a signal comes or the
        deadline passes. Returns the interrupting signal (if one came) and the specs not ready."""
        deadline = time.monotonic() + self.ready_timeout_s
        waiting = list(self.specs)
        while True:
            waiting = [s for s in waiting if not self._is_ready(s)]
            if not waiting or time.monotonic() >= deadline:
                return None, waiting
            sig = self._wait_signal(0.1)  # the poll interval; a child's exit or Ctrl-C ends it early
            if sig in FORWARDED:
                return sig, waiting
            self._reap()
            if self._dead_daemon() is not None:
                return None, waiting

    def _is_ready(self, spec: DaemonSpec) -> bool:
        url = f"http://{self._probe_host()}:{spec.metrics_port}/readyz"
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _probe_host(self) -> str:
        if self.host in ("0.0.0.0", ""):
            return "127.0.0.1"
        if self.host == "::":
            return "[::1]"
        return f"[{self.host}]" if ":" in self.host else self.host

    def _show_log_tail(self, child: Child) -> None:
        """The end of a failed daemon's log file, where its reason is. Without ``--log-dir``
        its output went to the launcher's stderr already."""
        if not child.log_path:
            return
        try:
            with open(child.log_path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 64 * 1024))
                lines = f.read().decode("utf-8", "replace").splitlines()[-LOG_TAIL_LINES:]
        except OSError as exc:
            log.error("cannot read %s: %s", child.log_path, exc.strerror or exc)
            return
        log.error("last lines of %s:\n%s", child.log_path, "\n".join(f"  | {line}" for line in lines))

    def _dead_daemon(self) -> Child | None:
        return next((d for d in self.daemons if d.returncode is not None), None)

    # -- processes -----------------------------------------------------------------------------------

    def _spawn(self, child: Child) -> Child:
        out = None
        if child.log_path:
            out = os.open(child.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            child.proc = _spawn(child.argv, child.env, out)
        finally:
            if out is not None:
                os.close(out)
        return child

    def _reap(self) -> None:
        for child in [*self.daemons, *([self.server] if self.server else [])]:
            if child.proc is not None:
                child.proc.poll()

    def _wait_signal(self, timeout: float | None) -> int | None:
        """The next watched signal, or None after ``timeout`` seconds."""
        if timeout is None:
            return signal.sigwaitinfo(WATCHED).si_signo
        info = signal.sigtimedwait(WATCHED, timeout)
        return info.si_signo if info is not None else None

    def _signal_group(self, child: Child, sig: int, stragglers: bool = False) -> None:
        """Signal the child's process group: the server and the workers it started, as a
        terminal's Ctrl-C would. ``stragglers``: the leader is gone; say if others remain."""
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        if stragglers:
            log.warning("the server left processes in its group; sent them %s", signal.Signals(sig).name)

    def _stop(self, child: Child | None, group: bool = False) -> None:
        """SIGTERM, then SIGKILL once ``grace_s`` has passed."""
        if child is None or child.returncode is not None:
            return
        self._stop_many([child], group)

    def _stop_many(self, children: list[Child], group: bool = False) -> None:
        live = [c for c in children if c.returncode is None]
        for c in live:
            self._send(c, signal.SIGTERM, group)
        deadline = time.monotonic() + self.grace_s
        while True:
            self._reap()
            live = [c for c in live if c.returncode is None]
            if not live or time.monotonic() >= deadline:
                break
            sig = self._wait_signal(min(0.5, max(0.01, deadline - time.monotonic())))
            if sig in FORWARDED:  # a second Ctrl-C while stopping: stop waiting politely
                log.warning("%s while stopping: killing %d processes", signal.Signals(sig).name, len(live))
                break
        for c in live:
            log.warning("%s is still running; killing it", c.describe())
            self._send(c, signal.SIGKILL, group)
        for c in live:
            assert c.proc is not None
            c.proc.wait()

    def _send(self, child: Child, sig: int, group: bool) -> None:
        try:
            os.killpg(child.pid, sig) if group else os.kill(child.pid, sig)
        except ProcessLookupError:
            pass

    def _stop_all(self) -> None:
        self._stop(self.server, group=True)
        self._stop_many(self.daemons)
        if self.daemons:
            codes = ", ".join(f"{d.name} exit {d.returncode}" for d in self.daemons)
            clean = all(d.returncode == 0 for d in self.daemons)
            log.log(logging.INFO if clean else logging.WARNING, "stopped %d kvswapd: %s", len(self.daemons), codes)

    # -- what the server sees, pid files ---------------------------------------------------------------

    def _server_env(self) -> dict[str, str]:
        host = self._probe_host()
        return dict(os.environ,
                    KVSWAP_ENDPOINTS=",".join(f"tcp://{host}:{s.cache_queue_port}" for s in self.specs),
                    KVSWAP_METRICS_URLS=",".join(f"http://{host}:{s.metrics_port}/metrics" for s in self.specs))

    def _write_pid_file(self, name: str, pid: int) -> None:
        if self.pid_dir:
            path = os.path.join(self.pid_dir, f"{name}.pid")
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                f.write(f"{pid}\n")
            os.replace(tmp, path)

    def _remove_pid_files(self) -> None:
        if not self.pid_dir:
            return
        for name in ["server", *(f"kvswapd-{s.gpu}" for s in self.specs)]:
            try:
                os.unlink(os.path.join(self.pid_dir, f"{name}.pid"))
            except FileNotFoundError:
                pass


def command_problem(command: str, path: str) -> str:
    """Why ``command`` cannot be executed ("" if it can): ``not found`` or ``not executable``,
    looked up the way exec does (a name with a slash as a path, else along ``path``)."""
    if "/" in command:
        if not os.path.exists(command):
            return "not found"
        return "" if os.path.isfile(command) and os.access(command, os.X_OK) else "not executable"
    return "" if shutil.which(command, path=path) else "not found"


def _spawn(argv: list[str], env: dict[str, str], out_fd: int | None) -> subprocess.Popen:
    """fork + exec without a shell. The child gets: its own process group (a terminal's Ctrl-C
    reaches the launcher only, which stops the server first and the daemons after it), an
    unblocked signal mask (exec keeps the mask, and the launcher blocks the signals it waits
    for), and SIGTERM when the launcher dies (so a SIGKILLed launcher leaves nothing behind)."""
    set_death_signal = _parent_death_signal_setter()
    launcher = os.getpid()

    def prepare() -> None:  # in the child between fork and exec; the launcher has one thread
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        os.setpgid(0, 0)
        set_death_signal(signal.SIGTERM)
        if os.getppid() != launcher:  # the launcher died before the line above took effect
            os._exit(1)

    return subprocess.Popen(argv, env=env, preexec_fn=prepare, stdout=out_fd, stderr=out_fd,
                            stdin=subprocess.DEVNULL, close_fds=True)


def _parent_death_signal_setter() -> Callable[[int], None]:
    """``prctl(PR_SET_PDEATHSIG, sig)``, looked up before the fork; a no-op off Linux, where
    the launcher's own stop path still applies."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return lambda sig: None
    return lambda sig: prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


@click.command("launch", context_settings={"show_default": True, "help_option_names": ["-h", "--help"],
                                           "allow_interspersed_args": False})  # the server's own flags stay its own
@click.option("--gpus", required=True, help="GPUs to serve, by index or UUID: 0,1,2,3. One kvswapd each.")
@click.option("--base-cache-queue-port", type=click.IntRange(1, 65535), default=55500,
              help="Cache-queue port of the first GPU's daemon; the i-th GPU listed gets base + i.")
@click.option("--base-metrics-port", type=click.IntRange(1, 65535), default=55600,
              help="Metrics port of the first GPU's daemon; the i-th GPU listed gets base + i.")
@click.option("--storage-dir", envvar="KVSWAP_STORAGE_DIR", default=None, show_default=False,
              help="Store root for every daemon; {gpu} or {index} in it gives each daemon its own directory. "
                   "[default: $KVSWAP_STORAGE_DIR, else $FILE_BACKEND_STORAGE_DIR, else ./kvswap-store]")
@click.option("--host", default="127.0.0.1", help="Address the daemons bind to.")
@click.option("--daemon-arg", "daemon_args", multiple=True,
              help="Extra kvswapd argument, repeatable: --daemon-arg=--fsync=data. KVSWAP_* variables pass "
                   "through too.")
@click.option("--ready-timeout-s", type=click.FloatRange(0.1), default=120.0,
              help="How long every daemon may take to answer /readyz.")
@click.option("--grace-s", type=click.FloatRange(0), default=40.0,
              help="After SIGTERM, how long a daemon (or the server) may take to exit before SIGKILL; also "
                   "how long a server may ignore a forwarded SIGINT before it gets SIGTERM.")
@click.option("--pid-dir", type=click.Path(file_okay=False), default=None,
              help="Write server.pid and kvswapd-<gpu>.pid here while running.")
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="Write each daemon's output to kvswapd-<gpu>.log here instead of the launcher's stderr.")
@click.argument("server_command", nargs=-1, required=True, type=click.UNPROCESSED)
def launch(gpus: str, base_cache_queue_port: int, base_metrics_port: int, storage_dir: str | None, host: str,
           daemon_args: tuple[str, ...], ready_timeout_s: float, grace_s: float, pid_dir: str | None,
           log_dir: str | None, server_command: tuple[str, ...]) -> None:
    """Start one kvswapd per GPU, wait until all are ready, then run SERVER_COMMAND.

    Everything from the first argument that is not a launcher option on (or after `--`) is the
    server's command line, run without a shell. The launcher forwards SIGINT and SIGTERM to the server;
    when the server exits it stops the daemons and exits with the server's code (3: a daemon
    failed to start; 4: a daemon died while the server ran). The server finds the daemons in
    KVSWAP_ENDPOINTS and KVSWAP_METRICS_URLS (comma-separated, in --gpus order).
    """
    from kvswap.daemon.config import default_storage_dir

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="kvswap launch: %(message)s")
    try:
        specs = plan(parse_gpus(gpus), base_cache_queue_port, base_metrics_port, storage_dir or default_storage_dir())
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    for d in (pid_dir, log_dir):
        if d:
            os.makedirs(d, exist_ok=True)
    launcher = Launcher(specs, list(server_command), host=host, daemon_args=list(daemon_args),
                        ready_timeout_s=ready_timeout_s, grace_s=grace_s, pid_dir=pid_dir, log_dir=log_dir)
    sys.exit(launcher.run())
