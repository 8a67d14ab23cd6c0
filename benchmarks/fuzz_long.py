"""The long protocol fuzz: 100,000+ hostile frames against one live kvswapd.

    python benchmarks/fuzz_long.py                     # 100,000 frames, random seed
    python benchmarks/fuzz_long.py --frames 500000 --seed 42

Starts a daemon subprocess on free loopback ports with a fresh temporary directory, registers
a small cache, and sends batches from the generators of tests/test_fuzz.py (random bytes,
truncated msgpack, wrong types, huge lists, bad keys, out-of-range block ids, valid ops with
garbage fields, registrations that must be refused) until the frame count is reached. Every
frame must get exactly one well-formed answer with a typed code, and the ping after every
batch must be answered. Prints counts by frame kind and by answer code, the elapsed time and
the daemon's memory; exits 1 at the first violation (hypothesis shrinks it first) or if the
daemon dies.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, seed, settings

from kvswap.protocol import Client, HostKVCache
from kvswap.testing.daemon_process import DaemonProcess, free_port
from kvswap.testing.fuzz_frames import LAYOUT, FuzzFailure, FuzzSession, batch_strategy, canonical_frames
from kvswap.testing.load_driver import proc_status

#: Batches per hypothesis run; between runs the progress line is printed.
CHUNK = 500


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=100_000, help="stop after at least this many frames")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random, printed)")
    args = parser.parse_args()
    run_seed = args.seed if args.seed is not None else random.randrange(2**32)
    print(f"fuzz_long: {args.frames} frames, seed {run_seed}", flush=True)

    with tempfile.TemporaryDirectory(prefix="kvswap-fuzz-") as tmp:
        daemon = DaemonProcess(Path(tmp) / "store", free_port(), free_port()).start()
        assert daemon.proc is not None
        session = FuzzSession(daemon.endpoint)
        failure: str | None = None
        started = time.monotonic()
        try:
            with HostKVCache.create(LAYOUT) as cache:
                cache.fill_random(seed=11)
                with Client(daemon.endpoint, timeout=10) as c:
                    c.register(cache)
                rss_start = proc_status(daemon.proc.pid)["VmRSS"]

                @seed(run_seed)
                @settings(max_examples=CHUNK, deadline=None, database=None, phases=[Phase.generate, Phase.shrink],
                          suppress_health_check=list(HealthCheck), print_blob=True)
                @given(batch_strategy)
                def one_batch(frames) -> None:
                    session.run_batch(frames)
                    if not daemon.alive:
                        raise FuzzFailure(f"the daemon exited with {daemon.proc.poll()}")

                session.run_batch(canonical_frames())
                round_ = 0
                while session.frames < args.frames:
                    # A new seed per round: the same seed would replay the same batches.
                    one_batch = seed(run_seed + round_)(one_batch)
                    one_batch()
                    round_ += 1
                    elapsed = time.monotonic() - started
                    print(f"  {session.frames:>8d} frames  {elapsed:7.1f} s  {session.frames / elapsed:6.0f}/s  "
                          f"daemon RSS {proc_status(daemon.proc.pid)['VmRSS'] / 1024:.1f} MiB", flush=True)
                session.finish()
                with Client(daemon.endpoint, timeout=10) as c:
                    registered = c.stats()["registered"]
                if not registered:
                    failure = "the registration was lost during the fuzz"
        except FuzzFailure as exc:
            failure = str(exc)
        finally:
            session.close()
            elapsed = time.monotonic() - started
            status = proc_status(daemon.proc.pid) if daemon.alive else {"VmRSS": 0, "VmHWM": 0}
            code = daemon.stop()
        print(f"\nframes: {session.frames} in {elapsed:.1f} s ({session.frames / max(elapsed, 1e-9):.0f}/s)")
        print("by kind:  " + ", ".join(f"{k} {n}" for k, n in session.kinds.most_common()))
        print("answers:  " + ", ".join(f"{k} {n}" for k, n in session.codes.most_common()))
        print(f"daemon RSS: {rss_start / 1024:.1f} MiB after registering, {status['VmRSS'] / 1024:.1f} MiB at the end, "
              f"peak {status['VmHWM'] / 1024:.1f} MiB; exit code after SIGTERM {code}")
        if failure is not None or code != 0:
            print(f"FAILED: {failure or f'daemon exit code {code}'}\nlast daemon log lines:\n"
                  + "\n".join(daemon.log().splitlines()[-20:]))
            return 1
        print("OK: every frame answered exactly once with a typed code; the daemon stayed up")
        return 0


if __name__ == "__main__":
    sys.exit(main())
