"""A seconds-long smoke of ``kvswap bench``: every field is produced, with its baseline from
the same run. It asserts no timing, only that the numbers exist and the data round-tripped
(the bench raises if a swap_in does not load every block)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from disk_records import records_on_disk

EXPECTED = {
    "swap_out copied": "memcpy",
    "swap_out copied, until written": "write",
    "swap_out persisted": "write",
    "swap_out persisted, 2 in flight": "write",
    "swap_out persisted, RAM tier's first fill": "write",
    "swap_out copied, one request of 16, idle": "memcpy",
    "swap_in cold": "O_DIRECT read x4",
    "swap_in warm (page cache)": "buffered warm read x4",
    "host layout conversion": "memcpy into slots",
    "host layout conversion vs bulk": "memcpy bulk",
    "ping p99 under load vs echo floor": "echo ping p99",
    "lookup 1000 keys p99 under load vs echo floor": "echo lookup 1000 keys p99",
}
ALTERNATED = ["swap_out copied, until written", "swap_out persisted", "swap_out persisted, 2 in flight",
              "swap_in cold"]
UNBASED = ["swap_out copied latency p50", "swap_out copied latency p99", "ping p50 under load",
           "ping p99 under load", "lookup 1000 keys p50 under load", "lookup 1000 keys p99 under load",
           "echo ping p50 under load", "echo ping p99 under load", "echo lookup 1000 keys p50 under load",
           "echo lookup 1000 keys p99 under load",
           "blocks streamed meanwhile", "swap_out stream meanwhile", "daemon CPU while swapping", "daemon CPU idle",
           "swap_in hot, blocks read"]


def test_bench_quick_produces_every_field(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvswap.daemon.tools.admin", "bench", "--quick", "--json", "--storage-dir",
         str(tmp_path / "bench")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["preset"] == "tiny" and data["blocks"] == 64
    results = data["results"]
    hot = {name for name in results if name.startswith("swap_in hot (")}
    assert hot in ({"swap_in hot (RAM tier)"}, {"swap_in hot (no RAM tier)"}), hot
    assert results[hot.pop()]["baseline"] == "memcpy"
    assert set(results) - {"swap_in hot (RAM tier)", "swap_in hot (no RAM tier)"} == set(EXPECTED) | set(UNBASED)
    for name, baseline in EXPECTED.items():
        row = results[name]
        assert row["value"] > 0, name
        assert baseline in row["baseline"], (name, row["baseline"])
        assert row["baseline_value"] > 0 and row["ratio"] > 0
        assert abs(row["ratio"] - row["value"] / row["baseline_value"]) < 0.01 * row["ratio"] + 1e-3
    for name in UNBASED:
        assert results[name]["value"] >= 0 and results[name]["baseline"] is None
    assert data["cold_method"] == "O_DIRECT reads, no host tier"  # never drop_caches unless asked
    # The raw baselines use the daemon's thread counts, and say so.
    assert data["write_threads"] == 4 and data["read_threads"] == 4
    assert "x4" in results["swap_out persisted"]["baseline"]
    # Counts are integers; a p99 of 30 samples comes with a warning.
    assert results["blocks streamed meanwhile"]["value"] == int(results["blocks streamed meanwhile"]["value"])
    assert isinstance(results["blocks streamed meanwhile"]["value"], int)
    # Hot reads cover only what the RAM tier holds (--quick: 1 MiB), never more than was written.
    hot_blocks = results["swap_in hot, blocks read"]["value"]
    assert isinstance(hot_blocks, int) and 0 < hot_blocks <= data["blocks"]
    if data["host_tier"]:
        assert hot_blocks * data["record_bytes"] <= 2**20 or hot_blocks == data["batch"]
    assert results["ping p99 under load"]["samples"] == 30
    # The echo floor was timed in the same window, as often as the daemon, and the ratio rows
    # divide the daemon's p99 by it.
    for name in ("ping", "lookup 1000 keys"):
        assert results[f"echo {name} p99 under load"]["samples"] == 30
        floor = results[f"{name} p99 under load vs echo floor"]
        assert floor["value"] == results[f"{name} p99 under load"]["value"]
        assert floor["baseline_value"] == results[f"echo {name} p99 under load"]["value"]
    assert any("ping p99 under load: only 30 samples" in w for w in data["warnings"])
    assert "CPUs" in data["machine"] and data["fsync"] == "none"
    # The conversion is the shared-memory mover's gather, and the report names its copy path.
    assert data["conversion_copy"] in ("native", "preadv")
    # The disk rows took turns with their raw baselines (--quick: 2 rounds), each round's ratio
    # kept; the rows' own ratio is bytes over summed seconds, so it lies within the rounds'.
    assert data["rounds"] == 2
    for name in ALTERNATED:
        row = results[name]
        assert row["baseline"].endswith(", alternated") and len(row["round_ratios"]) == 2, name
        assert min(row["round_ratios"]) * 0.99 <= row["ratio"] <= max(row["round_ratios"]) * 1.01, (name, row)
    assert "round_ratios" not in results["swap_in warm (page cache)"]
    # The bench cleans up after itself: no record left in either file layout, nor its raw file.
    assert records_on_disk(tmp_path / "bench") == []
    assert not [p for p in (tmp_path / "bench").iterdir() if p.name.startswith(".bench-raw")]


def test_bench_plot_without_matplotlib_fails_before_measuring(tmp_path: Path) -> None:
    """--plot checks for matplotlib first: an operator without it learns in a second, not
    after minutes of measuring (the 'baselines' progress line never appears)."""
    shim = tmp_path / "shim" / "matplotlib"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('matplotlib hidden by the test')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "shim")}
    result = subprocess.run(
        [sys.executable, "-m", "kvswap.daemon.tools.admin", "bench", "--quick", "--plot", str(tmp_path / "p.png"),
         "--storage-dir", str(tmp_path / "bench")], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1, result.stderr
    assert "--plot needs matplotlib" in result.stderr
    assert "baselines" not in result.stderr
    assert not (tmp_path / "bench").exists()


def test_peers_smoke_prints_every_column_with_kvswap_first(tmp_path: Path) -> None:
    """benchmarks/peers.py on a few small blocks, LMCache left out (its environment is not part
    of the test set-up): kvswap's row is the reference (1.00 in every 'x kvswap' column), the
    FileStore method's row has three positive rates. The script raises if any system read back
    other bytes than it wrote."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "peers.py"
    result = subprocess.run([sys.executable, str(script), "--blocks", "8", "--block-mib", "1", "--storage-dir",
                             str(tmp_path), "--skip", "lmcache"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split("  ")[0].strip(): line for line in result.stdout.splitlines()
            if line.startswith(("kvswap ", "FileStore method"))}
    assert set(rows) == {"kvswap", "FileStore method"}, result.stdout
    ours = rows["kvswap"].split()
    assert ours[2:7:2] == ["1.00", "1.00", "1.00"] and all(float(v) > 0 for v in ours[1:6:2]), ours
    theirs = rows["FileStore method"].split()[2:8]
    assert all(float(v) > 0 for v in theirs), theirs
    assert "hot from the RAM tier" in rows["kvswap"]


def test_rounds_cut_batches_in_order_and_alternate_who_goes_first() -> None:
    from kvswap.daemon.tools.bench import Alternation, in_rounds

    batches = [[0, 1], [2, 3], [4, 5], [6]]
    assert in_rounds(batches, 2) == [[[0, 1], [2, 3]], [[4, 5], [6]]]
    assert in_rounds(batches, 3) == [[[0, 1], [2, 3]], [[4, 5], [6]]]  # whole batches: 2 a round
    assert in_rounds(batches, 9) == [[b] for b in batches]
    assert in_rounds(batches, 1) == [batches]
    order: list[str] = []

    def timed(who: str, seconds: float):
        def run() -> float:
            order.append(who)
            return seconds
        return run

    alt = Alternation()
    for d, r in ((1.0, 2.0), (4.0, 1.0), (1.0, 1.0)):
        alt.round(100, 200, timed("daemon", d), timed("raw", r))
    assert order == ["daemon", "raw", "raw", "daemon", "daemon", "raw"]
    # Per round: (100 B / d s) / (200 B / r s); overall: the bytes and seconds summed.
    assert alt.ratios == [1.0, 0.125, 0.5]
    assert (alt.daemon_s, alt.raw_s) == (6.0, 4.0)
    assert abs(alt.gbps - 300 / 6.0 / 1e9) < 1e-18 and abs(alt.raw_gbps - 600 / 4.0 / 1e9) < 1e-18
