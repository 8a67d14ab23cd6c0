"""benchmarks/pd_replay.py's proxy and report, without vLLM: the proxy's two requests against
engines that record what they were sent, and the report's fields on synthetic samples (the
names others read, from issue 25)."""

from __future__ import annotations

import doctest
from typing import Any

from support import load_benchmark


pd = load_benchmark("pd_replay")


class RecordingEngine:
    """What an EngineProcess is to the proxy: submit, result, call; answers as set up."""

    def __init__(self, name: str, log: list[tuple[str, Any]], params_out: dict[str, Any] | None = None) -> None:
        self.name, self.log, self.params_out = name, log, params_out
        self.sent: dict[str, dict[str, Any]] = {}

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        self.log.append((self.name, command["op"]))
        return {}

    def submit(self, prompt: list[int], max_tokens: int, request_id: str,
               kv_transfer_params: dict[str, Any] | None = None) -> str:
        self.log.append((self.name, "submit"))
        self.sent[request_id] = {"prompt": prompt, "max_tokens": max_tokens, "params": kv_transfer_params}
        return request_id

    def result(self, request_id: str, timeout_s: float = 0) -> dict[str, Any]:
        sent = self.sent[request_id]
        return {"tokens": [7] * sent["max_tokens"], "logprobs": [0.0] * sent["max_tokens"], "arrival_s": 100.0,
                "ttft_s": 0.25, "num_cached_tokens": 0, "external_tokens": 0, "kv_transfer_params": self.params_out}


def test_the_proxy_sends_one_prefill_token_then_the_decode_with_the_prefills_params(monkeypatch) -> None:
    log: list[tuple[str, Any]] = []
    params = {"do_remote_prefill": True, "kvswap_peers": ["tcp://p:1"], "kvswap_blocks": 3}
    prefill, decode = RecordingEngine("prefill", log, params), RecordingEngine("decode", log)
    monkeypatch.setattr(pd.time, "monotonic", lambda: 99.5)
    got = pd.Proxy(prefill, decode).complete([1, 2, 3], 8, "r")
    assert log == [("prefill", "reset_prefix_cache"), ("prefill", "submit"), ("decode", "submit")]
    assert prefill.sent["r-p"] == {"prompt": [1, 2, 3], "max_tokens": 1, "params": {"do_remote_decode": True}}
    assert decode.sent["r-d"] == {"prompt": [1, 2, 3], "max_tokens": 8, "params": params}
    assert got["ttft_s"] == 0.75  # the decode's first token (100 + 0.25) after the prefill was sent (99.5)
    assert got["prefill_s"] == 0.0
    # A prefill without kvswap returns no params: the decode gets none and recomputes.
    log.clear()
    bare = pd.Proxy(RecordingEngine("prefill", log), RecordingEngine("decode", log), fresh_prefill=False)
    got = bare.complete([1], 2, "s")
    assert got["params"] is None and bare.decode.sent["s-d"]["params"] is None
    assert ("prefill", "reset_prefix_cache") not in log


def _sample(run: str, session: int, turn: int, prompt: int, history: int, ttft: float, **kw: Any) -> Any:
    return pd.PdSample(run, session, turn, prompt, history, ttft, tokens=kw.pop("tokens", [1, 2]),
                       logprobs=kw.pop("logprobs", [0.0, 0.0]), **kw)


def test_the_report_names_the_fields_of_issue_25() -> None:
    samples = [_sample("reference", 0, 0, 200, 160, 0.10), _sample("reference", 0, 1, 300, 210, 0.12),
               _sample("without_kvswap", 0, 0, 200, 160, 0.30), _sample("without_kvswap", 0, 1, 300, 210, 0.50),
               _sample("pd", 0, 0, 200, 160, 0.20, prefill_from_pool=128, decode_loaded=192),
               _sample("pd", 0, 1, 300, 210, 0.25, prefill_from_pool=192, decode_loaded=256, decode_cached=32,
                       tokens=[1, 3])]
    report = pd.summarize(samples, {"records": 14, "bytes": 14 << 17, "seconds": 0.01}, {})
    first, second = report["per_turn"]
    assert first["turn"] == 0 and first["requests"] == 1
    assert first["decode"] == {"prompt_tokens": 200, "loaded_tokens": 192, "engine_cache_tokens": 0,
                               "recomputed_tokens": 8, "last_partial_tokens": 8}
    # 300 tokens: 9 full blocks may load; 12 tokens, the last partial block, are the decode's own.
    assert second["decode"]["recomputed_tokens"] == 300 - 256 - 32 == second["decode"]["last_partial_tokens"] == 12
    assert second["prefill"] == {"prompt_tokens": 300, "history_tokens": 210, "loaded_from_pool_tokens": 192,
                                 "engine_cache_tokens": 0, "recomputed_tokens": 108}
    assert second["ttft_p50_ms"] == 250.0 and second["ttft_p99_ms"] == 250.0
    assert second["without_kvswap"]["ttft_p50_ms"] == 500.0 and second["reference"]["ttft_p99_ms"] == 120.0
    assert report["outputs"]["pd_vs_reference"]["compared"] == 2
    assert report["outputs"]["pd_vs_reference"]["token_mismatches"] == 1
    assert report["outputs"]["pd_vs_reference"]["differing"] == [{"session": 0, "turn": 1, "first_token": 1}]
    assert report["direct"]["records"] == 14


def test_direct_totals_are_the_change_in_the_decode_daemons_pull_series() -> None:
    names = pd.DIRECT
    before = {names["records"]: 3.0, names["bytes"]: 300.0, names["seconds"]: 0.5}
    after = {names["records"]: 10.0, names["bytes"]: 1000.0, names["seconds"]: 1.5}
    assert pd.direct_totals(before, after, "mooncake") == {"records": 7, "bytes": 700, "seconds": 1.0,
                                                           "transport": "mooncake"}


def test_the_replays_docstring_examples_hold() -> None:
    result = doctest.testmod(pd, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
