"""A hostile peer for kvswapd, run as its own process (``python tests/hostile_peer.py``) so
its CPU time and memory are not the test's: it floods the control socket with large frames.

    python tests/hostile_peer.py ENDPOINT KIND COUNT RATE READ

KIND is ``wide`` (a 2.8 MB map of 350,000 unknown fields, the frame that stalled the loop for
0.25 s each), ``nested`` (a 4 MB lookup whose keys are 4 million nested empty maps: 1.8 s to
decode without shape limits), ``mixed`` (the two in turn) or ``echo`` (16 unknown fields with
240 KB names: a reply that repeated them was 3.8 MB) or ``swap_out`` (the largest valid swap_out,
8,192 keys of 128 characters: 1.1 MB). COUNT frames (0: until killed) at RATE
frames per second (0: as fast as the socket takes them). READ is 1 to read replies, 0 never to
read them (its socket holds at most one reply). Prints ``sent N`` at the end.
"""

from __future__ import annotations

import sys
import time

import msgpack
import zmq


def frame(kind: str, request_id: int) -> bytes:
    head = {"v": 1, "id": request_id}
    if kind == "wide":
        return msgpack.packb({**head, "op": "ping", **{f"f{i}": None for i in range(350_000)}})
    if kind == "nested":
        return msgpack.packb({**head, "op": "lookup", "keys": [[{}] * 8000] * 500})
    if kind == "swap_out":  # the largest valid swap_out: 8,192 keys of 128 characters
        return msgpack.packb({**head, "op": "swap_out", "block_ids": list(range(8192)),
                              "keys": [f"{request_id}-{i:07d}".ljust(128, "k") for i in range(8192)]})
    if kind == "echo":
        return msgpack.packb({**head, "op": "ping", **{f"{i:02d}" + "x" * 240_000: None for i in range(16)}})
    raise SystemExit(f"unknown kind {kind}")


def main(endpoint: str, kind: str, count: int, rate: float, read: bool) -> None:
    kinds = ["wide", "nested"] if kind == "mixed" else [kind]
    frames = [frame(k, 1000 + i) for i, k in enumerate(kinds)]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if not read:
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(endpoint)
    sent = 0
    started = time.monotonic()
    while count == 0 or sent < count:
        sock.send(frames[sent % len(frames)])
        sent += 1
        while read and sock.poll(0, zmq.POLLIN):
            sock.recv()
        if rate:
            time.sleep(max(0.0, started + sent / rate - time.monotonic()))
    print(f"sent {sent}", flush=True)
    if not read:
        time.sleep(3600)  # hold the connection, unread, until the test kills us


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5] == "1")
