"""The serving replay's report and scheduling (benchmarks/serving_replay.py), on synthetic
samples and a fake engine: no vLLM, no daemon, pure Python."""

from __future__ import annotations

import math

import pytest
from support import load_benchmark

replay = load_benchmark("serving_replay")
Sample = replay.Sample


def sample(run, session, turn, *, prompt=100, ttft=0.1, cached=0, external=0, host=0, file=0, times=(),
           tokens=(1, 2), logprobs=None, preemptions=0):
    return Sample(run, session, turn, prompt, ttft, ttft + 0.05, cached, external_tokens=external, host_tokens=host,
                  file_tokens=file, preemptions=preemptions, token_times_s=list(times), tokens=list(tokens),
                  logprobs=list(logprobs if logprobs is not None else [-1.0] * len(tokens)))


# -- inter-token latency ----------------------------------------------------------------------------


def test_inter_token_gaps_are_differences_of_token_times_in_ms():
    assert replay.inter_token_ms([0.1, 0.12, 0.15, 0.25]) == pytest.approx([20.0, 30.0, 100.0])
    assert replay.inter_token_ms([0.3]) == []
    assert replay.inter_token_ms([]) == []


def test_itl_percentiles_pool_every_gap_of_every_request_but_never_across_requests():
    a = sample("kvswap", 0, 0, times=[0.1, 0.12, 0.15, 0.25])  # gaps 20, 30, 100
    b = sample("kvswap", 1, 0, times=[5.0, 5.01])  # gap 10; nothing between a's last and b's first
    stats = replay.itl_stats([a, b])
    assert stats["itl_p50_ms"] == pytest.approx(20.0)  # nearest rank 2 of [10, 20, 30, 100]
    assert stats["itl_p99_ms"] == pytest.approx(100.0)
    one_token = replay.itl_stats([sample("kvswap", 0, 0, times=[0.2])])
    assert math.isnan(one_token["itl_p50_ms"]) and math.isnan(one_token["itl_p99_ms"])


# -- per-turn rows and totals ---------------------------------------------------------------------------


def _three_runs():
    out = []
    for turn in range(2):
        for session in range(2):
            out.append(sample("ideal", session, turn, prompt=320, ttft=0.05, cached=256 if turn else 0,
                              times=[0.05, 0.06, 0.07]))
            out.append(sample("baseline", session, turn, prompt=320, ttft=0.4 + 0.1 * session, cached=64 * turn,
                              times=[0.4, 0.45, 0.5]))
            out.append(sample("kvswap", session, turn, prompt=320, ttft=0.1 + 0.1 * session,
                              cached=(64 + 192) * turn, external=192 * turn, host=128 * turn, file=64 * turn,
                              times=[0.1, 0.11, 0.13]))
    return out


def test_turn_rows_give_each_runs_ttft_itl_and_token_sources_by_turn():
    rows = replay.turn_rows(_three_runs())
    assert [r["turn"] for r in rows] == [0, 1]
    k1, b1 = rows[1]["kvswap"], rows[1]["baseline"]
    assert k1["n"] == 2 and k1["prompt_tokens"] == 640
    assert k1["engine_cache_tokens"] == 128  # cached 256 each, of which 192 came from kvswap
    assert (k1["kvswap_tokens"], k1["kvswap_host_tokens"], k1["kvswap_file_tokens"]) == (384, 256, 128)
    assert k1["recomputed_tokens"] == 640 - 512
    assert b1["recomputed_tokens"] == 640 - 128 and b1["kvswap_tokens"] == 0
    assert k1["ttft_p50_ms"] == pytest.approx(100.0) and k1["ttft_p99_ms"] == pytest.approx(200.0)
    assert k1["itl_p50_ms"] == pytest.approx(10.0) and k1["itl_p99_ms"] == pytest.approx(20.0)
    assert rows[1]["ideal"]["itl_p99_ms"] == pytest.approx(10.0)
    # Each request's own ratio: 0.4/0.1 = 4 and 0.5/0.2 = 2.5; nearest-rank p50 of [2.5, 4].
    assert rows[1]["paired_speedup_p50"] == pytest.approx(2.5)


def test_a_tier_split_unknown_for_one_request_is_unknown_for_its_turn():
    samples = _three_runs()
    samples[-1].host_tokens = samples[-1].file_tokens = None  # kvswap, session 1, turn 1: N > 1
    rows = replay.turn_rows(samples)
    assert rows[1]["kvswap"]["kvswap_host_tokens"] is None and rows[1]["kvswap"]["kvswap_file_tokens"] is None
    assert rows[1]["kvswap"]["kvswap_tokens"] == 384  # what the connector claimed is known at any N
    assert rows[0]["kvswap"]["kvswap_host_tokens"] == 0


