"""A seconds-long smoke of ``kvswap bench``: every field is produced, with its baseline from
the same run. It asserts no timing, only that the numbers exist and the data round-tripped
(the bench raises if a swap_in does not load every block)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXPECTED = {
    "swap_out copied": "memcpy",
    "swap_out copied, until written": "write",
    "swap_out persisted": "write",
    "swap_in hot": "memcpy",
    "swap_in cold": "read",
    "host layout conversion": "memcpy into slots",
    "host layout conversion vs bulk": "memcpy bulk",
}
UNBASED = ["swap_out copied latency p50", "swap_out copied latency p99", "ping p50 under load",
           "ping p99 under load", "lookup 1000 keys p50 under load", "lookup 1000 keys p99 under load",
           "blocks streamed meanwhile", "daemon CPU while swapping", "daemon CPU idle"]


def test_bench_quick_produces_every_field(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvswap.daemon.tools.admin", "bench", "--quick", "--json", "--storage-dir",
         str(tmp_path / "bench")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["preset"] == "tiny" and data["blocks"] == 64
    results = data["results"]
    assert set(results) == set(EXPECTED) | set(UNBASED)
    for name, baseline in EXPECTED.items():
        row = results[name]
        assert row["value"] > 0, name
        assert baseline in row["baseline"], (name, row["baseline"])
        assert row["baseline_value"] > 0 and row["ratio"] > 0
        assert abs(row["ratio"] - row["value"] / row["baseline_value"]) < 0.01 * row["ratio"] + 1e-3
    for name in UNBASED:
        assert results[name]["value"] >= 0 and results[name]["baseline"] is None
    assert data["cold_method"]
    # The bench cleans up after itself.
    assert not any((tmp_path / "bench").rglob("*.kvr"))
