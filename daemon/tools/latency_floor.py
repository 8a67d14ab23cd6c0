"""The load and the floor of ``kvswap bench``'s latency phase, each in a process of its own.

- **The stream**: a client that keeps 32-block swap_outs (answered "copied") going at a daemon
  until told to stop (:class:`StreamProcess`). In its own process, so the client that times
  pings and lookups shares no GIL with it.
- **The echo floor**: a bare pyzmq + msgpack server (:func:`serve_echo`) on the daemon's socket
  type (ROUTER), which decodes each frame and answers a reply of the daemon's shape: a ping
  ``{"pong": true}``, a lookup ``{"hits": n}`` for its n keys. It does nothing else, so its
  latency, timed alternately with the daemon's in the same window under the same stream, is
  what this machine's scheduling and ZMQ cost any Python server; the daemon's ratio to it is
  what the daemon itself adds.

Both run as ``python -m kvswap.daemon.tools.latency_floor echo|stream ...`` (no pickle, so no
multiprocessing): the echo server prints its endpoint and serves until it is terminated; the
stream prints ``ready`` once its first swap_out was accepted and, when its stdin closes, stops
and prints how many blocks were accepted.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from typing import IO

import msgpack
import zmq

#: How long a child has to say it is up.
START_TIMEOUT_S = 60.0


# -- the echo server ------------------------------------------------------------------------------


def echo_reply(frame: bytes | memoryview) -> bytes:
    """The echo server's answer to one request frame: the daemon's reply shape, with a ping's
    or a lookup's result (the lookup's keys decoded and counted; every key a hit, as every key
    the bench looks up is stored): ``{"v": 1, "id": 7, "op": "lookup", "keys": ["a", "b"]}`` is
    answered ``{"v": 1, "id": 7, "ok": true, "result": {"hits": 2}}``."""
    msg = msgpack.unpackb(frame, raw=False)
    result = {"hits": len(msg.get("keys") or ())} if msg.get("op") == "lookup" else {"pong": True}
    return msgpack.packb({"v": 1, "id": msg.get("id"), "ok": True, "result": result}, use_bin_type=True)


def serve_echo(host: str = "127.0.0.1", out: IO[str] = sys.stdout) -> None:
    """Bind a ROUTER on a free port of ``host``, print its endpoint, answer frames forever."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://{host}:0")
    print(sock.getsockopt_string(zmq.LAST_ENDPOINT), file=out, flush=True)
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) < 2:
            continue
        try:
            reply = echo_reply(frames[-1].buffer)
        except Exception:  # not a request: a real server answers something; the bench never sends one
            continue
        sock.send_multipart([*(f.bytes for f in frames[:-1]), reply])


class EchoServer:
    """The echo server in its own process: ``with EchoServer() as echo: Client(echo.endpoint)``."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.endpoint = ""

    def __enter__(self) -> "EchoServer":
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, "echo"], stdout=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        self.endpoint = _first_line(self.proc, "the echo server")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(30)


# -- the stream -------------------------------------------------------------------------------------


def run_stream(endpoint: str, blocks: int, batch: int, prefix: str, token: str, stop: threading.Event,
               out: IO[str] = sys.stdout) -> int:
    """swap_out batches of ``batch`` of the first ``blocks`` blocks under fresh keys, for the
    registration ``token`` names (it was made by another process), until ``stop``; a refused
    one (busy) is retried after a short pause. Prints ``ready`` after the first accepted one.
    Returns the blocks accepted."""
    from kvswap.protocol import Client, KvswapError
    from kvswap.protocol import messages as m

    batches = [list(range(s, min(s + batch, blocks))) for s in range(0, blocks, batch)]
    accepted = 0
    with Client(endpoint, timeout=60) as c:
        n = 0
        while not stop.is_set():
            ids = batches[n % len(batches)]
            try:
                c.call(m.SwapOut, {"block_ids": tuple(ids), "keys": tuple(f"{prefix}-{n}-{i}" for i in ids),
                                   "wait": "copied", "token": token})
                if not accepted:
                    print("ready", file=out, flush=True)
                accepted += len(ids)
            except KvswapError:
                time.sleep(0.002)
            n += 1
    return accepted


class StreamProcess:
    """A client in its own process that keeps swap_outs (answered "copied") going over the
    first ``blocks`` blocks, ``batch`` a request, for the registration ``token`` names, until
    stopped: the load the latency measurements run under. :meth:`start` returns once the daemon
    accepted the first one; after :meth:`stop`, ``blocks`` counts the blocks it got accepted.
    The token goes over the child's stdin, not its command line (which ``ps`` shows)."""

    def __init__(self, endpoint: str, blocks: int, batch: int, prefix: str, token: str) -> None:
        self.endpoint, self.span, self.batch, self.prefix, self.token = endpoint, blocks, batch, prefix, token
        self.blocks = 0
        self.proc: subprocess.Popen | None = None

    def start(self) -> "StreamProcess":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, "stream", self.endpoint, "--blocks", str(self.span), "--batch",
             str(self.batch), "--prefix", self.prefix], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdin is not None
        self.proc.stdin.write(self.token + "\n")
        self.proc.stdin.flush()
        if _first_line(self.proc, "the swap_out stream") != "ready":
            self.stop()
            raise RuntimeError("the swap_out stream did not start")
        return self

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        self.proc = None
        try:
            out, _ = proc.communicate(timeout=120)  # closes its stdin: it stops and says its count
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        counts = [word for word in out.split() if word.isdigit()]
        self.blocks = int(counts[-1]) if counts else 0


def _first_line(proc: subprocess.Popen, what: str) -> str:
    """The first line a child prints, within START_TIMEOUT_S (it is killed otherwise)."""
    assert proc.stdout is not None
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(START_TIMEOUT_S)
    if not line or not line[0].strip():
        proc.kill()
        proc.wait()
        raise RuntimeError(f"{what} did not start (exit code {proc.poll()})")
    return line[0].strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("echo", help="serve the echo floor on a free loopback port; print the endpoint")
    stream = sub.add_parser("stream", help="stream swap_outs at ENDPOINT for the registration whose token is stdin's "
                            "first line, until stdin closes; print the blocks")
    stream.add_argument("endpoint")
    stream.add_argument("--blocks", type=int, required=True)
    stream.add_argument("--batch", type=int, default=32)
    stream.add_argument("--prefix", default="s")
    args = parser.parse_args(argv)
    if args.what == "echo":
        serve_echo()
        return
    token = sys.stdin.readline().strip()
    stop = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    print(run_stream(args.endpoint, args.blocks, args.batch, args.prefix, token, stop), flush=True)


if __name__ == "__main__":
    main()
