"""kvswapd's ``run(config)`` on the main thread of its own process, for tests that need one seam
of it held while it takes real signals:

    python tests/daemon_child.py PORT METRICS_PORT STORAGE_DIR MODE

MODE ``hold-writes``: every record write blocks for good (prints ``write held``), so a
persisted swap_out stays in flight through a drain: ``Disk.write_file`` of a ``.kvr`` file (the
files layout) and every ``Disk.write_at`` (a slab slot: the slab layout, the default). MODE ``handlers``: Python handlers are
installed for SIGTERM, SIGINT and SIGHUP before ``run``; after it returns the process prints
``restored`` if they are the ones in place again, else what is there. Exits with run's code.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from kvswap.backends.disk import Disk
from kvswap.backends.file_store import RECORD_SUFFIX
from kvswap.daemon import server
from kvswap.daemon.config import Config


def main(port: int, metrics_port: int, storage_dir: str, mode: str) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = Config(cache_queue_port=port, metrics_port=metrics_port, storage_dir=storage_dir, drain_timeout_s=120,
                    engine_check_interval_s=0.2)
    if mode == "hold-writes":
        never = threading.Event()
        write_file = Disk.write_file

        def hold() -> int:
            print("write held", flush=True)
            never.wait()
            return 0

        def held(self, tmp: str, final: str, parts: list, mtime_ns: int | None = None) -> int:
            if not final.endswith(RECORD_SUFFIX):  # namespace.json and the like go through
                return write_file(self, tmp, final, parts, mtime_ns)
            return hold()

        def held_at(self, fd: int, direct_fd: int | None, parts: list, offset: int) -> int:
            return hold()  # the slab layout writes nothing but records this way

        Disk.write_file = held  # type: ignore[method-assign]
        Disk.write_at = held_at  # type: ignore[method-assign]
        return server.run(config)
    handlers = {sig: (lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    code = server.run(config)
    now = {sig: signal.getsignal(sig) for sig in handlers}
    print("restored" if now == handlers else f"not restored: {now}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]))
