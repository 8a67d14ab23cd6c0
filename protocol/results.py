"""The results of swap_out and swap_in, defined once: the daemon builds them, the wire carries
them as maps (docs/protocol.md), the clients hand them to the engine.

A swap_out's counts follow from its per-key statuses, so they are computed here and nowhere
else::

    >>> r = SwapOutResult.of(["queued", "exists", "queued", "no_space"])
    >>> (r.queued, r.exists, r.failed)
    (2, 1, 1)
    >>> SwapOutResult.from_wire(r.to_wire()) == r
    True
    >>> SwapInResult.of(["loaded", "loaded", "miss", "loaded"]).loaded   # the leading run
    2
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: swap_out statuses that are not failures (every other status is an error code).
SWAP_OUT_OK = ("queued", "stored", "exists", "skipped")


@dataclass(frozen=True)
class SwapOutResult:
    #: Per key: "queued" (copied; write pending), "stored" (persisted), "exists" (already
    #: stored, in flight or repeated in this request), "skipped" (partial request, no staging
    #: left), or an error code when its write failed.
    status: list[str]
    queued: int
    stored: int
    exists: int
    failed: int
    skipped: int = 0

    @classmethod
    def of(cls, status: list[str]) -> "SwapOutResult":
        counts = {name: status.count(name) for name in SWAP_OUT_OK}
        return cls(status, counts["queued"], counts["stored"], counts["exists"],
                   len(status) - sum(counts.values()), counts["skipped"])

    def to_wire(self) -> dict[str, Any]:
        return {"status": self.status, "queued": self.queued, "stored": self.stored, "exists": self.exists,
                "skipped": self.skipped, "failed": self.failed}

    @classmethod
    def from_wire(cls, r: dict[str, Any]) -> "SwapOutResult":
        return cls(r["status"], r["queued"], r["stored"], r["exists"], r["failed"], r.get("skipped", 0))


@dataclass(frozen=True)
class SwapInResult:
    #: How many leading keys were loaded into their blocks: the usable prefix.
    loaded: int
    #: Per key: "loaded", "miss", "corrupt" (found but failed its check; removed) or "error".
    status: list[str]
    #: How long the daemon worked on it, from taking it up to its answer (absent from daemons
    #: before issue 24): what a load costs, without the time its reply waited to be read.
    elapsed_s: float | None = None

    @classmethod
    def of(cls, status: list[str]) -> "SwapInResult":
        loaded = 0
        for s in status:
            if s != "loaded":
                break
            loaded += 1
        return cls(loaded, status)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"loaded": self.loaded, "status": self.status}
        if self.elapsed_s is not None:
            wire["elapsed_us"] = round(self.elapsed_s * 1e6)
        return wire

    @classmethod
    def from_wire(cls, r: dict[str, Any]) -> "SwapInResult":
        elapsed = r.get("elapsed_us")
        return cls(r["loaded"], r["status"], elapsed / 1e6 if isinstance(elapsed, (int, float)) else None)
