"""A seconds-long smoke of benchmarks/kv_events_cost.py: the two daemons, the subscriber and
the three configurations run, every field is in the report, and every BlockStored event the
swap_outs made reached the subscriber. It asserts no timing, only counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from disk_records import records_on_disk

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kv_events_cost.py"
CONFIGS = ("off", "on", "on_meta")


def test_kv_events_cost_counts_every_event(tmp_path: Path) -> None:
    # matplotlib hidden, as on a machine without it: --plot says so in one line and the run succeeds.
    shim = tmp_path / "shim" / "matplotlib"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('matplotlib hidden by the test')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "shim")}
    report_path = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--records", "32", "--record-bytes", "16384", "--batch", "8", "--rounds", "2",
         "--lookup-keys", "8", "--lookups", "20", "--copied", "--storage-dir", str(tmp_path),
         "--json", str(report_path), "--plot", str(tmp_path / "cost.png")],
        capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "matplotlib is not installed" in result.stdout
    assert not (tmp_path / "cost.png").exists()
    assert "round 2/2 on+meta" in result.stderr  # progress lines while it runs

    data = json.loads(report_path.read_text())
    assert data["records"] == 32 and data["rounds"] == 2 and data["batch"] == 8
    assert data["record_bytes"] == 16384 and data["tiers"] == ["host", "file"]
    # Two configurations with events, two rounds each, persisted and copied swap_outs, each
    # record announced once per tier; on+meta's named by the engine's hashes and tokens.
    tiers = len(data["tiers"])
    assert data["events_expected"] == 2 * 2 * 2 * 32 * tiers
    assert data["events_received"] == data["events_expected"]
    assert data["events_with_meta_expected"] == 2 * 2 * 32 * tiers
    assert data["events_with_meta_received"] == data["events_with_meta_expected"]
    assert data["events_ok"] is True
    assert data["swap_outs_records_stored"] == 3 * 2 * 2 * 32
    sub = data["subscriber"]
    assert sub["decode_errors"] == 0 and sub["restarts"] == 0
    # Every stored record was announced in both media.
    assert sub["stored_cpu"] == sub["stored_storage"] == sub["stored"] // 2
    assert sub["stored"] == data["events_received"] + 32 * tiers  # plus the warm-up's
    assert len(data["per_round"]) == 2 * len(CONFIGS)
    assert [row["config"] for row in data["per_round"][:3]] == ["off", "on", "on+meta"]
    for row in data["per_round"]:
        if row["config"] != "off":
            assert row["events_received"] == row["events_expected"] == 2 * 32 * tiers
    for measure in ("swap_out_records_per_s", "swap_out_copied_records_per_s", "lookup_per_s"):
        for config in CONFIGS:
            assert data[f"{measure}_{config}"] > 0
    for prefix in ("swap_out", "swap_out_copied", "lookup"):
        assert data[f"{prefix}_ratio"] > 0 and data[f"{prefix}_meta_ratio"] > 0
    # The daemons' directories were in a temp dir under --storage-dir, removed at the end:
    # no record left in either file layout, nor a slab.
    assert records_on_disk(tmp_path) == [] and not any(tmp_path.rglob("*.slab"))
