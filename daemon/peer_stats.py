"""What daemon-to-daemon transfers did, as Prometheus series (in the daemon's own registry) and
as the plain counts ``stats`` shows under ``peer``: the same numbers, from one place."""

from __future__ import annotations

from collections import Counter as Tally
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Pull times: a few records over loopback to a wait for a prefill's swap_out.
PULL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

#: Why a pull from a peer stopped short (``kvswap_peer_pull_failures_total{reason}``).
FAILURE_REASONS = ("unreachable", "timeout", "refused", "malformed", "transfer", "corrupt", "no_staging",
                   "export_busy")


class PeerStats:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self._pulled_records = Counter("kvswap_peer_pulled_records", "Records pulled from peer daemons and stored "
                                       "here (lookup with peer).", registry=r)
        self._pulled_bytes = Counter("kvswap_peer_pulled_bytes", "Payload bytes of the records pulled from peers.",
                                     registry=r)
        self._pull_seconds = Histogram("kvswap_peer_pull_duration_seconds", "Time of one pull from a peer (one "
                                       "lookup's), waiting for keys on their way included.", buckets=PULL_BUCKETS,
                                       registry=r)
        self._exports = Counter("kvswap_peer_exports", "peer_export requests answered with records, by transport.",
                                ["transport"], registry=r)
        self._exported_records = Counter("kvswap_peer_exported_records", "Records exported to peers.", registry=r)
        self._leases_expired = Counter("kvswap_peer_leases_expired", "Export leases a peer did not release in "
                                       "time; their buffer slots were freed.", registry=r)
        self._failures = Counter("kvswap_peer_pull_failures", "Pulls from a peer that stopped short, by reason: "
                                 + ", ".join(FAILURE_REASONS) + ".", ["reason"], registry=r)
        self.export_buffer_used = Gauge("kvswap_peer_export_buffer_bytes", "Bytes of the export buffer holding "
                                        "records for peers (used) and its size (size).", ["state"], registry=r)
        self.pulled_records = 0
        self.pulled_bytes = 0
        self.exports = 0
        self.exported_records = 0
        self.leases_expired = 0
        self.failures: Tally[str] = Tally()

    def pulled(self, records: int, nbytes: int) -> None:
        self.pulled_records += records
        self.pulled_bytes += nbytes
        self._pulled_records.inc(records)
        self._pulled_bytes.inc(nbytes)

    def pull_took(self, seconds: float) -> None:
        self._pull_seconds.observe(seconds)

    def exported(self, records: int, nbytes: int, transport: str) -> None:
        if records:
            self.exports += 1
            self.exported_records += records
            self._exports.labels(transport=transport).inc()
            self._exported_records.inc(records)

    def lease_expired(self) -> None:
        self.leases_expired += 1
        self._leases_expired.inc()

    def count_failure(self, reason: str) -> None:
        self.failures[reason] += 1
        self._failures.labels(reason=reason).inc()

    def describe(self) -> dict[str, Any]:
        return {"pulled_records": self.pulled_records, "pulled_bytes": self.pulled_bytes, "exports": self.exports,
                "exported_records": self.exported_records, "leases_expired": self.leases_expired,
                "pull_failures": dict(self.failures)}
