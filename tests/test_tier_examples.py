"""The prefill/decode configuration examples in deploy/tiers/ load, and say what their comments
claim: decode stores to the remote pool, prefill retrieves from RAM then the pool, both name the
address their peers reach them at and their role (which start-up checks). The vLLM halves
(vllm-prefill.json, vllm-decode.json) start real engines in tests/test_pd_engines.py."""

from __future__ import annotations

import json
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
    assert 'store_locations = "host,file,remote"' in out
    assert 'remote_url = "mooncake://' in out
    assert 'pd_role = "decode"' in out and 'peer_address = "tcp://decode-1.internal:55500"' in out


def test_prefill_example_retrieves_from_host_then_remote() -> None:
    out = effective("prefill.toml")
    assert 'retrieve_locations = "host,remote"' in out
    assert "host_tier_bytes = 34359738368" in out
    assert "promote_to_host = true" in out
    assert 'pd_role = "prefill"' in out and 'peer_address = "tcp://prefill-1.internal:55500"' in out


def test_the_vllm_halves_name_the_connector_and_recompute_on_a_failed_load() -> None:
    for role in ("prefill", "decode"):
        config = json.loads((EXAMPLES / f"vllm-{role}.json").read_text())
        assert config["kv_connector"] == "KvswapConnector"
        assert config["kv_connector_module_path"] == "kvswap.engines.vllm.connector"
        assert config["kv_role"] == "kv_both" and config["kv_load_failure_policy"] == "recompute"
    assert json.loads((EXAMPLES / "vllm-decode.json").read_text())["kv_connector_extra_config"]["pd_wait_ms"] > 0