def test_totals_give_output_tokens_per_second_and_hits_by_tier_from_the_runs_counters():
    runs = {"ideal": {"wall_s": 2.0}, "baseline": {"wall_s": 4.0},
            "kvswap": {"wall_s": 3.2, "kvswap_tiers": {"loaded": 384, "host": 256, "file": 128}}}
    totals = replay.run_totals(_three_runs(), runs)
    k, b = totals["kvswap"], totals["baseline"]
    assert k["requests"] == 4 and k["output_tokens"] == 8
    assert k["output_tokens_per_s"] == pytest.approx(8 / 3.2)
    assert b["output_tokens_per_s"] == pytest.approx(8 / 4.0)
    assert totals["ideal"]["output_tokens_per_s"] == pytest.approx(4.0)
    assert k["hit_kvswap_host"] == pytest.approx(256 / 1280) and k["hit_kvswap_file"] == pytest.approx(128 / 1280)
    assert k["hit_kvswap"] == pytest.approx(384 / 1280)
    assert k["hit_engine_cache"] == pytest.approx(128 / 1280) and k["recomputed"] == pytest.approx(768 / 1280)
    assert b["hit_kvswap_host"] == 0 and b["recomputed"] == pytest.approx(1152 / 1280)
    assert k["itl_p50_ms"] == pytest.approx(10.0)
    assert totals["paired_speedup_p50"] == pytest.approx(2.5)  # ratios 4, 2.5, 4, 2.5
    assert math.isnan(replay.run_totals(_three_runs(), {})["kvswap"]["output_tokens_per_s"])  # no wall time


# -- the output comparison ------------------------------------------------------------------------------


def test_compare_counts_answers_that_differ_and_where_they_start():
    samples = [sample("ideal", 0, 0, tokens=[5, 6, 7], logprobs=[-1.0, -2.0, -3.0]),
               sample("kvswap", 0, 0, tokens=[5, 6, 7], logprobs=[-1.0, -2.25, -3.0], external=64),
               sample("ideal", 1, 0, tokens=[5, 6, 7]),
               sample("kvswap", 1, 0, tokens=[5, 9, 7], external=32, preemptions=1),
               sample("ideal", 2, 0, tokens=[5, 6, 7]),
               sample("kvswap", 2, 0, tokens=[5, 6])]  # a prefix of the reference, shorter
    got = replay.compare(samples, "kvswap", "ideal")
    assert got["compared"] == 3 and got["token_mismatches"] == 2
    assert got["max_abs_logprob_diff"] == pytest.approx(0.25)
    assert got["differing"] == [{"session": 1, "turn": 0, "first_token": 1, "kvswap_tokens_loaded": 32,
                                 "preemptions": 1},
                                {"session": 2, "turn": 0, "first_token": 2, "kvswap_tokens_loaded": 0,
                                 "preemptions": 0}]
    same = replay.compare(samples[:2], "kvswap", "ideal")
    assert same["token_mismatches"] == 0 and same["differing"] == []


def test_summarize_keeps_the_report_fields_and_passes_the_connector_stats_through():
    connector = {"lookup_ms": {"n": 3, "p50": 1.5}, "counts": {"tokens_loaded": 384}, "policy": {"mode": "x"}}
    report = replay.summarize(_three_runs(), connector, {'kvswap_request_duration_seconds_count{op="lookup"}': 7.0},
                              {"kvswap": {"wall_s": 1.0}})
    assert set(report) >= {"per_turn", "totals", "outputs", "lookup_engine_ms", "connector", "daemon_lookups", "runs"}
    assert report["connector"] is connector and report["lookup_engine_ms"] == {"n": 3, "p50": 1.5}
    assert report["daemon_lookups"] == 7.0
    assert set(report["outputs"]) == {"kvswap_vs_ideal", "baseline_vs_ideal", "kvswap_vs_baseline"}
    assert report["outputs"]["kvswap_vs_ideal"]["compared"] == 4


# -- the conversation and the schedule at concurrency -----------------------------------------------------


def _conversation(sessions=3, turns=3, max_model_len=2048):
    made = replay.make_sessions(0, sessions, turns, 64, 4, 8192)
    return replay.Conversation(made, 0, max_model_len, 8192)


def test_a_turns_prompt_is_the_system_prompt_then_earlier_turns_with_the_given_answers():
    conv = _conversation()
    answers = {(1, 0): [11, 12, 13, 14], (1, 1): [21, 22, 23, 24]}
    first = conv.prompt(1, 0, answers)
    second = conv.prompt(1, 1, answers)
    third = conv.prompt(1, 2, answers)
    assert first[:64] == conv.sessions[1].history
    assert second[:len(first)] == first and second[len(first):len(first) + 4] == [11, 12, 13, 14]
    assert third[:len(second) + 4] == [*second, 21, 22, 23, 24]
    assert conv.prompt(1, 2, answers) == third  # the same answers, the same prompt, for every run


