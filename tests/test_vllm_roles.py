"""vLLM's ``kv_role`` on the kvswap connector's scheduler side: ``kv_producer`` saves and never
loads (no lookup reaches the daemon), ``kv_consumer`` loads and never saves, ``kv_both`` does
both. The scheduler side runs in vLLM's environment (the connector imports vLLM) against a real
kvswapd holding the keys; vLLM's config is given as the few attributes the scheduler side reads,
so no engine starts."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from support import DaemonProcess, free_port
from test_vllm_connector import vllm_python  # noqa: F401  (a fixture)

from kvswap.engines.vllm.plan import keys_for
from kvswap.protocol import CacheLayout, Client, HostKVCache

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BLOCK = 4
HASHES = [bytes([i + 1]) * 32 for i in range(6)]
KEYS = keys_for(HASHES, 1)

SCRIPT = """
import json, sys, time
from types import SimpleNamespace as NS
from kvswap.engines.vllm.connector import SchedulerSide
from kvswap.engines.vllm.worker import KvswapMetadata
from kvswap.engines.vllm.connector import _Tracked

endpoint, hashes = sys.argv[1], [bytes.fromhex(h) for h in json.loads(sys.argv[2])]
out = {}
for role in ("kv_producer", "kv_consumer", "kv_both"):
    config = NS(cache_config=NS(block_size=4, hash_block_size=4), parallel_config=NS(tensor_parallel_size=1),
                kv_transfer_config=NS(kv_role=role), kv_events_config=None)
    side = SchedulerSide(config, {"endpoint": endpoint, "load_policy": "always", "known_keys": 0,
                                  "lookup_wait_ms": 200})
    side.clients[0].ping()  # connected, as once the engine serves (an unconnected daemon answers 0 at once)
    request = NS(request_id="r-" + role, block_hashes=hashes, num_tokens=4 * len(hashes) + 1,
                 all_token_ids=list(range(4 * len(hashes) + 1)), kv_transfer_params=None, lora_request=None)
    matched, deadline = None, time.monotonic() + 60
    while matched is None and time.monotonic() < deadline:  # asked again each step while None
        matched = side.matched_tokens(request, 0)
        time.sleep(0.005)
    meta = KvswapMetadata(loads=[], step_tokens=0, load_async=True, reused_blocks=frozenset())
    side._plan_save(meta, _Tracked(request, block_ids=list(range(len(hashes)))), 4 * len(hashes))
    out[role] = {"matched": matched, "saves": sum(len(t.keys) for t in meta.saves)}
    side.close()
print("@@roles " + json.dumps(out))
"""


def test_kv_producer_never_loads_and_kv_consumer_never_saves(vllm_python, tmp_path: Path) -> None:  # noqa: F811
    daemon = DaemonProcess(tmp_path / "store", free_port(), free_port()).start()
    cache = HostKVCache.create(CacheLayout("roles", num_layers=1, num_blocks=8, block_size=BLOCK, num_kv_heads=1,
                                           head_dim=8))
    try:
        cache.fill_random(seed=1)
        with Client(daemon.endpoint, timeout=30) as c:  # registered while the scheduler side asks
            c.register(cache)
            assert c.swap_out([0, 1, 2], KEYS[:3], wait="persisted").stored == 3
            lookups_before = daemon.metric("kvswap_requests_total", op="lookup", outcome="ok")
            script = tmp_path / "roles.py"
            script.write_text(SCRIPT)
            done = subprocess.run([vllm_python, str(script), daemon.endpoint, json.dumps([h.hex() for h in HASHES])],
                                  capture_output=True, text=True, timeout=300,
                                  env=dict(os.environ, HF_HUB_OFFLINE="1"))
        assert done.returncode == 0, done.stderr[-3000:]
        roles = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("@@roles "))[8:])
        assert roles == {"kv_producer": {"matched": 0, "saves": 6},
                         "kv_consumer": {"matched": 3 * BLOCK, "saves": 0},
                         "kv_both": {"matched": 3 * BLOCK, "saves": 6}}, roles
        # The producer asked nothing: one lookup each for the consumer and kv_both.
        assert daemon.metric("kvswap_requests_total", op="lookup", outcome="ok") - lookups_before == 2
        assert "kv_role kv_producer: this engine saves to kvswap and never loads" in done.stdout + done.stderr
    finally:
        daemon.stop()
        cache.close()
