"""The prefill/decode configuration examples in deploy/tiers/ load, and say what their comments
claim: decode stores to the remote pool, prefill retrieves from RAM then the pool."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "deploy" / "tiers"


def effective(name: str) -> str:
    result = subprocess.run([sys.executable, "-m", "kvswap.daemon", "--config", str(EXAMPLES / name),
                             "--print-config"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_decode_example_stores_to_the_remote_pool() -> None:
    out = effective("decode.toml")
    assert 'store_locations = "file,remote"' in out
    assert 'remote_url = "mooncake://' in out


def test_prefill_example_retrieves_from_host_then_remote() -> None:
    out = effective("prefill.toml")
    assert 'retrieve_locations = "host,remote"' in out
    assert "host_tier_bytes = 34359738368" in out
    assert "promote_to_host = true" in out
