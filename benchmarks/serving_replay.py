"""Multi-turn serving replay: a vLLM engine (CPU) with and without kvswap underneath.

    python benchmarks/serving_replay.py --python /work/venv-vllm/bin/python [--sessions 16 --turns 5]

Many chat sessions, seeded: every session starts with one system prompt shared by all, then
each turn appends a user message and the model's answer to the conversation, and the next
turn sends the whole conversation again. Message lengths are drawn from log-normal
distributions shaped like ShareGPT's (user messages: median ~110 tokens with a long tail of
pasted text; answers: median ~200, capped at ``--max-answer`` generated tokens because CPU
decode costs ~5-20 ms a token here). Sessions take turns round-robin, so between two turns
of one session every other session's turn runs through the engine: with the engine's own
prefix cache sized to ``--cache-blocks`` blocks, earlier turns are evicted and must come back
from kvswap or be recomputed.

Three engines run side by side, each request going to all in turn (same prompt, same
moment, so machine noise hits all): ``baseline`` (vLLM's own prefix cache only), ``kvswap``
(the connector, kvswapd with a RAM tier of ``--host-tier-mib`` and the file tier) and
``ideal`` (vLLM with a cache so large it never evicts). The conversation's answers are the
baseline's. ``ideal`` is the reference for "identical": a block's KV is reused exactly as it
was computed, including blocks filled one token at a time by decode steps, whose KV differs
in its last bits from the same tokens recomputed in a prefill. kvswap should match ``ideal``
token for token; the baseline, which recomputes, may not.

Reports per turn index: TTFT p50/p99 per run, prompt tokens served by the engine's cache, by
kvswap (per tier: host, file) and recomputed; the connector's lookup latency as the engine
saw it (p50/p99); and a plot of TTFT by turn index (``--out``/ttft_by_turn.png).

The model: a Llama shape with random weights written here (no download; not vLLM's dummy
weights, whose output barely depends on the context, see vllm_engine.py). 8 layers, hidden 1024, 16 heads,
2 KV heads (GQA 8:1), head dim 64, MLP 2816: ~180 MFLOP of prefill per token against 4 KiB of
KV per token, ~43 kFLOP per KV byte. What decides whether a load beats recompute is that
ratio (work saved per byte moved): Llama-3.2-1B has ~59 kFLOP/byte, Llama-3-8B ~106, so this
shape stands for a small real model and understates what larger ones gain on the same
hardware. A smaller shape (4 layers, hidden 512) was tried first: its prefill was so cheap
that vLLM's per-step overhead, not prefill, made up most of TTFT on this CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODEL = {"layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 2, "intermediate": 2816, "vocab": 8192}
BLOCK = 32


def _engine_module() -> Any:
    spec = importlib.util.spec_from_file_location("vllm_engine", HERE / "vllm_engine.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def block_bytes(model: dict[str, int], block: int = BLOCK) -> int:
    head_dim = model["hidden"] // model["heads"]
    return model["layers"] * 2 * model["kv_heads"] * head_dim * block * 2  # bf16


# -- the conversations ---------------------------------------------------------------------------


def lognormal_tokens(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(rng.lognormvariate(math.log(median), sigma))))


@dataclass
class Session:
    index: int
    history: list[int]
    user_lengths: list[int]
    answer_lengths: list[int]


def make_sessions(seed: int, sessions: int, turns: int, system_tokens: int, max_answer: int,
                  vocab: int) -> list[Session]:
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(system_tokens)]
    out = []
    for s in range(sessions):
        users = [lognormal_tokens(rng, 110, 0.9, 8, 1000) for _ in range(turns)]
        answers = [lognormal_tokens(rng, 200, 0.8, 8, 2000) for _ in range(turns)]
        out.append(Session(s, list(system), users, [min(a, max_answer) for a in answers]))
    return out


def user_message(seed: int, session: int, turn: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(f"{seed}:{session}:{turn}")
    return [rng.randrange(3, vocab) for _ in range(n)]


# -- the daemon --------------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(metrics_url: str) -> dict[str, float]:
    """The series this replay reads from kvswapd's /metrics, by name and labels."""
    with urllib.request.urlopen(metrics_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    wanted = ("kvswap_blocks_total", "kvswap_tier_ops_total", "kvswap_request_duration_seconds_bucket",
              "kvswap_request_duration_seconds_count")
    series = {}
    for line in text.splitlines():
        if line.startswith(wanted):
            name, _, value = line.rpartition(" ")
            series[name] = float(value)
    return series


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


# -- the run ----------------------------------------------------------------------------------------


@dataclass
class Sample:
    run: str
    session: int
    turn: int
    prompt_tokens: int
    ttft_s: float
    e2e_s: float
    cached_tokens: int
    external_tokens: int = 0
    host_tokens: int = 0
    file_tokens: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(1, math.ceil(len(ordered) * q / 100))
    return ordered[rank - 1]


def run(args: argparse.Namespace) -> dict[str, Any]:
    mod = _engine_module()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvswap-replay-"))
    model_dir = mod.make_model_dir(str(work / "model"), MODEL["layers"], MODEL["hidden"], MODEL["heads"],
                                   MODEL["kv_heads"], MODEL["intermediate"], MODEL["vocab"])
    port, metrics_port = free_port(), free_port()
    metrics_url = f"http://127.0.0.1:{metrics_port}"
    daemon_log = open(out / "kvswapd.log", "wb")
    daemon = subprocess.Popen([sys.executable, "-m", "kvswap.daemon", "--cache-queue-port", str(port),
                               "--metrics-port", str(metrics_port), "--storage-dir", str(work / "store"),
                               "--host-tier-bytes", str(args.host_tier_mib << 20)],
                              stdout=daemon_log, stderr=subprocess.STDOUT)
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    common = ["--model", model_dir, "--block-size", str(BLOCK), "--block-bytes", str(block_bytes(MODEL)),
              "--cache-blocks", str(args.cache_blocks), "--max-model-len", str(args.max_model_len)]
    stats_file = out / "connector-stats.json"
    engines: dict[str, Any] = {}
    try:
        started = time.monotonic()
        engines["baseline"] = mod.EngineProcess(args.python, common, str(out / "engine-baseline.log"), env=env)
        # The reference for "identical": an engine whose own cache never evicts (it reuses every
        # block's KV exactly as computed, including blocks filled by decode steps).
        engines["ideal"] = mod.EngineProcess(args.python, [*common[:-4], "--cache-blocks", str(args.ideal_cache_blocks),
                                                           *common[-2:]], str(out / "engine-ideal.log"), env=env)
        engines["kvswap"] = mod.EngineProcess(args.python, [*common, "--endpoint", f"tcp://127.0.0.1:{port}",
                                                            "--stats-file", str(stats_file),
                                                            "--load-policy", args.load_policy],
                                              str(out / "engine-kvswap.log"), env=env)
        print(f"engines up in {time.monotonic() - started:.0f} s", flush=True)
        samples = replay(args, engines, metrics_url)
        lookup_daemon = scrape(metrics_url)
    finally:
        for engine in engines.values():
            engine.close()
        daemon.terminate()
        daemon.wait(30)
        daemon_log.close()
    connector = json.loads(stats_file.read_text()) if stats_file.exists() else {}
    report = summarize(samples, connector, lookup_daemon)
    report["config"] = {**vars(args), "model": MODEL, "block_size": BLOCK}
    report["samples"] = [{k: v for k, v in vars(s).items() if k not in ("tokens", "logprobs")} for s in samples]
    (out / "replay.json").write_text(json.dumps(report, indent=1))
    plot(samples, out / "ttft_by_turn.png")
    return report


def replay(args: argparse.Namespace, engines: dict[str, Any], metrics_url: str) -> list[Sample]:
    sessions = make_sessions(args.seed, args.sessions, args.turns, args.system_tokens, args.max_answer,
                             MODEL["vocab"])
    samples: list[Sample] = []
    for turn in range(args.turns):
        for session in sessions:
            message = user_message(args.seed, session.index, turn, session.user_lengths[turn], MODEL["vocab"])
            prompt = [*session.history, *message]
            if len(prompt) + session.answer_lengths[turn] >= args.max_model_len:
                continue  # this conversation is full
            order = ["baseline", "kvswap"] if (turn + session.index) % 2 == 0 else ["kvswap", "baseline"]
            order.append("ideal")
            got: dict[str, Sample] = {}
            for name in order:
                before = scrape(metrics_url) if name == "kvswap" else {}
                result = engines[name].generate([prompt], session.answer_lengths[turn])[0]
                sample = Sample(name, session.index, turn, len(prompt), result["ttft_s"], result["e2e_s"],
                                result["num_cached_tokens"], tokens=result["tokens"], logprobs=result["logprobs"])
                if name == "kvswap":
                    after = scrape(metrics_url)
                    loaded = delta(after, before, 'kvswap_blocks_total{op="swap_in",status="loaded"}')
                    host = delta(after, before, 'kvswap_tier_ops_total{op="get",result="hit",tier="host"}')
                    sample.external_tokens = int(loaded) * BLOCK
                    sample.host_tokens = int(min(host, loaded)) * BLOCK
                    sample.file_tokens = sample.external_tokens - sample.host_tokens
                got[name] = sample
                samples.append(sample)
            session.history = [*prompt, *got["baseline"].tokens]
        print(f"turn {turn} done", flush=True)
    return samples


def compare(samples: list[Sample], run: str, reference: str) -> dict[str, Any]:
    """Token and logprob differences of ``run``'s answers against ``reference``'s."""
    by_key = {(s.run, s.session, s.turn): s for s in samples}
    result: dict[str, Any] = {"compared": 0, "token_mismatches": 0, "max_abs_logprob_diff": 0.0, "differing": []}
    for s in samples:
        ref = by_key.get((reference, s.session, s.turn))
        if s.run != run or ref is None:
            continue
        result["compared"] += 1
        diff = max((abs(a - b) for a, b in zip(s.logprobs, ref.logprobs)), default=0.0)
        result["max_abs_logprob_diff"] = max(result["max_abs_logprob_diff"], diff)
        if s.tokens != ref.tokens:
            result["token_mismatches"] += 1
            first = next(i for i, (a, b) in enumerate(zip(s.tokens, ref.tokens)) if a != b)
            result["differing"].append({"session": s.session, "turn": s.turn, "first_token": first,
                                        "kvswap_tokens_loaded": by_key[("kvswap", s.session, s.turn)].external_tokens})
    return result


def summarize(samples: list[Sample], connector: dict[str, Any], daemon_metrics: dict[str, float]) -> dict[str, Any]:
    by_key = {(s.run, s.session, s.turn): s for s in samples}
    turns = sorted({s.turn for s in samples})
    table = []
    for turn in turns:
        # Each request ran on both engines back to back: its own ratio cancels the machine's
        # slow and fast phases, which a shared 2-core host has plenty of.
        ratios = [by_key[("baseline", s.session, turn)].ttft_s / s.ttft_s
                  for s in samples if s.run == "kvswap" and s.turn == turn]
        row: dict[str, Any] = {"turn": turn, "paired_speedup_p50": percentile(ratios, 50)}
        for name in ("baseline", "kvswap"):
            group = [s for s in samples if s.run == name and s.turn == turn]
            ttft = [s.ttft_s * 1e3 for s in group]
            prompt = sum(s.prompt_tokens for s in group)
            engine_cache = sum(s.cached_tokens - s.external_tokens for s in group)
            row[name] = {"n": len(group), "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
                         "prompt_tokens": prompt, "engine_cache_tokens": engine_cache,
                         "kvswap_host_tokens": sum(s.host_tokens for s in group),
                         "kvswap_file_tokens": sum(s.file_tokens for s in group),
                         "recomputed_tokens": prompt - sum(s.cached_tokens for s in group)}
        table.append(row)
    totals = {}
    for name in ("baseline", "kvswap", "ideal"):
        group = [s for s in samples if s.run == name]
        prompt = sum(s.prompt_tokens for s in group) or 1
        ttft = [s.ttft_s * 1e3 for s in group]
        totals[name] = {"ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
                        "requests": len(group), "e2e_mean_ms": sum(s.e2e_s for s in group) * 1e3 / max(1, len(group)),
                        "hit_engine_cache": sum(s.cached_tokens - s.external_tokens for s in group) / prompt,
                        "hit_kvswap_host": sum(s.host_tokens for s in group) / prompt,
                        "hit_kvswap_file": sum(s.file_tokens for s in group) / prompt,
                        "recomputed": (prompt - sum(s.cached_tokens for s in group)) / prompt}
    ratios = [by_key[("baseline", s.session, s.turn)].ttft_s / s.ttft_s for s in samples if s.run == "kvswap"]
    totals["paired_speedup_p50"] = percentile(ratios, 50)
    count = daemon_metrics.get('kvswap_request_duration_seconds_count{op="lookup"}', 0.0)
    return {"per_turn": table, "totals": totals,
            "outputs": {"kvswap_vs_ideal": compare(samples, "kvswap", "ideal"),
                        "baseline_vs_ideal": compare(samples, "baseline", "ideal"),
                        "kvswap_vs_baseline": compare(samples, "kvswap", "baseline")},
            "lookup_engine_ms": connector.get("lookup_ms"), "connector": connector,
            "daemon_lookups": count}


def plot(samples: list[Sample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    turns = sorted({s.turn for s in samples})
    ideal = [percentile([s.ttft_s * 1e3 for s in samples if s.run == "ideal" and s.turn == t], 50) for t in turns]
    ax.plot([t + 1 for t in turns], ideal, ":", color="gray", label="vLLM, cache never evicts (reference), p50")
    for name, color in (("baseline", "tab:red"), ("kvswap", "tab:blue")):
        p50 = [percentile([s.ttft_s * 1e3 for s in samples if s.run == name and s.turn == t], 50) for t in turns]
        p99 = [percentile([s.ttft_s * 1e3 for s in samples if s.run == name and s.turn == t], 99) for t in turns]
        xs = [t + 1 for t in turns]
        label = "vLLM prefix cache only" if name == "baseline" else "vLLM + kvswap"
        ax.plot(xs, p50, "-o", color=color, label=f"{label}, p50")
        ax.plot(xs, p99, "--", color=color, alpha=0.6, label=f"{label}, p99")
        offset = -0.08 if name == "baseline" else 0.08
        ax.scatter([s.turn + 1 + offset for s in samples if s.run == name],
                   [s.ttft_s * 1e3 for s in samples if s.run == name], color=color, s=8, alpha=0.35)
    ax.set_xlabel("turn of the conversation")
    ax.set_ylabel("time to first token (ms)")
    ax.set_xticks([t + 1 for t in turns])
    ax.set_title("Multi-turn replay, CPU vLLM: TTFT by turn")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_report(report: dict[str, Any]) -> None:
    print("\nturn | n  | baseline TTFT p50/p99 ms | kvswap TTFT p50/p99 ms | paired speedup p50 | "
          "prompt tok | engine cache (base/kvswap) | kvswap host/file | recomputed (base/kvswap)")
    for row in report["per_turn"]:
        b, k = row["baseline"], row["kvswap"]
        print(f"{row['turn'] + 1:4d} | {b['n']:2d} | {b['ttft_p50_ms']:8.1f} / {b['ttft_p99_ms']:8.1f} | "
              f"{k['ttft_p50_ms']:8.1f} / {k['ttft_p99_ms']:8.1f} | {row['paired_speedup_p50']:6.2f}x | "
              f"{b['prompt_tokens']:7d} | {b['engine_cache_tokens']:6d} / {k['engine_cache_tokens']:6d} | "
              f"{k['kvswap_host_tokens']:6d} / {k['kvswap_file_tokens']:6d} | "
              f"{b['recomputed_tokens']:6d} / {k['recomputed_tokens']:6d}")
    for name, t in report["totals"].items():
        if name == "paired_speedup_p50":
            print(f"paired TTFT speedup (baseline / kvswap, same request), p50: {t:.2f}x")
            continue
        print(f"{name:8s}: {t['requests']} requests, TTFT p50 {t['ttft_p50_ms']:.1f} ms, p99 {t['ttft_p99_ms']:.1f} ms, "
              f"mean request {t['e2e_mean_ms']:.0f} ms; prompt tokens from "
              f"engine cache {t['hit_engine_cache']:.1%}, kvswap host {t['hit_kvswap_host']:.1%}, kvswap file "
              f"{t['hit_kvswap_file']:.1%}, recomputed {t['recomputed']:.1%}")
    for name, o in report["outputs"].items():
        print(f"outputs {name}: {o['compared']} compared, {o['token_mismatches']} differ in tokens, "
              f"max |logprob diff| {o['max_abs_logprob_diff']:.3g}")
    lookup = report.get("lookup_engine_ms") or {}
    print(f"lookup as the engine saw it: n={lookup.get('n')}, p50 {lookup.get('p50', float('nan')):.2f} ms, "
          f"p99 {lookup.get('p99', float('nan')):.2f} ms")
    policy = report.get("connector", {}).get("policy", {})
    if policy:
        print(f"load policy: {json.dumps(policy)}")


def main() -> int:
    parser = argparse.ArgumentParser(description="Multi-turn replay: vLLM with and without kvswap.")
    parser.add_argument("--python", required=True, help="an interpreter with vllm-cpu and kvswap installed")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--max-answer", type=int, default=8, help="tokens generated per answer at most")
    parser.add_argument("--cache-blocks", type=int, default=72, help="the engine's own KV cache, in blocks")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--host-tier-mib", type=int, default=16)
    parser.add_argument("--ideal-cache-blocks", type=int, default=1024,
                        help="the reference engine's cache, large enough never to evict")
    parser.add_argument("--load-policy", default="when_faster")
    parser.add_argument("--out", default="replay-out")
    args = parser.parse_args()
    report = run(args)
    print_report(report)
    print(f"\nplot: {Path(args.out) / 'ttft_by_turn.png'}; data: {Path(args.out) / 'replay.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