class FakeEngine:
    """Answers submitted requests in an order it chooses (newest first, so completions come out
    of order), with answers that name the request."""

    def __init__(self):
        self.live = {}
        self.log = []
        self.max_in_flight = 0

    def submit(self, prompt, max_tokens, request_id=None):
        assert request_id not in self.live
        self.live[request_id] = (prompt, max_tokens)
        self.log.append(("submit", request_id, len(prompt)))
        self.max_in_flight = max(self.max_in_flight, len(self.live))
        return request_id

    def wait(self, ids, timeout_s):
        rid = [r for r in ids if r in self.live][-1]
        prompt, max_tokens = self.live.pop(rid)
        self.log.append(("done", rid, len(prompt)))
        _, session, turn = rid.rsplit("-", 2)
        tokens = [1000 + 10 * int(session) + int(turn)] * max_tokens
        return {"id": rid, "tokens": tokens, "logprobs": [-0.5] * max_tokens, "ttft_s": 0.01, "e2e_s": 0.02,
                "token_times_s": [0.01 * (i + 1) for i in range(max_tokens)], "num_cached_tokens": 32,
                "external_tokens": 0, "preemptions": 0}


@pytest.mark.parametrize("concurrency", [1, 2, 5])
def test_the_schedule_keeps_n_in_flight_and_a_sessions_turns_in_order(concurrency):
    conv = _conversation(sessions=4, turns=3)
    answers = {}
    engine = FakeEngine()
    samples, info = replay.run_one("ideal", engine, conv, answers, concurrency, 3, None)
    assert len(samples) == 12 and engine.max_in_flight == min(concurrency, 4)
    assert info["wall_s"] >= 0
    done = set()
    for event, rid, _ in engine.log:
        _, session, turn = rid.rsplit("-", 2)
        if event == "submit":  # a session's turn goes in only once its previous answer came back
            assert int(turn) == 0 or f"ideal-{session}-{int(turn) - 1}" in done
        else:
            done.add(rid)
    if concurrency == 1:  # one at a time: round-robin, turn by turn, as the replay always ran
        assert [rid for event, rid, _ in engine.log if event == "submit"] == [
            f"ideal-{s}-{t}" for t in range(3) for s in range(4)]
    assert answers[(2, 1)] == [1021] * conv.answer_tokens(2, 1)


def test_other_runs_are_sent_the_prompts_the_ideal_run_built():
    conv = _conversation(sessions=3, turns=2)
    answers = {}
    ideal, kvswap = FakeEngine(), FakeEngine()
    replay.run_one("ideal", ideal, conv, answers, 2, 2, None)
    kept = dict(answers)
    replay.run_one("kvswap", kvswap, conv, answers, 3, 2, None)
    assert answers == kept  # only the ideal run writes the conversation
    lengths = {rid.split("-", 1)[1]: n for event, rid, n in ideal.log if event == "submit"}
    assert {rid.split("-", 1)[1]: n for event, rid, n in kvswap.log if event == "submit"} == lengths


def test_a_turn_too_long_for_the_model_is_skipped_in_every_run():
    conv = _conversation(sessions=2, turns=3, max_model_len=400)
    lengths = [[len(p) if (p := conv.prompt(s, t, {(s, u): [0] * 4 for u in range(3)})) else None
                for t in range(3)] for s in range(2)]
    skipped = sum(n is None for row in lengths for n in row)
    assert skipped > 0  # the seed's conversations outgrow 400 tokens
    samples, _ = replay.run_one("ideal", FakeEngine(), conv, {}, 2, 3, None)
    assert len(samples) == 6 - skipped


def test_default_sizes_leave_the_history_out_of_the_engines_cache():
    conv = replay.Conversation(replay.make_sessions(0, 16, 4, 256, 8, 8192), 0, 2048, 8192)
    working = conv.working_set_blocks(4)
    assert 300 < working < 360
    assert replay.default_cache_blocks(1, 256) == 72 and replay.default_cache_blocks(8, 256) == 200 < working
    ram_blocks = replay.kvswapd_ram_blocks(4, 8)  # the defaults: RAM tier and each staging, MiB
    assert ram_blocks == 160 < working
    assert replay.kvswapd_ram_blocks(16, 320) > working  # kvswapd's own staging would hold it all
    assert replay.tier_tokens({replay.LOADED: 4.0, replay.HOST_HITS: 9.0}, {}) == {"loaded": 128, "host": 128,
                                                                                  "file": 0}
