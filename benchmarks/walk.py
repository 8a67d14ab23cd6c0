"""The walk of one request through the daemon: which modules and functions of kvswap a swap_in
passes, and how often it hops between threads.

    python benchmarks/walk.py [--json]

A daemon runs in this process (its threads inherit a profile hook), a shared-memory cache is
registered and a few blocks stored; then one swap_in is traced for each case:

- ``ram``: every key is in the RAM tier (the host pool);
- ``file``: the RAM tier is off, every key is read from the file tier.

For each it prints the kvswap modules and functions the daemon called while serving that one
request (the client's own calls are not counted) and the thread segments: runs of consecutive
calls on one thread, so a request answered on the loop after a copy thread's work is 3
segments. Everything is counted on the daemon's side between the request's arrival and its
answer, plus what it leaves running afterwards (a touch of the hit chain) until the daemon is
idle again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any

from kvswap.daemon.config import Config
from kvswap.daemon.server import Daemon
from kvswap.protocol import CacheLayout, Client, HostKVCache

LAYOUT = CacheLayout("walk", num_layers=2, num_blocks=32, block_size=8, num_kv_heads=2, head_dim=16)
BLOCKS = 4


class Tracer:
    """A profile hook on every daemon thread; records kvswap calls while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.client_thread = threading.get_ident()
        self.calls: list[tuple[int, str, str]] = []

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        module = frame.f_globals.get("__name__", "?")
        if not module.startswith("kvswap."):
            return
        thread = threading.get_ident()
        if thread == self.client_thread:
            return
        self.calls.append((thread, module, frame.f_code.co_qualname))

    def summary(self) -> dict[str, Any]:
        segments = 0
        last = None
        for thread, _, _ in self.calls:
            if thread != last:
                segments += 1
                last = thread
        modules = sorted({m for _, m, _ in self.calls})
        functions = sorted({f"{m}.{f}" for _, m, f in self.calls})
        return {"modules": len(modules), "functions": len(functions), "thread_segments": segments,
                "threads": len({t for t, _, _ in self.calls}), "calls": len(self.calls),
                "module_names": modules,
                "calls_per_module": dict(Counter(m for _, m, _ in self.calls).most_common())}


def walk(case: str, tracer: Tracer, tmp: str) -> dict[str, Any]:
    # Background timers far apart: what is traced is the request's own work.
    config = Config(cache_queue_port=0, metrics_port=0, storage_dir=f"{tmp}/{case}",
                    host_tier_bytes=(8 << 20) if case == "ram" else 0, engine_check_interval_s=3600,
                    maintenance_interval_s=3600, remote_check_interval_s=3600)
    daemon = Daemon(config)
    loop_ready = threading.Event()

    def main() -> None:
        loop = asyncio.new_event_loop()
        loop_ready.set()
        loop.run_until_complete(daemon.serve())
        loop.close()

    thread = threading.Thread(target=main, name="kvswapd-walk", daemon=True)
    thread.start()
    while not daemon.serving:
        time.sleep(0.01)
    keys = [f"walk-{i}" for i in range(BLOCKS)]
    with HostKVCache.create(LAYOUT) as cache, Client(f"tcp://127.0.0.1:{daemon.control_port}", timeout=10) as c:
        c.register(cache)
        assert c.swap_out(list(range(BLOCKS)), keys, wait="persisted").stored == BLOCKS
        c.swap_in(keys, list(range(10, 10 + BLOCKS)))  # warm: first calls build caches and pools
        time.sleep(0.5)  # let the warm request's background work end before tracing
        tracer.calls.clear()
        tracer.on = True
        result = c.swap_in(keys, list(range(16, 16 + BLOCKS)))
        time.sleep(0.5)  # what the request left running (a touch of its chain)
        tracer.on = False
        assert result.loaded == BLOCKS, result
        if case == "ram":
            assert daemon.metrics.registry.get_sample_value(
                "kvswap_tier_ops_total", {"tier": "file", "op": "get", "result": "hit"}) in (None, 0.0)
    daemon.request_exit()
    thread.join(30)
    return tracer.summary()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--modules", action="store_true", help="list the modules passed")
    args = parser.parse_args()
    tracer = Tracer()
    threading.setprofile(tracer)  # every thread the daemons start from here on
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in ("ram", "file"):
            report[case] = walk(case, tracer, tmp)
    threading.setprofile(None)  # type: ignore[arg-type]
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for case, r in report.items():
        print(f"{case}-hit swap_in: {r['modules']} modules, {r['functions']} functions, "
              f"{r['thread_segments']} thread segments on {r['threads']} threads ({r['calls']} calls)")
        if args.modules:
            for module, n in r["calls_per_module"].items():
                print(f"    {n:5d}  {module}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
