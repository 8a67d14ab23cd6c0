"""SIGKILL kvswapd at random instants under swap_out load, restart, verify every key.

    python benchmarks/crash_loop.py --cycles 200 [--dir /var/tmp/kvswap-crash] [--fsync none]
        [--layout slab|files]

The same harness as tests/test_crash_safety.py (8 cycles in CI), for longer runs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from kvswap.testing.crash_harness import crash_loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--fsync", choices=["none", "data", "strict"], default="none")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", choices=["slab", "files"], default="slab", help="the daemon's --file-layout")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvswap-crash-", dir=args.dir) as d:
        t = time.monotonic()
        r = crash_loop(Path(d) / "store", args.cycles, args.seed,
                       ("--fsync", args.fsync, "--file-layout", args.layout))
        print(f"layout {args.layout}, fsync {args.fsync}: {r.kills} kills in {time.monotonic() - t:.0f} s; {r.attempted:,} keys attempted, "
              f"{r.acknowledged:,} acknowledged persisted, {r.found_after_restart:,} present at the end, "
              f"{r.verified:,} byte-exact loads")
        print(f"wrong bytes served: {len(r.wrong)}; acknowledged-but-lost: {len(r.lost_persisted)}; "
              f"harness errors: {len(r.errors)}")
        sys.exit(1 if (r.wrong or r.lost_persisted or r.errors) else 0)


if __name__ == "__main__":
    main()
