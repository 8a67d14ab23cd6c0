"""The prefill/decode transfer benchmark's smoke run: seconds, every field of its report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "pd_transfer.py"


def test_pd_transfer_smoke_reports_direct_against_its_baselines(tmp_path: Path) -> None:
    out = tmp_path / "pd.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--transport", "inline", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert json.loads(proc.stdout) == report
    assert report["records"] == 8 and report["record_bytes"] == 256 * 1024
    direct = report["direct"]
    assert direct["records"] == 8 and direct["bytes"] == 8 * 256 * 1024 and direct["seconds"] > 0
    assert direct["transport"] == "inline" and direct["bytes_checked"] is True
    assert report["memcpy"]["bytes"] == direct["bytes"] and report["memcpy"]["seconds"] > 0
    if report["te_alone"] is not None:  # where Mooncake's transfer engine imports
        assert report["te_alone"]["bytes"] == direct["bytes"]
        assert report["ratios"]["direct_over_te_alone"] > 0
    assert report["ratios"]["direct_over_memcpy"] > 0
    assert "direct" in proc.stderr  # progress went to stderr
