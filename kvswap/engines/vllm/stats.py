"""What the vLLM connector counts: lookups and their latency as the engine saw them, the load
policy's decisions, and the workers' loads and saves. Written as JSON to ``stats_file`` (when
configured) every few seconds and at shutdown, and logged at shutdown."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

#: Lookup latencies kept for the percentiles (the most recent ones).
MAX_SAMPLES = 100_000
WRITE_EVERY_S = 2.0


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (0 for an empty one).

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50), percentile([1.0, 2.0, 3.0, 4.0], 99)
    (2.0, 4.0)
    """
    if not sorted_values:
        return 0.0
    rank = max(1, -(-len(sorted_values) * q // 100))
    return sorted_values[int(rank) - 1]


def _milliseconds(samples: deque[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"n": len(ordered), "p50": percentile(ordered, 50) * 1e3, "p99": percentile(ordered, 99) * 1e3,
            "max": ordered[-1] * 1e3 if ordered else 0.0}


class ConnectorStats:
    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.lookup_s: deque[float] = deque(maxlen=MAX_SAMPLES)
        #: Scheduler time the connector took per new request (its lookups' calls and planning
        #: its load, until vLLM admitted it) and per step (building the step's metadata).
        self.admit_s: deque[float] = deque(maxlen=MAX_SAMPLES)
        self.step_s: deque[float] = deque(maxlen=MAX_SAMPLES)
        self.counts: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        #: More parts of the summary, each read when it is written (the KV events forwarder's counts).
        self.sections: dict[str, Callable[[], dict[str, Any]]] = {}
        self._written = 0.0

    def lookup(self, seconds: float, keys: int, hits: int) -> None:
        self.lookup_s.append(seconds)
        self.counts["lookups"] += 1
        self.counts["lookup_keys"] += keys
        self.counts["lookup_hits"] += hits

    def admitted(self, seconds: float) -> None:
        self.admit_s.append(seconds)

    def step(self, seconds: float) -> None:
        self.step_s.append(seconds)

    def decision(self, reason: str, tokens: int) -> None:
        self.counts[f"decision_{reason}"] += 1
        self.counts["tokens_claimed" if reason != "slower" else "tokens_refused"] += tokens

    def error(self, op: str, exc: Exception) -> None:
        self.errors[f"{op}:{getattr(exc, 'code', type(exc).__name__)}"] += 1

    def worker(self, report: Any, block_size: int) -> None:
        self.counts["tokens_loaded"] += report.loaded_blocks * block_size
        self.counts["tokens_load_failed"] += report.failed_blocks * block_size
        self.counts["blocks_saved"] += report.saved_blocks
        self.counts["save_failures"] += report.save_failures
        self.counts["save_ms"] += round(report.save_s * 1e3)
        self.counts["save_waits"] += report.save_waits
        self.counts["load_calls"] += len(report.load_samples)
        self.counts["load_ms"] += round(sum(s for _, s in report.load_samples) * 1e3)

    def summary(self, policy: Any) -> dict[str, Any]:
        return {"counts": dict(self.counts), "errors": dict(self.errors),
                "lookup_ms": _milliseconds(self.lookup_s), "scheduler_per_request_ms": _milliseconds(self.admit_s),
                "scheduler_per_step_ms": _milliseconds(self.step_s),
                "policy": policy.describe(), **{name: read() for name, read in self.sections.items()}}

    def maybe_write(self, policy: Any) -> None:
        if self.path and time.monotonic() - self._written >= WRITE_EVERY_S:
            self.write(policy)

    def write(self, policy: Any) -> None:
        """Replace ``path`` atomically (0600) with the current summary."""
        if not self.path:
            return
        self._written = time.monotonic()
        directory = os.path.dirname(os.path.abspath(self.path))
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".kvswap-stats-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.summary(policy), f)
            os.replace(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise
