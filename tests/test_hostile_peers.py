"""A hostile or careless peer cannot exhaust the daemon (issue 15): memory held for a peer
that never reads, time on the event loop, file descriptors, and the smaller holes.

Each test drives a real kvswapd subprocess; the hostile peer is its own process
(tests/hostile_peer.py). The bounds asserted are generous (this runs on a shared 2-core
machine); the numbers they are set against are in docs/security.md. Each was checked to fail
against the code before the fix: no ping answered within 61 s under the flood, the daemon
grew from 48 to 1,297 MiB for a peer that does not read (1,030 MiB after it left), and the
engine could not connect with the metrics port flooded."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import DaemonProcess, free_port, wait_until

from kvswap.protocol import Client, HostKVCache, InvalidLayout, Timeout, Unavailable

HOSTILE = str(Path(__file__).with_name("hostile_peer.py"))


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"{field} not in /proc/{pid}/status")


def answered(d: DaemonProcess) -> float:
    """Requests the daemon has answered, all ops and outcomes together."""
    _, text = d.http("/metrics")
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("kvswap_requests_total{"))


def hostile(d: DaemonProcess, kind: str, count: int, rate: float, read: bool) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, HOSTILE, d.endpoint, kind, str(count), str(rate), "1" if read else "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


@pytest.fixture
def daemon(tmp_path: Path):
    d = DaemonProcess(tmp_path / "store", free_port(), free_port())
    d.start()
    yield d
    d.stop()


# -- one client stalls everyone -----------------------------------------------------------------

#: The stated bound on another client's ping p99 under the flood below: 100 ms. Why: the loop
#: spends at most ~15 ms on one frame (the decode stops at MAX_FRAME_ITEMS; the worst frame
#: here, 4 million nested empty maps, took 1.8 s to decode in full), a ping waits behind at
#: most one frame of the flooding peer (the receive loop hands each frame to its task before
#: reading the next, and the ROUTER reads its peers in turn), and the rest is CPU: the flood's
#: 100 MB/s of copying in two ZMQ I/O threads and the flooder share the 2 cores with the
#: daemon and the test. The assertion allows 10x that for a shared machine; the unfixed
#: daemon did not answer a ping within 61 s under this flood.
PING_P99_BOUND_S = 0.1


def test_ping_p99_under_a_large_frame_flood(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint, timeout=30) as pinger:
        quiet = sorted(pinger.ping() for _ in range(20))
        flood = hostile(daemon, "mixed", 0, 25, read=True)  # 25 frames of 2.8-4 MB a second
        try:
            assert wait_until(lambda: answered(daemon) >= 20 + 5, 30), "the flood never reached the daemon"
            samples: list[float] = []
            deadline = time.monotonic() + 60
            while len(samples) < 100 and time.monotonic() < deadline:
                samples.append(pinger.ping())
                time.sleep(0.02)
            assert flood.poll() is None, flood.stdout.read() if flood.stdout else ""
            refused = answered(daemon) - 20 - len(samples)
        finally:
            stop(flood)
    samples.sort()
    p99 = samples[int(len(samples) * 0.99) - 1]
    print(f"ping p99 {p99 * 1000:.1f} ms under the flood ({len(samples)} pings, {refused:.0f} flood frames "
          f"answered), {quiet[-2] * 1000:.1f} ms quiet; stated bound {PING_P99_BOUND_S * 1000:.0f} ms")
    assert len(samples) == 100, f"only {len(samples)} pings in 60 s: the flood stalls the daemon"
    assert refused >= 50, "the flood was too thin to test anything"
    assert p99 < 10 * PING_P99_BOUND_S


# -- replies nobody reads -----------------------------------------------------------------------


def test_rss_stays_bounded_with_a_client_that_never_reads(daemon: DaemonProcess) -> None:
    pid = daemon.proc.pid
    before = rss_mib(pid)
    base = answered(daemon)
    flood = hostile(daemon, "echo", 200, 0, read=False)  # 200 frames of 3.8 MB, replies never read
    try:
        # Usually 1-3 s; seen at 12, 16 and (once, in a full run) over 60 s on this 2-core VM, with
        # the daemon idle: the transport to a peer whose TCP window stays shut, not the daemon's
        # work. The bounds this test is for are the RSS ones below.
        assert wait_until(lambda: answered(daemon) >= base + 200, 180), "the daemon did not answer every frame"
        during, peak = rss_mib(pid), rss_mib(pid, "VmHWM")
        with Client(daemon.endpoint, timeout=10) as other:
            assert other.ping() > 0
    finally:
        stop(flood)
    assert wait_until(lambda: daemon.metric("kvswap_requests_in_flight") == 0, 10)
    after = rss_mib(pid)
    print(f"daemon RSS {before:.0f} MiB before, {during:.0f} MiB with the non-reading peer connected "
          f"(peak {peak:.0f}), {after:.0f} MiB after it left")
    assert during - before < 256, "the daemon holds the unread replies (or the frames) of a peer"
    assert after - before < 256


#: Issue 22, finding 6: what the daemon holds grows with connections only up to a bound. Each
#: connection makes ZMQ hold at most RCV_HWM + 2 of its frames (server.py) and SND_HWM
#: replies; decoded requests are charged against --max-inflight-request-bytes; connections
#: past --max-connections are refused at the handshake. Before, 12 connections sending the
#: largest valid swap_out (1.1 MB) and never reading took the daemon from 53 to 384 MiB.
SWAP_OUT_FRAME_MIB = 1.1


def _flood_without_reading(daemon: DaemonProcess, peers: int, frames: int) -> tuple[float, float, float, float]:
    """``peers`` processes, each sending ``frames`` swap_outs and never reading a reply; waits
    until the daemon has answered every frame of the ones it admits; returns the daemon's RSS
    before, with them connected, at its peak, and after they left (MiB)."""
    pid = daemon.proc.pid
    before = rss_mib(pid)
    base = answered(daemon)
    flood = [hostile(daemon, "swap_out", frames, 0, read=False) for _ in range(peers)]
    try:
        assert wait_until(lambda: daemon.metric("kvswap_connections") + daemon.metric(
            "kvswap_connections_refused_total") >= peers, 60), "the peers never connected"
        admitted = int(daemon.metric("kvswap_connections"))
        assert wait_until(lambda: answered(daemon) >= base + admitted * frames, 120), \
            f"the daemon did not answer every frame: {answered(daemon) - base} of {admitted * frames}"
        during, peak = rss_mib(pid), rss_mib(pid, "VmHWM")
        if admitted == peers:  # room for one more: it is served as ever
            with Client(daemon.endpoint, timeout=10) as other:
                assert other.ping() > 0
    finally:
        for proc in flood:
            stop(proc)
    assert wait_until(lambda: daemon.metric("kvswap_connections") == 0, 10)
    return before, during, peak, rss_mib(pid)


def test_rss_stays_bounded_with_many_connections_that_never_read(daemon: DaemonProcess) -> None:
    peers, frames = 12, 128
    before, during, peak, after = _flood_without_reading(daemon, peers, frames)
    # The stated bound for this flood: ZMQ's frames of every connection, the request budget
    # (64 MiB by default), and 32 MiB for the interpreter's own churn.
    bound = peers * 4 * SWAP_OUT_FRAME_MIB + 64 + 32
    print(f"{peers} connections x {frames} swap_outs of 1.1 MB, replies never read: daemon RSS {before:.0f} MiB "
          f"before, {during:.0f} with them connected (peak {peak:.0f}), {after:.0f} after they left; "
          f"stated bound +{bound:.0f} MiB")
    assert peak - before < bound
    assert after - before < bound
    assert wait_until(lambda: daemon.metric("kvswap_request_bytes_in_flight") == 0, 10)  # all freed


def test_connections_past_the_cap_are_refused_and_hold_nothing(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "store", free_port(), free_port(), extra_args=["--max-connections", "4"]).start()
    try:
        assert wait_until(lambda: d.metric("kvswap_connections") == 0, 10)  # the readiness check left
        before, during, peak, after = _flood_without_reading(d, 10, 64)
        assert d.metric("kvswap_connections_refused_total") >= 6
        bound = 4 * 4 * SWAP_OUT_FRAME_MIB + 64 + 32
        print(f"10 peers, 4 admitted: daemon RSS {before:.0f} MiB before, peak {peak:.0f}, {after:.0f} after; "
              f"stated bound +{bound:.0f} MiB")
        assert peak - before < bound
        # Each open connection counts; one that closes makes room for the next.
        clients = [Client(d.endpoint, timeout=10) for _ in range(4)]
        try:
            assert [c.ping() > 0 for c in clients] == [True] * 4
            assert d.metric("kvswap_connections") == 4
            with Client(d.endpoint, timeout=1) as fifth, pytest.raises((Timeout, Unavailable)):
                fifth.ping()
            clients.pop().close()
            assert wait_until(lambda: d.metric("kvswap_connections") == 3, 10)
            with Client(d.endpoint, timeout=10) as fifth:
                assert fifth.ping() > 0
        finally:
            for c in clients:
                c.close()
        assert "refused a connection to the control socket: 4 are open" in d.log()
    finally:
        assert d.stop() == 0, d.log()


# -- file descriptors ---------------------------------------------------------------------------

RESERVE = 128


@pytest.mark.parametrize("fd_limit,held_at_most", [
    (256, 64),  # the connection cap binds first
    # The descriptor reserve binds first: at most 64 open in all, about 32 of them the daemon's
    # own (a registered namespace's slab, journal and lock files among them), so the flood gets
    # about 32, under the cap of 64.
    (192, 192 - RESERVE),
])
def test_daemon_answers_and_stores_with_its_metrics_port_flooded(tmp_path: Path, monkeypatch, cache: HostKVCache,
                                                                 fd_limit: int, held_at_most: int) -> None:
    """A daemon whose hard limit is a few hundred descriptors, 600 idle connections on its
    metrics port: a new engine still connects, registers, stores (persisted) and loads."""
    FD_LIMIT = fd_limit  # noqa: N806
    import support

    real_popen = subprocess.Popen

    def limited(*args, **kwargs):
        kwargs["preexec_fn"] = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", limited)
    d = DaemonProcess(tmp_path / "store", free_port(), free_port()).start()
    monkeypatch.undo()
    idle: list[socket.socket] = []
    try:
        for _ in range(600):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", d.metrics_port))
            idle.append(s)
        # The daemon's signal: past its cap, each new connection is accepted and an older one
        # closed (the rest wait in the listen backlog, or for the header deadline).
        assert wait_until(lambda: sum(_closed(s) for s in idle) >= 200, 30), "no connection was cut off"
        with Client(d.endpoint, timeout=10) as engine:
            stats = engine.stats()
            assert stats["fd_limit"] == FD_LIMIT
            # The flood holds at most its share: the cap, or what the reserve leaves.
            assert stats["open_fds"] <= min(FD_LIMIT - RESERVE, 30 + held_at_most) + 8, stats["open_fds"]
            engine.register(cache)
            assert engine.swap_out([0, 1], ["a", "b"], wait="persisted").stored == 2
            assert engine.swap_in(["a", "b"], [4, 5]).loaded == 2
            assert cache.block_record(4) == cache.block_record(0)
            assert engine.lookup(["a", "b"]) == 2
    finally:
        for s in idle:
            s.close()
    try:
        assert wait_until(lambda: _http_ok(d, "/healthz"), 30)
        scrape = _scrape(d)
        assert scrape("kvswap_fd_limit") == FD_LIMIT
        assert scrape("kvswap_http_refused_total", reason="evicted") + scrape("kvswap_http_refused_total",
                                                                              reason="limit") >= 200
        assert 0 < scrape("kvswap_open_fds") < FD_LIMIT - RESERVE + 8
    finally:
        code = d.stop()
    log = d.log()
    assert code == 0, log
    assert "Traceback" not in log and "Too many open files" not in log, log


def _scrape(d: DaemonProcess):
    """One /metrics scrape, retried while the port is still at its limit; returns a lookup."""
    from kvswap.daemon.tools.status import parse_exposition

    text = ""

    def scraped() -> bool:
        nonlocal text
        try:
            status, text = d.http("/metrics")
            return status == 200
        except OSError:
            return False

    assert wait_until(scraped, 30)
    series = parse_exposition(text)
    return lambda name, **labels: series.get((name, tuple(sorted(labels.items()))), 0.0)


def _http_ok(d: DaemonProcess, path: str) -> bool:
    try:
        return d.http(path)[0] == 200
    except OSError:  # cut off: still at the connection cap
        return False


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


# -- probes and idle connections (issue 22, finding 5) -------------------------------------------

#: The metrics port's connection cap (daemon/metrics.py MAX_HTTP_CONNECTIONS).
HTTP_CAP = 64


def _idle_connection(d: DaemonProcess, source: str = "127.0.0.1") -> socket.socket:
    """A connection to the metrics port that never sends a byte."""
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", d.metrics_port))
    s.setblocking(False)
    return s


def _top_up(d: DaemonProcess, held: list[socket.socket], count: int, source: str = "127.0.0.1") -> int:
    """Replace the connections the daemon closed, so ``count`` are held again; returns how
    many were replaced."""
    replaced = 0
    for i, s in enumerate(held):
        if _closed(s):
            s.close()
            held[i] = _idle_connection(d, source)
            replaced += 1
    while len(held) < count:
        held.append(_idle_connection(d, source))
    return replaced


def _probe(d: DaemonProcess) -> bool:
    try:
        return d.http("/healthz") == (200, "ok\n")
    except OSError:  # cut off without an answer
        return False


def test_healthz_answers_every_probe_while_more_idle_connections_than_the_cap_are_held(
        daemon: DaemonProcess) -> None:
    """70 idle connections (over the cap of 64), topped up before every probe: every probe is
    answered. (Before, the 65th connection on was closed at once: 0 of 20 probes answered, and
    the shipped liveness probe restarted the daemon every ~30 s.)"""
    held: list[socket.socket] = []
    try:
        _top_up(daemon, held, HTTP_CAP + 6)
        # The daemon has taken them all once it has cut off the six past its cap.
        assert wait_until(lambda: sum(_closed(s) for s in held) >= 6, 10), "the daemon never reached its cap"
        answered_probes = 0
        for _ in range(20):
            _top_up(daemon, held, HTTP_CAP + 6)
            answered_probes += _probe(daemon)
        print(f"{answered_probes} of 20 probes answered with {HTTP_CAP + 6} idle connections held")
        assert answered_probes == 20
    finally:
        for s in held:
            s.close()
    assert daemon.metric("kvswap_http_refused_total", reason="evicted") >= 20
    assert "Traceback" not in daemon.log()


def test_a_peer_reopening_idle_connections_as_fast_as_it_can_never_evicts_another_address(
        daemon: DaemonProcess) -> None:
    """When the port is full, the connection closed is the oldest of the peer address holding
    the most: a flood from 127.0.0.2, re-opened as fast as a thread can, takes only its own
    connections, and every probe from 127.0.0.1 is answered, as is a /metrics scrape and a
    client that takes its time to send its request."""
    import threading

    held: list[socket.socket] = []
    stop_flood = threading.Event()
    reopened = 0

    def flood() -> None:
        nonlocal reopened
        while not stop_flood.is_set():
            reopened += _top_up(daemon, held, 2 * HTTP_CAP, "127.0.0.2")

    _top_up(daemon, held, 2 * HTTP_CAP, "127.0.0.2")
    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        assert wait_until(lambda: reopened >= 2 * HTTP_CAP, 20), "the flood never filled the port"
        answered_probes = sum(_probe(daemon) for _ in range(20))
        status, text = daemon.http("/metrics")
        # A slow client on another address (a scrape over a slow link): it connects, the flood
        # opens twice the cap after it, and only then does its request arrive.
        with socket.create_connection(("127.0.0.1", daemon.metrics_port), timeout=10) as slow:
            since = reopened
            assert wait_until(lambda: reopened >= since + 2 * HTTP_CAP, 4), "the flood is too slow to test this"
            slow.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            slow_answer = slow.recv(4096)
        assert flooder.is_alive()
    finally:
        stop_flood.set()
        flooder.join(10)
        for s in held:
            s.close()
    print(f"{answered_probes} of 20 probes answered while a peer re-opened {reopened} idle connections")
    assert answered_probes == 20
    assert status == 200 and "kvswap_http_refused_total" in text
    assert slow_answer.startswith(b"HTTP/1.1 200 OK\r\n"), slow_answer


def test_a_request_line_over_64_kib_is_answered_431_without_a_traceback(daemon: DaemonProcess) -> None:
    with socket.create_connection(("127.0.0.1", daemon.metrics_port), timeout=10) as s:
        s.sendall(b"GET /" + b"a" * (70 * 1024) + b" HTTP/1.1\r\n\r\n")
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    with socket.create_connection(("127.0.0.1", daemon.metrics_port), timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\n" + b"X: y\r\n" * 12000 + b"\r\n")  # 72 KB of short lines
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 431 ")  # headers over 64 KiB together
    assert daemon.metric("kvswap_http_refused_total", reason="too_large") == 2
    assert daemon.http("/healthz") == (200, "ok\n")
    assert "Traceback" not in daemon.log()


def test_a_slow_request_is_cut_off_at_the_header_deadline(daemon: DaemonProcess) -> None:
    with socket.create_connection(("127.0.0.1", daemon.metrics_port), timeout=30) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
        started = time.monotonic()
        for _ in range(20):  # one header line every 0.5 s: each line is in time, the head never ends
            try:
                s.sendall(b"X-Slow: 1\r\n")
            except OSError:
                break
            if _readable(s):  # the daemon closed it
                break
            time.sleep(0.5)
        assert wait_until(lambda: daemon.metric("kvswap_http_refused_total", reason="deadline") == 1, 10)
    assert time.monotonic() - started < 9  # cut at the 5 s deadline, not after 20 lines


def _readable(s: socket.socket) -> bool:
    import select

    return bool(select.select([s], [], [], 0)[0])


# -- smaller holes ------------------------------------------------------------------------------


@pytest.mark.parametrize("where,field,value", [
    ("regions", "stride", 2**61),
    ("layout", "num_blocks", 2**62),
    ("layout", "head_dim", 2**62),
])
def test_huge_layout_numbers_are_invalid_layout(daemon: DaemonProcess, cache: HostKVCache, where: str, field: str,
                                                value: int) -> None:
    registration = cache.registration()
    if where == "regions":
        registration["regions"][0][field] = value
    else:
        registration["layout"][field] = value
    with Client(daemon.endpoint, timeout=10) as c:
        with pytest.raises(InvalidLayout) as err:  # it was "internal: unencodable reply"
            c.register(registration)
    assert "unencodable" not in daemon.log()
    assert err.value.code == "invalid_layout"


def test_a_storage_root_writable_by_others_is_warned_about(tmp_path: Path) -> None:
    root = tmp_path / "open"
    root.mkdir()
    os.chmod(root, 0o777)
    d = DaemonProcess(root, free_port(), free_port()).start()
    try:
        assert f"the storage directory {root} is writable by everyone (mode 0777)" in d.log()
    finally:
        assert d.stop() == 0
    private = tmp_path / "private"
    d = DaemonProcess(private, free_port(), free_port()).start()  # created 0700 by the daemon
    try:
        assert "is writable by" not in d.log()
    finally:
        assert d.stop() == 0
