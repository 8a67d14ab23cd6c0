"""Prefill/decode disaggregation with real engines: a prefill and a decode vLLM engine (CPU),
each beside its own kvswapd, a Redis Cluster on loopback as the shared pool, the proxy of
benchmarks/pd_replay.py in front, and one engine without kvswap that never evicts as the
reference every answer is compared with, token for token.

The CI version of benchmarks/pd_replay.py (two sessions of two turns), then what must hold when
things go wrong: a decode request that comes before the prefill's KV landed, the pool down, the
prefill's daemon killed between prefill and decode. vLLM's environment is the connector test's
(``vllm_python``)."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any

import pytest
from support import load_benchmark, vllm_env, wait_until
from test_vllm_connector import vllm_python  # noqa: F401  (a fixture)

from kvswap.protocol import Client
from kvswap.testing.remote_servers import redis_skip_reason

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

SYSTEM_TOKENS = 160  # 5 blocks: a turn-1 history of at least 176 tokens, >= 82% of it in full blocks
MAX_ANSWER = 8


pd = load_benchmark("pd_replay")


class Rig:
    """The pool, both daemons, the three engines."""

    def __init__(self, python: str, work: Path) -> None:
        self.work = work
        mod = load_benchmark("vllm_engine")
        model = pd.TINY_MODEL
        self.vocab = model["vocab"]
        model_dir = mod.make_model_dir(str(work / "model"), model["layers"], model["hidden"], model["heads"],
                                       model["kv_heads"], model["intermediate"], model["vocab"])
        self.engines: dict[str, Any] = {}
        self.pool: Any = None
        self.daemons: list[Any] = []
        try:
            self.pool, self.pool_url = pd.pool_server("redis-cluster", work)
            self.prefill_daemon, self.decode_daemon = pd.pd_daemons(work, self.pool_url, 64)
            self.daemons = [self.prefill_daemon, self.decode_daemon]
            argv = {"reference": pd.engine_argv(model_dir, model, 1024, 2048),
                    "prefill": pd.engine_argv(model_dir, model, 72, 2048, self.prefill_daemon.endpoint,
                                              role="prefill"),
                    "decode": pd.engine_argv(model_dir, model, 72, 2048, self.decode_daemon.endpoint,
                                             extra={"pd_wait_ms": 10000, "lookup_timeout_s": 5}, role="decode")}
            self.engines = pd.start_engines(python, argv, work)
        except BaseException:
            self.close()
            raise
        self.proxy = pd.Proxy(self.engines["prefill"], self.engines["decode"])

    def reference(self, prompt: list[int], max_tokens: int = MAX_ANSWER) -> list[int]:
        engine = self.engines["reference"]
        return engine.result(engine.submit(prompt, max_tokens))["tokens"]

    def decode_settled(self) -> None:
        """Until the decode daemon has answered everything and written every record."""
        wait_until(lambda: self.decode_daemon.metric("kvswap_requests_in_flight") == 0
                   and self.decode_daemon.metric("kvswap_pending_writes") == 0, timeout=30)

    def fresh_prompt(self, seed: str, tokens: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(3, self.vocab) for _ in range(tokens)]

    def pulled(self) -> dict[str, float]:
        return pd.peer_series(self.decode_daemon.metrics_url)

    def close(self) -> None:
        pd.close_engines(self.engines)
        for daemon in self.daemons:
            daemon.stop()
        if self.pool is not None:
            self.pool.stop()


@pytest.fixture(scope="module")
def rig(vllm_python, tmp_path_factory):  # noqa: F811
    if redis_skip_reason():
        pytest.skip(redis_skip_reason())
    # pd_replay starts its engines in this process's environment (pd.engine_env): the tests'
    # compile cache setting (support.vllm_env) goes there for the start.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_USE_AOT_COMPILE", vllm_env()["VLLM_USE_AOT_COMPILE"])
        rig = Rig(vllm_python, tmp_path_factory.mktemp("pd"))
    yield rig
    rig.close()


def test_the_pd_replay_short_decode_loads_the_prompt_and_prefill_the_history_from_the_pool(rig: Rig) -> None:
    conversation = pd.replay.Conversation(
        pd.replay.make_sessions(7, 2, 2, SYSTEM_TOKENS, MAX_ANSWER, rig.vocab), 7, 2048, rig.vocab)
    answers: dict[tuple[int, int], list[int]] = {}
    samples = pd.reference_samples(rig.engines["reference"], conversation, answers, 2)
    pulled_before = rig.pulled()
    # The next turn comes once the decode's saves are in the pool (a user's think time; a turn
    # sent earlier finds less there, and its prefill recomputes what is missing).
    samples += pd.run_pair("pd", rig.proxy, conversation, answers, 2, rig.prefill_daemon, rig.decode_daemon,
                           between=rig.decode_settled)
    report = pd.summarize(samples, pd.direct_totals(pulled_before, rig.pulled(), "mooncake"), {})
    assert report["outputs"]["pd_vs_reference"] == {"compared": 4, "token_mismatches": 0,
                                                    "max_abs_logprob_diff": 0.0, "differing": []}, report["outputs"]
    for s in (s for s in samples if s.run == "pd"):
        # Decode computes nothing but the prompt's last partial block: the rest is loaded
        # (pulled from the prefill's daemon, or found in its own) or in its own cache.
        assert s.decode_loaded is not None
        assert s.decode_loaded + s.decode_cached == s.prompt_tokens - pd.last_partial_tokens(s.prompt_tokens), s
        if s.turn >= 1:
            # Every full block of the history, from the pool: what the decode pulled and what
            # it generated (turn 0's answer crosses into a new block in session 0 with this seed).
            assert s.prefill_from_pool == s.history_tokens // pd.BLOCK * pd.BLOCK >= 0.8 * s.history_tokens, s
    # Step 1 moved every block the decode loaded from the prefill, at least; the bytes are theirs.
    # The first request's decode had nothing of its own: all it loaded was pulled.
    direct, first = report["direct"], next(s for s in samples if s.run == "pd")
    assert direct["records"] >= first.decode_loaded // pd.BLOCK > 0
    assert direct["bytes"] == direct["records"] * pd.replay.block_bytes(pd.TINY_MODEL) and direct["seconds"] > 0
    rows = report["per_turn"]
    assert [r["turn"] for r in rows] == [0, 1] and all(r["requests"] == 2 for r in rows)
    assert rows[1]["prefill"]["loaded_from_pool_tokens"] >= 0.8 * rows[1]["prefill"]["history_tokens"]


def test_a_decode_request_sent_before_the_prefills_kv_landed_still_loads_it_all(rig: Rig) -> None:
    prompt = rig.fresh_prompt("ordering", 200)
    expected = rig.reference(prompt)
    with Client(rig.prefill_daemon.endpoint, timeout=10) as c:
        peer = c.hello()["peer"]["address"]
    params = {"do_remote_prefill": True, "kvswap_peers": [peer]}
    prefill, decode = rig.engines["prefill"], rig.engines["decode"]
    loaded_before = rig.decode_daemon.metric("kvswap_blocks_total", op="swap_in", status="loaded")
    # With the prefill's daemon stopped, nothing the prefill computes can land there before the
    # decode's lookup is in its daemon's hands.
    os.kill(rig.prefill_daemon.proc.pid, signal.SIGSTOP)
    try:
        rid = decode.submit(prompt, MAX_ANSWER, "ordering-d", kv_transfer_params=params)
        wait_until(lambda: rig.decode_daemon.metric("kvswap_requests_in_flight") >= 1, timeout=30)
        first = prefill.submit(prompt, 1, "ordering-p", kv_transfer_params={"do_remote_decode": True})
    finally:
        os.kill(rig.prefill_daemon.proc.pid, signal.SIGCONT)
    prefill.result(first)
    done = decode.result(rid)
    assert done["tokens"] == expected
    full = (len(prompt) - 1) // pd.BLOCK
    assert done["external_tokens"] == full * pd.BLOCK
    assert rig.decode_daemon.metric("kvswap_blocks_total", op="swap_in", status="loaded") - loaded_before == full


def test_with_the_pool_down_prefill_recomputes_and_decode_still_gets_the_prompt_directly(rig: Rig) -> None:
    prompt = rig.fresh_prompt("pool-down", 170)
    expected = rig.reference(prompt)
    rig.pool.stop()
    pool_hits = rig.prefill_daemon.metric("kvswap_tier_ops_total", op="get", result="hit", tier="remote")
    got = rig.proxy.complete(prompt, MAX_ANSWER, "pool-down")
    assert got["decode"]["tokens"] == expected
    assert got["prefill"]["external_tokens"] == 0
    assert rig.prefill_daemon.metric("kvswap_tier_ops_total", op="get", result="hit", tier="remote") == pool_hits
    assert got["decode"]["external_tokens"] == (len(prompt) - 1) // pd.BLOCK * pd.BLOCK


def test_the_prefills_daemon_killed_between_prefill_and_decode_makes_decode_recompute(rig: Rig) -> None:
    prompt = rig.fresh_prompt("killed", 230)
    expected = rig.reference(prompt)
    prefill, decode = rig.engines["prefill"], rig.engines["decode"]
    first = prefill.result(prefill.submit(prompt, 1, "killed-p", kv_transfer_params={"do_remote_decode": True}))
    params = first["kv_transfer_params"]
    assert params and params["kvswap_peers"], first
    rig.prefill_daemon.proc.kill()
    rig.prefill_daemon.proc.wait()
    unreachable = rig.decode_daemon.metric("kvswap_peer_pull_failures_total", reason="unreachable")
    done = decode.result(decode.submit(prompt, MAX_ANSWER, "killed-d", kv_transfer_params=params))
    assert done["tokens"] == expected  # recomputed, never garbage
    assert done["external_tokens"] == 0
    # Known unreachable (no connection), not waited out as a peer that is slow to answer.
    assert rig.decode_daemon.metric("kvswap_peer_pull_failures_total", reason="unreachable") == unreachable + 1
