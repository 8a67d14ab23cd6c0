"""The vLLM connector's plain-Python parts: the load policy's estimates and decisions, key
and block planning, endpoints and back-off. No vLLM needed."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvswap.engines.vllm.plan import (
    Backoff,
    blocks_to_save,
    keys_for,
    loadable_blocks,
    resolve_endpoints,
)
from kvswap.engines.vllm.policy import (
    MIN_SAMPLES,
    DecayingLine,
    DecayingRatio,
    LoadPolicy,
)
from kvswap.engines.vllm.stats import percentile
from kvswap.protocol.errors import InvalidKey, Timeout

# -- estimates -----------------------------------------------------------------------------------


def test_line_worked_example() -> None:
    line = DecayingLine(decay=1.0)
    for x, y in [(1, 3), (2, 5), (3, 7)]:
        line.add(x, y)
    assert line.fit() == pytest.approx((1.0, 2.0))


@settings(max_examples=60, deadline=None)
@given(st.floats(0.0, 0.05), st.floats(1e-6, 1e-2), st.lists(st.integers(1, 4000), min_size=2, max_size=30, unique=True),
       st.floats(0.5, 1.0))
def test_line_recovers_any_exact_cost_line(intercept: float, slope: float, xs: list[int], decay: float) -> None:
    line = DecayingLine(decay)
    for x in xs:
        line.add(x, intercept + slope * x)
    got_intercept, got_slope = line.fit()
    assert got_slope == pytest.approx(slope, rel=1e-6, abs=1e-9)
    assert got_intercept == pytest.approx(intercept, rel=1e-6, abs=1e-7)


def test_line_with_one_x_goes_through_the_origin_and_never_goes_negative() -> None:
    line = DecayingLine(1.0)
    line.add(10, 2.0)
    line.add(10, 4.0)
    assert line.fit() == pytest.approx((0.0, 0.3))
    falling = DecayingLine(1.0)
    for x, y in [(1, 5.0), (100, 1.0)]:
        falling.add(x, y)
    intercept, slope = falling.fit()
    assert slope == 0.0 and intercept == pytest.approx(3.0)


def test_line_forgets_old_samples() -> None:
    line = DecayingLine(decay=0.5)
    for _ in range(5):
        line.add(10, 10.0)  # 1 s a unit
    for _ in range(20):
        line.add(10, 1.0)   # the machine got ten times faster
    assert line.predict(10) == pytest.approx(1.0, rel=1e-4)


def test_ratio_worked_example_and_decay() -> None:
    ratio = DecayingRatio(decay=1.0)
    ratio.add(100, 0.2)
    ratio.add(300, 0.4)
    assert ratio.value() == pytest.approx(0.0015)
    assert DecayingRatio().value() == 0.0


# -- decisions -----------------------------------------------------------------------------------


def _trained(load_per_block: float, per_token: float, block_size: int = 32, explore_every: int = 4) -> LoadPolicy:
    policy = LoadPolicy(block_size, explore_every=explore_every)
    for blocks in (4, 8, 16, 32):
        policy.observe_load(blocks, 0.001 + load_per_block * blocks)
        policy.observe_forward(blocks * block_size, per_token * blocks * block_size)
    return policy


def test_policy_loads_while_learning() -> None:
    policy = LoadPolicy(32)
    for _ in range(MIN_SAMPLES - 1):
        policy.observe_load(4, 10.0)  # absurdly slow loads, but too few to trust
        policy.observe_forward(128, 0.001)
    assert policy.decide(4).reason == "learning" and policy.decide(4).load


def test_policy_claims_when_loading_beats_recompute() -> None:
    decision = _trained(load_per_block=0.0003, per_token=0.0002).decide(10)
    # load 1 ms + 3 ms < recompute 320 tokens x 0.2 ms = 64 ms
    assert decision.load and decision.reason == "faster"
    assert decision.load_s == pytest.approx(0.004, rel=1e-6)
    assert decision.recompute_s == pytest.approx(0.064, rel=1e-6)


def test_policy_refuses_slow_loads_but_explores_one_in_n() -> None:
    policy = _trained(load_per_block=0.05, per_token=0.0001, explore_every=4)
    decisions = [policy.decide(10) for _ in range(8)]
    assert [d.load for d in decisions] == [False, False, False, True] * 2
    assert {d.reason for d in decisions} == {"slower", "explore"}
    assert policy.refused == 8 and policy.explored == 2


def test_policy_ignores_decode_steps_and_always_mode() -> None:
    policy = _trained(load_per_block=0.0003, per_token=0.0002)
    before = policy.recompute.value()
    for _ in range(100):
        policy.observe_forward(1, 0.5)  # slow decode steps say nothing about prefill
    assert policy.recompute.value() == before
    always = LoadPolicy(32, mode="always")
    assert always.decide(1).reason == "always"
    with pytest.raises(ValueError):
        LoadPolicy(32, mode="sometimes")


# -- planning ------------------------------------------------------------------------------------


def test_keys_take_the_hash_at_each_block_end() -> None:
    hashes = [bytes([i]) * 4 for i in range(1, 7)]
    assert keys_for(hashes, 1) == [h.hex() for h in hashes]
    assert keys_for(hashes, 2) == ["02020202", "04040404", "06060606"]
    assert keys_for(hashes[:5], 2) == ["02020202", "04040404"]  # a partial block has no key yet


def test_loadable_blocks_keep_the_last_token_for_the_engine() -> None:
    assert loadable_blocks(num_keys=4, num_tokens=128, block_size=32) == 3
    assert loadable_blocks(num_keys=4, num_tokens=129, block_size=32) == 4
    assert loadable_blocks(num_keys=2, num_tokens=1000, block_size=32) == 2
    assert loadable_blocks(num_keys=0, num_tokens=1, block_size=32) == 0


def test_blocks_to_save_are_the_ones_the_step_completes() -> None:
    assert blocks_to_save(0, 100, 32, 3, 4) == range(3)
    assert blocks_to_save(3, 100, 32, 3, 4) == range(3, 3)
    assert blocks_to_save(1, 64, 32, 5, 1) == range(1, 1)  # no block id for block 1 yet
    assert blocks_to_save(4, 40, 32, 5, 5) == range(4, 4)  # never backwards


def test_endpoints_from_config_then_environment_then_default() -> None:
    env = {"KVSWAP_ENDPOINTS": "tcp://127.0.0.1:55500,tcp://127.0.0.1:55501"}
    assert resolve_endpoints({"endpoint": "tcp://a:1"}, env) == ["tcp://a:1"]
    assert resolve_endpoints({"endpoint": ["tcp://a:1", "tcp://a:2"]}, env) == ["tcp://a:1", "tcp://a:2"]
    assert resolve_endpoints({}, env) == ["tcp://127.0.0.1:55500", "tcp://127.0.0.1:55501"]
    assert resolve_endpoints({"endpoint": ""}, {}) == ["tcp://127.0.0.1:55500"]


def test_backoff_skips_after_retryable_failures_only() -> None:
    now = [100.0]
    backoff = Backoff(5.0, clock=lambda: now[0])
    backoff.failed(InvalidKey("bad key"))
    assert backoff.open
    backoff.failed(Timeout("slow"))
    assert not backoff.open
    now[0] += 5.0
    assert backoff.open


def test_percentile_nearest_rank() -> None:
    values = sorted(float(v) for v in range(1, 101))
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0
    assert percentile([], 50) == 0.0
    assert not math.isnan(percentile([3.0], 99))


def test_stats_file_is_private_json_with_lookup_percentiles(tmp_path) -> None:
    from kvswap.engines.vllm.stats import ConnectorStats

    path = tmp_path / "stats.json"
    stats = ConnectorStats(str(path))
    for ms in range(1, 101):
        stats.lookup(ms / 1000, keys=4, hits=2)
    stats.decision("slower", 64)
    stats.error("lookup", Timeout("slow"))
    stats.write(LoadPolicy(32))
    assert path.stat().st_mode & 0o777 == 0o600
    summary = __import__("json").loads(path.read_text())
    assert summary["lookup_ms"]["n"] == 100
    assert summary["lookup_ms"]["p50"] == pytest.approx(50.0) and summary["lookup_ms"]["p99"] == pytest.approx(99.0)
    assert summary["counts"]["lookup_keys"] == 400 and summary["counts"]["tokens_refused"] == 64
    assert summary["errors"] == {"lookup:timeout": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["stats.json"]  # no temporary file left
