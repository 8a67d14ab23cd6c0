"""The load test, longer: 16 clients doing mixed swap_out / swap_in / lookup against one
kvswapd for 60 s (tests/test_load.py runs the same for 10 s in CI).

    python benchmarks/load.py                           # 16 clients, 60 s
    python benchmarks/load.py --clients 32 --seconds 300 -- --fsync data

Starts a daemon subprocess on free loopback ports with a fresh temporary directory (arguments
after ``--`` go to kvswapd), registers one shared cache of 256 blocks of 32 KiB, and runs one
thread with its own client per engine, each owning a slice of the blocks. Every reply is
counted by id (lost, duplicated, stray), every loaded block is compared byte for byte, and a
client stuck on an answer counts as a deadlock. Prints p50/p99 latency per op and the daemon's
RSS (every 10 s, and its peak); exits 1 if any check failed. Latency is reported, not judged:
the clients share one Python process with the GIL, so on a small machine they, not the
daemon, are often the bottleneck.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from kvswap.testing.daemon_process import DaemonProcess, free_port
from kvswap.testing.load_driver import run_load


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("daemon_args", nargs="*", help="extra kvswapd flags, after --")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvswap-load-") as tmp:
        daemon = DaemonProcess(Path(tmp) / "store", free_port(), free_port(), extra_args=args.daemon_args).start()
        assert daemon.proc is not None
        print(f"load: {args.clients} clients, {args.seconds:.0f} s, daemon pid {daemon.proc.pid} "
              f"{' '.join(args.daemon_args)}", flush=True)
        try:
            report = run_load(daemon.endpoint, daemon.proc.pid, clients=args.clients, duration_s=args.seconds,
                              seed=args.seed, report_every_s=10.0, say=lambda s: print(s, flush=True))
        finally:
            code = daemon.stop()
        print(report.summary())
        print(f"daemon exit code after SIGTERM: {code}")
        if not report.ok or code != 0:
            print("FAILED:", "; ".join(report.wrong_answers[:5]) or dict(report.errors))
            return 1
        print("OK: no lost or duplicated replies, every loaded byte verified, no client stuck")
        return 0


if __name__ == "__main__":
    sys.exit(main())
