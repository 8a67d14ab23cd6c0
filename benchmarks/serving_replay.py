"""Multi-turn serving replay: a vLLM engine (CPU) with and without kvswap underneath.

    python benchmarks/serving_replay.py --python /work/venv-vllm/bin/python [--sessions 16 --turns 4]
                                        [--concurrency 8]

Many chat sessions, seeded: every session starts with one system prompt shared by all, then
each turn appends a user message and the model's answer to the conversation, and the next
turn sends the whole conversation again. Message lengths are drawn from log-normal
distributions shaped like ShareGPT's (user messages: median ~110 tokens with a long tail of
pasted text; answers: median ~200, capped at ``--max-answer`` generated tokens because CPU
decode costs ~5-20 ms a token here). Sessions take turns round-robin (turn 1 of every
session, then turn 2, ...), so between two turns of one session the other sessions' turns run
through the engine: with the engine's own prefix cache sized to ``--cache-blocks`` blocks,
earlier turns are evicted and must come back from kvswap or be recomputed.

``--concurrency N`` keeps up to N sessions in flight at once on an engine (requests go in with
the engine process's ``submit`` op and vLLM batches them step by step). Turns are taken in the
same round-robin order; a session's next turn goes in only once its previous answer has come
back, so with N of S sessions in flight a session's turns are about S requests apart, as at N
= 1. N = 1 is the old one-request-at-a-time replay.

Three engines, one run each: ``ideal`` (vLLM with a cache so large it never evicts), then
``baseline`` (vLLM's own prefix cache only), then ``kvswap`` (the connector, kvswapd with a RAM
tier of ``--host-tier-mib``, staging of ``--staging-mib`` and the file tier).

- **The same conversation for all three.** ``ideal`` runs first and its answers are the
  conversation: baseline and kvswap are sent the same prompts, token for token, whatever they
  answer themselves (answers always have their drawn length: greedy, EOS ignored). ``ideal``
  is the reference for "identical": a block's KV is reused exactly as it was computed,
  including blocks filled one token at a time by decode steps, whose KV differs in its last
  bits from the same tokens recomputed in a prefill. kvswap should match ``ideal`` token for
  token; the baseline, which recomputes, may not. At N > 1 the batches differ from run to run
  (which requests share a step depends on timing), and a batch's arithmetic may differ in its
  last bits too, so mismatches there are not all kvswap's or the baseline's; ``preemptions``
  counts requests vLLM preempted (recomputed), another source.
- **One run after another, never overlapping.** On a 2-core machine two engines stepping at
  once would take each other's CPU, and at N > 1 what is measured is how a run's own requests
  share the engine (TTFT of one while others decode, the time between another's tokens while
  one loads). Interleaving request by request, as the replay did at N = 1 (each request on all
  three engines back to back, so the machine's slow phases hit all alike), cannot keep N in
  flight on each. The price: the runs are minutes apart, so a shared machine's noise no longer
  cancels in ``paired_speedup`` (still each request's baseline/kvswap TTFT ratio, same prompt).
  kvswapd is idle but for the kvswap run, so its metrics' change over that run is kvswap's alone.
- **Warm engines.** Before its run each engine answers one request of tokens no turn shares
  and empties its prefix cache: a fresh engine's first requests pay one-time costs (in a smoke
  run without it, the first turn's TTFT p99 was 1.7 s against 0.2 s after, and the kvswap
  engine's first lookup 0.8 s). The connector's stats count that request's lookup too.

Reports per turn index and run: TTFT p50/p99, inter-token latency (ITL: time between two
output tokens of a request, from the time each step first shows a token) p50/p99; prompt tokens
served by the engine's cache, by kvswap (what the connector claimed for each request) and per
tier (host, file; per request only at N = 1, where the daemon's counters change for one request
at a time; per run at any N) and recomputed; per run output tokens per second; the connector's
stats (lookup latency as the engine saw it, load policy, counts); and a plot of TTFT and ITL by
turn (``--out``/ttft_by_turn.png, where matplotlib is installed).

Sizing (defaults): a block is 32 tokens, 128 KiB of KV. ``--cache-blocks`` defaults to the
system prompt's 8 blocks and 24 per session in flight, at least 72 (72 at N = 1 and 2, 200 at N
= 8): room for the requests running (they share the system prompt; a turn's own blocks are ~5-40)
but not for every session's history (16 sessions x 4 turns: ~330 distinct blocks by the last
turn; 8 x 5: ~170). kvswapd's RAM is its RAM tier and its staging: a record stays in the
staging slot it was written or read through until the slot is needed (one copy, see
daemon/staging.py), so with the daemon's default staging (256 + 64 MiB) every record here
stays in RAM and files never serve. The replay gives kvswapd a 4 MiB RAM tier and 8 MiB each
of write and read staging (a request's blocks, at most 64, fit one swap): at most 160 blocks
in RAM, less than either history, so the file tier serves too (16 sessions x 3 turns at N = 2:
27% of the loaded tokens from RAM, 73% from files; with an 8 MiB RAM tier and the default
staging, 100% from RAM). A full staging makes kvswapd answer busy; the connector then
recomputes, and the report's connector line counts the failed loads and saves.
The run prints these numbers and warns when a cache holds the whole history (with every
session in flight, N = sessions, nothing is left to evict: the running requests are the
history).

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
import shutil
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
RUNS = ("ideal", "baseline", "kvswap")  # in the order they run; ideal's answers are the conversation
CACHE_BLOCKS_PER_SLOT = 24
REQUEST_TIMEOUT_S = 900.0


def _engine_module() -> Any:
    spec = importlib.util.spec_from_file_location("vllm_engine", HERE / "vllm_engine.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def block_bytes(model: dict[str, int], block: int = BLOCK) -> int:
    head_dim = model["hidden"] // model["heads"]
    return model["layers"] * 2 * model["kv_heads"] * head_dim * block * 2  # bf16


def kvswapd_ram_blocks(host_tier_mib: int, staging_mib: int) -> int:
    """Records kvswapd can keep in RAM at most: its RAM tier, and its write and read staging,
    whose idle slots keep the records they moved.

    >>> kvswapd_ram_blocks(4, 8)
    160
    """
    return ((host_tier_mib + 2 * staging_mib) << 20) // block_bytes(MODEL)


def default_cache_blocks(concurrency: int, system_tokens: int) -> int:
    """The engine's own cache: room for ``concurrency`` requests running (the system prompt's
    blocks, shared, and a turn's own, ~5-40 blocks), not for every session's history; never
    under 72 blocks (2,304 tokens: one request of ``--max-model-len`` 2048 must fit).

    >>> default_cache_blocks(1, 256), default_cache_blocks(2, 256), default_cache_blocks(8, 256)
    (72, 72, 200)
    """
    return max(72, system_tokens // BLOCK + CACHE_BLOCKS_PER_SLOT * concurrency)


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


class Conversation:
    """Every session's prompts, built from the answers given so far (the ``ideal`` run's).

    A turn whose prompt and answer would not fit in ``max_model_len`` is skipped (None), and
    the conversation goes on without it, as it always did; answers have a fixed length, so
    which turns are skipped does not depend on what the engine answered.
    """

    def __init__(self, sessions: list[Session], seed: int, max_model_len: int, vocab: int) -> None:
        self.sessions = sessions
        self.seed = seed
        self.max_model_len = max_model_len
        self.vocab = vocab

    def answer_tokens(self, session: int, turn: int) -> int:
        return self.sessions[session].answer_lengths[turn]

    def prompt(self, session: int, turn: int, answers: dict[tuple[int, int], list[int]]) -> list[int] | None:
        s = self.sessions[session]
        history = list(s.history)
        for t in range(turn + 1):
            prompt = [*history, *user_message(self.seed, session, t, s.user_lengths[t], self.vocab)]
            if len(prompt) + s.answer_lengths[t] >= self.max_model_len:
                if t == turn:
                    return None
                continue  # this turn was skipped: the history goes on without it
            if t == turn:
                return prompt
            history = [*prompt, *answers[(session, t)]]
        raise AssertionError("unreachable")

    def working_set_blocks(self, turns: int) -> int:
        """Distinct full blocks in all prompts: the shared system prompt's once, then each
        session's longest prompt's (a session's prompts are prefixes of its later ones).
        Answers are stood in by zeros: only lengths count here."""
        shared = len(self.sessions[0].history) // BLOCK if self.sessions else 0
        total = shared
        for s in self.sessions:
            answers = {(s.index, t): [0] * s.answer_lengths[t] for t in range(turns)}
            longest = max((len(p) for t in range(turns)
                           if (p := self.prompt(s.index, t, answers)) is not None), default=0)
            total += longest // BLOCK - shared
        return total


def schedule(sessions: int, turns: int) -> list[tuple[int, int]]:
    """(turn, session) in the order turns are offered: round-robin, every session's turn 0 first.

    >>> schedule(2, 2)
    [(0, 0), (0, 1), (1, 0), (1, 1)]
    """
    return [(t, s) for t in range(turns) for s in range(sessions)]


def next_job(pending: list[tuple[int, int]], busy: set[int]) -> int | None:
    """Index in ``pending`` of the first turn whose session has nothing in flight (its earlier
    turns come before it in ``pending``, so they have all been taken, and done).

    >>> next_job([(0, 1), (1, 0), (1, 1)], busy={1})
    1
    """
    return next((i for i, (_, s) in enumerate(pending) if s not in busy), None)


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


LOADED = 'kvswap_blocks_total{op="swap_in",status="loaded"}'
HOST_HITS = 'kvswap_tier_ops_total{op="get",result="hit",tier="host"}'


def tier_tokens(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    """Tokens kvswapd loaded between two scrapes, and from which tier.

    >>> tier_tokens({LOADED: 5, HOST_HITS: 3}, {LOADED: 1})
    {'loaded': 128, 'host': 96, 'file': 32}
    """
    loaded = delta(after, before, LOADED)
    host = min(delta(after, before, HOST_HITS), loaded)
    return {"loaded": int(loaded) * BLOCK, "host": int(host) * BLOCK, "file": int(loaded - host) * BLOCK}


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
    external_tokens: int = 0  # what the connector claimed for this request (0 without kvswap)
    host_tokens: int | None = 0  # of those, loaded from each tier: None where not known (N > 1)
    file_tokens: int | None = 0
    preemptions: int = 0
    submitted_s: float = 0.0  # since its run started
    token_times_s: list[float] = field(default_factory=list)  # since its arrival, per output token
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(1, math.ceil(len(ordered) * q / 100))
    return ordered[rank - 1]


def inter_token_ms(token_times_s: list[float]) -> list[float]:
    """Milliseconds between consecutive output tokens of one request.

    >>> [round(x, 6) for x in inter_token_ms([0.5, 0.52, 0.6])]
    [20.0, 80.0]
    """
    return [(b - a) * 1e3 for a, b in zip(token_times_s, token_times_s[1:])]


def itl_stats(samples: list[Sample]) -> dict[str, float]:
    """ITL p50/p99 over every gap between two tokens of the same request, all requests pooled."""
    gaps = [g for s in samples for g in inter_token_ms(s.token_times_s)]
    return {"itl_p50_ms": percentile(gaps, 50), "itl_p99_ms": percentile(gaps, 99)}


def run_one(name: str, engine: Any, conversation: Conversation, answers: dict[tuple[int, int], list[int]],
            concurrency: int, turns: int, metrics_url: str | None) -> tuple[list[Sample], dict[str, Any]]:
    """One engine's replay with up to ``concurrency`` sessions in flight. With ``name ==
    "ideal"`` the answers it gives are written into ``answers`` (the conversation); the other
    runs read them. ``metrics_url`` (kvswap's run): per-request tiers at concurrency 1, the
    run's tiers at any."""
    pending = schedule(len(conversation.sessions), turns)
    in_flight: dict[str, tuple[int, int, int, float, dict[str, float]]] = {}
    busy: set[int] = set()
    samples: list[Sample] = []
    per_request_tiers = metrics_url is not None and concurrency == 1
    run_before = scrape(metrics_url) if metrics_url else {}
    started = time.monotonic()
    while pending or in_flight:
        while len(in_flight) < concurrency and (i := next_job(pending, busy)) is not None:
            turn, session = pending.pop(i)
            prompt = conversation.prompt(session, turn, answers)
            if prompt is None:
                continue  # this conversation is full
            before = scrape(metrics_url) if per_request_tiers and metrics_url else {}
            submitted = time.monotonic() - started
            rid = engine.submit(prompt, conversation.answer_tokens(session, turn), request_id=f"{name}-{session}-{turn}")
            in_flight[rid] = (session, turn, len(prompt), submitted, before)
            busy.add(session)
        if not in_flight:
            continue
        done = engine.wait(list(in_flight), REQUEST_TIMEOUT_S)
        session, turn, prompt_tokens, submitted, before = in_flight.pop(done["id"])
        busy.discard(session)
        sample = Sample(name, session, turn, prompt_tokens, done["ttft_s"], done["e2e_s"], done["num_cached_tokens"],
                        external_tokens=int(done.get("external_tokens", 0)), preemptions=int(done.get("preemptions", 0)),
                        submitted_s=submitted, token_times_s=done["token_times_s"], tokens=done["tokens"],
                        logprobs=done["logprobs"])
        if metrics_url is not None:
            if per_request_tiers:
                tiers = tier_tokens(scrape(metrics_url), before)
                sample.host_tokens, sample.file_tokens = tiers["host"], tiers["file"]
            else:
                sample.host_tokens = sample.file_tokens = None
        if name == "ideal":
            answers[(session, turn)] = done["tokens"]
        samples.append(sample)
    wall = time.monotonic() - started
    info: dict[str, Any] = {"wall_s": wall}
    if metrics_url:
        info["kvswap_tiers"] = tier_tokens(scrape(metrics_url), run_before)
    print(f"{name}: {len(samples)} requests in {wall:.0f} s", flush=True)
    return samples, info


def warm_up(engine: Any, seed: int, tokens: int) -> None:
    """One request of tokens no turn shares, then an empty prefix cache: a fresh engine's first
    requests pay one-time costs (measured: the first turn's TTFT p99 1.7 s against ~0.2 s, a
    first lookup of 0.8 s), which would land on whichever session came first."""
    rng = random.Random(f"{seed}:warm-up")
    engine.generate([[rng.randrange(3, MODEL["vocab"]) for _ in range(tokens)]], 4)
    engine.call({"op": "reset_prefix_cache"})


def run(args: argparse.Namespace) -> dict[str, Any]:
    mod = _engine_module()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sessions = make_sessions(args.seed, args.sessions, args.turns, args.system_tokens, args.max_answer, MODEL["vocab"])
    conversation = Conversation(sessions, args.seed, args.max_model_len, MODEL["vocab"])
    sizing = {"working_set_blocks": conversation.working_set_blocks(args.turns), "cache_blocks": args.cache_blocks,
              "kvswapd_ram_blocks_at_most": kvswapd_ram_blocks(args.host_tier_mib, args.staging_mib)}
    print(f"sizing: the conversation's distinct full blocks ~{sizing['working_set_blocks']}, engine cache "
          f"{args.cache_blocks} blocks, kvswapd's RAM (tier and staging) at most {sizing['kvswapd_ram_blocks_at_most']} "
          "blocks", flush=True)
    if args.cache_blocks >= sizing["working_set_blocks"]:
        print("warning: the engine's own cache holds the whole history; kvswap has little to serve", flush=True)
    elif sizing["kvswapd_ram_blocks_at_most"] >= sizing["working_set_blocks"]:
        print("warning: kvswapd's RAM can hold the whole history; the file tier may serve nothing", flush=True)
    work = Path(tempfile.mkdtemp(prefix="kvswap-replay-"))
    model_dir = mod.make_model_dir(str(work / "model"), MODEL["layers"], MODEL["hidden"], MODEL["heads"],
                                   MODEL["kv_heads"], MODEL["intermediate"], MODEL["vocab"])
    port, metrics_port = free_port(), free_port()
    metrics_url = f"http://127.0.0.1:{metrics_port}"
    daemon_log = open(out / "kvswapd.log", "wb")
    daemon = subprocess.Popen([sys.executable, "-m", "kvswap.daemon", "--cache-queue-port", str(port),
                               "--metrics-port", str(metrics_port), "--storage-dir", str(work / "store"),
                               "--host-tier-bytes", str(args.host_tier_mib << 20),
                               "--write-staging-bytes", str(args.staging_mib << 20),
                               "--read-staging-bytes", str(args.staging_mib << 20)],
                              stdout=daemon_log, stderr=subprocess.STDOUT)
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    common = ["--model", model_dir, "--block-size", str(BLOCK), "--block-bytes", str(block_bytes(MODEL)),
              "--max-model-len", str(args.max_model_len)]
    stats_file = out / "connector-stats.json"
    argv = {"ideal": [*common, "--cache-blocks", str(args.ideal_cache_blocks)],
            "baseline": [*common, "--cache-blocks", str(args.cache_blocks)],
            "kvswap": [*common, "--cache-blocks", str(args.cache_blocks), "--endpoint", f"tcp://127.0.0.1:{port}",
                       "--stats-file", str(stats_file), "--load-policy", args.load_policy]}
    engines: dict[str, Any] = {}
    samples: list[Sample] = []
    runs: dict[str, dict[str, Any]] = {}
    answers: dict[tuple[int, int], list[int]] = {}
    try:
        started = time.monotonic()
        for name in RUNS:
            engines[name] = mod.EngineProcess(args.python, argv[name], str(out / f"engine-{name}.log"), env=env)
        print(f"engines up in {time.monotonic() - started:.0f} s", flush=True)
        for name in RUNS:
            warm_up(engines[name], args.seed, args.system_tokens + 2 * BLOCK)
            got, runs[name] = run_one(name, engines[name], conversation, answers, args.concurrency, args.turns,
                                      metrics_url if name == "kvswap" else None)
            samples += got
        lookup_daemon = scrape(metrics_url)
    finally:
        for engine in engines.values():
            engine.close()
        daemon.terminate()
        daemon.wait(30)
        daemon_log.close()
        shutil.rmtree(work, ignore_errors=True)  # the model (~210 MB) and kvswapd's files
    connector = json.loads(stats_file.read_text()) if stats_file.exists() else {}
    report = summarize(samples, connector, lookup_daemon, runs)
    report["config"] = {**vars(args), "model": MODEL, "block_size": BLOCK, "run_order": list(RUNS), **sizing}
    report["samples"] = [{k: v for k, v in vars(s).items() if k not in ("tokens", "logprobs")} for s in samples]
    (out / "replay.json").write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(samples, out / "ttft_by_turn.png", args.concurrency)
    return report


# -- the report (pure functions of the samples) -------------------------------------------------------


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
            first = next((i for i, (a, b) in enumerate(zip(s.tokens, ref.tokens)) if a != b),
                         min(len(s.tokens), len(ref.tokens)))
            loaded = by_key.get(("kvswap", s.session, s.turn))
            result["differing"].append({"session": s.session, "turn": s.turn, "first_token": first,
                                        "kvswap_tokens_loaded": loaded.external_tokens if loaded else None,
                                        "preemptions": s.preemptions + ref.preemptions})
    return result


def _sum_known(values: list[int | None]) -> int | None:
    """The sum, or None when any value is unknown.

    >>> _sum_known([1, 2]), _sum_known([1, None])
    (3, None)
    """
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def turn_rows(samples: list[Sample]) -> list[dict[str, Any]]:
    """Per turn index: each run's TTFT and ITL percentiles and where its prompt tokens came
    from, and the median of each request's own baseline/kvswap TTFT ratio."""
    by_key = {(s.run, s.session, s.turn): s for s in samples}
    table = []
    for turn in sorted({s.turn for s in samples}):
        ratios = [by_key[("baseline", s.session, turn)].ttft_s / s.ttft_s
                  for s in samples if s.run == "kvswap" and s.turn == turn and ("baseline", s.session, turn) in by_key]
        row: dict[str, Any] = {"turn": turn, "paired_speedup_p50": percentile(ratios, 50)}
        for name in ("baseline", "kvswap", "ideal"):
            group = [s for s in samples if s.run == name and s.turn == turn]
            ttft = [s.ttft_s * 1e3 for s in group]
            prompt = sum(s.prompt_tokens for s in group)
            row[name] = {"n": len(group), "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
                         **itl_stats(group), "prompt_tokens": prompt,
                         "engine_cache_tokens": sum(s.cached_tokens - s.external_tokens for s in group),
                         "kvswap_tokens": sum(s.external_tokens for s in group),
                         "kvswap_host_tokens": _sum_known([s.host_tokens for s in group]),
                         "kvswap_file_tokens": _sum_known([s.file_tokens for s in group]),
                         "recomputed_tokens": prompt - sum(s.cached_tokens for s in group),
                         "preemptions": sum(s.preemptions for s in group)}
        table.append(row)
    return table


def run_totals(samples: list[Sample], runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per run over all its requests; ``runs`` gives each run's wall time (first submit to last
    answer, for output tokens per second) and, for kvswap, the tokens each tier served."""
    by_key = {(s.run, s.session, s.turn): s for s in samples}
    totals: dict[str, Any] = {}
    for name in ("baseline", "kvswap", "ideal"):
        group = [s for s in samples if s.run == name]
        prompt = sum(s.prompt_tokens for s in group) or 1
        ttft = [s.ttft_s * 1e3 for s in group]
        info = runs.get(name, {})
        wall = info.get("wall_s") or 0.0
        tiers = info.get("kvswap_tiers") or {"host": 0, "file": 0}
        output = sum(len(s.tokens) for s in group)
        totals[name] = {"ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99), **itl_stats(group),
                        "requests": len(group), "e2e_mean_ms": sum(s.e2e_s for s in group) * 1e3 / max(1, len(group)),
                        "output_tokens": output, "wall_s": wall,
                        "output_tokens_per_s": output / wall if wall > 0 else float("nan"),
                        "preemptions": sum(s.preemptions for s in group),
                        "hit_engine_cache": sum(s.cached_tokens - s.external_tokens for s in group) / prompt,
                        "hit_kvswap": sum(s.external_tokens for s in group) / prompt,
                        "hit_kvswap_host": tiers["host"] / prompt,
                        "hit_kvswap_file": tiers["file"] / prompt,
                        "recomputed": (prompt - sum(s.cached_tokens for s in group)) / prompt}
    ratios = [by_key[("baseline", s.session, s.turn)].ttft_s / s.ttft_s
              for s in samples if s.run == "kvswap" and ("baseline", s.session, s.turn) in by_key]
    totals["paired_speedup_p50"] = percentile(ratios, 50)
    return totals


def summarize(samples: list[Sample], connector: dict[str, Any], daemon_metrics: dict[str, float],
              runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    count = daemon_metrics.get('kvswap_request_duration_seconds_count{op="lookup"}', 0.0)
    return {"per_turn": turn_rows(samples), "totals": run_totals(samples, runs),
            "outputs": {"kvswap_vs_ideal": compare(samples, "kvswap", "ideal"),
                        "baseline_vs_ideal": compare(samples, "baseline", "ideal"),
                        "kvswap_vs_baseline": compare(samples, "kvswap", "baseline")},
            "runs": runs, "lookup_engine_ms": connector.get("lookup_ms"), "connector": connector,
            "daemon_lookups": count}


def plot(samples: list[Sample], path: Path, concurrency: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_itl) = plt.subplots(1, 2, figsize=(12, 4.2))
    turns = sorted({s.turn for s in samples})
    xs = [t + 1 for t in turns]
    labels = {"baseline": "vLLM prefix cache only", "kvswap": "vLLM + kvswap",
              "ideal": "vLLM, cache never evicts (reference)"}
    for name, color in (("ideal", "gray"), ("baseline", "tab:red"), ("kvswap", "tab:blue")):
        groups = [[s for s in samples if s.run == name and s.turn == t] for t in turns]
        style = ":" if name == "ideal" else "-o"
        ax.plot(xs, [percentile([s.ttft_s * 1e3 for s in g], 50) for g in groups], style, color=color,
                label=f"{labels[name]}, p50")
        ax_itl.plot(xs, [itl_stats(g)["itl_p50_ms"] for g in groups], style, color=color, label=f"{labels[name]}, p50")
        if name == "ideal":
            continue
        ax.plot(xs, [percentile([s.ttft_s * 1e3 for s in g], 99) for g in groups], "--", color=color, alpha=0.6,
                label=f"{labels[name]}, p99")
        ax_itl.plot(xs, [itl_stats(g)["itl_p99_ms"] for g in groups], "--", color=color, alpha=0.6,
                    label=f"{labels[name]}, p99")
        offset = -0.08 if name == "baseline" else 0.08
        ax.scatter([s.turn + 1 + offset for s in samples if s.run == name],
                   [s.ttft_s * 1e3 for s in samples if s.run == name], color=color, s=8, alpha=0.35)
    for a, ylabel, title in ((ax, "time to first token (ms)", "TTFT by turn"),
                             (ax_itl, "time between output tokens (ms)", "inter-token latency by turn")):
        a.set_xlabel("turn of the conversation")
        a.set_ylabel(ylabel)
        a.set_xticks(xs)
        a.set_title(title)
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle(f"Multi-turn replay, CPU vLLM, up to {concurrency} session(s) in flight per engine")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _tokens(value: int | None) -> str:
    return "   n/a" if value is None else f"{value:6d}"


def print_report(report: dict[str, Any]) -> None:
    print("\nturn | n  | TTFT p50/p99 ms: baseline | kvswap | ideal | ITL p50/p99 ms: baseline | kvswap | ideal | "
          "paired speedup p50 | prompt tok | engine cache (base/kvswap) | kvswap (host/file) | "
          "recomputed (base/kvswap)")
    for row in report["per_turn"]:
        b, k, i = row["baseline"], row["kvswap"], row["ideal"]
        print(f"{row['turn'] + 1:4d} | {b['n']:2d} | {b['ttft_p50_ms']:7.1f} / {b['ttft_p99_ms']:7.1f} | "
              f"{k['ttft_p50_ms']:7.1f} / {k['ttft_p99_ms']:7.1f} | {i['ttft_p50_ms']:7.1f} / {i['ttft_p99_ms']:7.1f} | "
              f"{b['itl_p50_ms']:6.1f} / {b['itl_p99_ms']:6.1f} | {k['itl_p50_ms']:6.1f} / {k['itl_p99_ms']:6.1f} | "
              f"{i['itl_p50_ms']:6.1f} / {i['itl_p99_ms']:6.1f} | {row['paired_speedup_p50']:6.2f}x | "
              f"{b['prompt_tokens']:7d} | {b['engine_cache_tokens']:6d} / {k['engine_cache_tokens']:6d} | "
              f"{k['kvswap_tokens']:6d} ({_tokens(k['kvswap_host_tokens'])} / {_tokens(k['kvswap_file_tokens'])}) | "
              f"{b['recomputed_tokens']:6d} / {k['recomputed_tokens']:6d}")
    for name, t in report["totals"].items():
        if name == "paired_speedup_p50":
            print(f"paired TTFT speedup (baseline / kvswap, same request), p50: {t:.2f}x")
            continue
        print(f"{name:8s}: {t['requests']} requests in {t['wall_s']:.0f} s, {t['output_tokens_per_s']:.1f} output "
              f"tokens/s, TTFT p50 {t['ttft_p50_ms']:.1f} ms, p99 {t['ttft_p99_ms']:.1f} ms, ITL p50 "
              f"{t['itl_p50_ms']:.1f} ms, p99 {t['itl_p99_ms']:.1f} ms, mean request {t['e2e_mean_ms']:.0f} ms, "
              f"{t['preemptions']} preemptions; prompt tokens from engine cache {t['hit_engine_cache']:.1%}, kvswap "
              f"{t['hit_kvswap']:.1%} (host {t['hit_kvswap_host']:.1%}, file {t['hit_kvswap_file']:.1%}), "
              f"recomputed {t['recomputed']:.1%}")
    for name, o in report["outputs"].items():
        print(f"outputs {name}: {o['compared']} compared, {o['token_mismatches']} differ in tokens, "
              f"max |logprob diff| {o['max_abs_logprob_diff']:.3g}")
    lookup = report.get("lookup_engine_ms") or {}
    print(f"lookup as the engine saw it: n={lookup.get('n')}, p50 {lookup.get('p50', float('nan')):.2f} ms, "
          f"p99 {lookup.get('p99', float('nan')):.2f} ms")
    counts = report.get("connector", {}).get("counts", {})
    errors = report.get("connector", {}).get("errors", {})
    if counts or errors:  # a busy daemon (staging full) shows here as failed loads or saves
        print(f"connector: {counts.get('tokens_loaded', 0)} tokens loaded, {counts.get('tokens_load_failed', 0)} "
              f"failed to load, {counts.get('blocks_saved', 0)} blocks saved, {counts.get('save_failures', 0)} "
              f"save failures; errors {json.dumps(errors)}")
    policy = report.get("connector", {}).get("policy", {})
    if policy:
        print(f"load policy: {json.dumps(policy)}")


def main() -> int:
    parser = argparse.ArgumentParser(description="Multi-turn replay: vLLM with and without kvswap.")
    parser.add_argument("--python", required=True, help="an interpreter with vllm-cpu and kvswap installed")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=1, help="sessions in flight at once on each engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--max-answer", type=int, default=8, help="tokens generated per answer at most")
    parser.add_argument("--cache-blocks", type=int, default=None,
                        help=f"the engine's own KV cache, in blocks [default: the system prompt's and "
                             f"{CACHE_BLOCKS_PER_SLOT} per session in flight, at least 72]")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--host-tier-mib", type=int, default=4)
    parser.add_argument("--staging-mib", type=int, default=8,
                        help="kvswapd's write staging and its read staging, each; idle staging slots keep records "
                             "too, so they count as RAM tier")
    parser.add_argument("--ideal-cache-blocks", type=int, default=1024,
                        help="the reference engine's cache, large enough never to evict")
    parser.add_argument("--load-policy", default="when_faster")
    parser.add_argument("--out", default="replay-out")
    args = parser.parse_args()
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    if args.cache_blocks is None:
        args.cache_blocks = default_cache_blocks(args.concurrency, args.system_tokens)
    if (args.cache_blocks - 1) * BLOCK < args.max_model_len:  # vLLM refuses to start, after a minute
        parser.error(f"--cache-blocks {args.cache_blocks} holds {(args.cache_blocks - 1) * BLOCK} tokens (vLLM keeps "
                     f"one block back), fewer than --max-model-len {args.max_model_len}: vLLM needs room for one "
                     "request of that length")
    # Known before any engine starts: a missing matplotlib costs the plot, never the run.
    args.plot = importlib.util.find_spec("matplotlib") is not None
    if not args.plot:
        print(f"matplotlib is not installed for {sys.executable} (pip install 'kvswap[bench]'): the run goes on "
              "without the plot", flush=True)
    started = time.monotonic()
    report = run(args)
    print_report(report)
    plot_note = f"plot: {Path(args.out) / 'ttft_by_turn.png'}; " if args.plot else "no plot (no matplotlib); "
    print(f"\n{plot_note}data: {Path(args.out) / 'replay.json'}; {time.monotonic() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
