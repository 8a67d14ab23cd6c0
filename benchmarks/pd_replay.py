"""Prefill/decode disaggregation, end to end: two vLLM engines (CPU), each beside its own
kvswapd, one shared pool, a proxy in front; multi-turn sessions through it, against one engine
that never evicts (the reference) and against the same pair without kvswap.

    python benchmarks/pd_replay.py --python <vllm venv python> --out DIR [--seed S]
                                   [--sessions N --turns T] [--pool redis-cluster|redis|mooncake]

The flow per request (the shape of vLLM's disaggregated-serving proxy, :class:`Proxy`):

1. the proxy sends the prompt to the **prefill** engine with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": true}``. The prefill's kvswapd retrieves from the
   pool only (``--retrieve-locations remote``): the conversation's history, stored there by the
   decode node in earlier turns, is loaded from it instead of recomputed; what the prefill
   computes is saved to its daemon's RAM (``--store-locations host``), from where it is
   exported. The finished request returns the params the decode needs (kvswap/engines/vllm/pd.py);
2. the proxy sends the same prompt to the **decode** engine with those params. Its connector
   looks the prompt up in its own kvswapd with ``peer`` set: the daemon pulls the blocks it
   lacks from the prefill's daemon, directly (step 1), waits for blocks still being written
   there, and writes them, with every block the decode engine saves, to the pool
   (``--store-locations host,remote``);
3. the next turn's prefill finds the whole history in the pool.

Before each prefill request the prefill engine's own prefix cache is emptied: each turn lands
on a prefill node that has not served the session (what a router spreading turns over many
prefill nodes sees, and what the pool is for); the decode engine keeps its cache.

Runs, one after another (2 cores: never two runs at once): ``reference`` (one engine, no
kvswap, a cache that never evicts; its answers are the conversation, so every run is sent the
same prompts), ``without_kvswap`` (the same pair and proxy, no connector: decode recomputes the
prompt; skipped with ``--no-pair``), ``pd`` (the pair on kvswap).

``DIR/pd_replay.json``: ``per_turn[i]`` with ``turn``, ``requests``, ``decode.{prompt_tokens,
loaded_tokens, recomputed_tokens, last_partial_tokens}``, ``prefill.{prompt_tokens,
history_tokens, loaded_from_pool_tokens, recomputed_tokens}`` (history: the tokens before this
turn's user message: the system prompt and earlier turns), ``ttft_p50_ms``, ``ttft_p99_ms`` (the
proxy's: from sending the prefill request to the decode's first token), ``without_kvswap`` and
``reference`` with the same TTFTs; ``outputs.pd_vs_reference.{compared, token_mismatches}``;
``direct.{records, bytes, seconds}`` (step 1, the decode daemon's pulls). The model is
serving_replay.py's (``--tiny``: the connector test's 2-layer shape, for CI).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
#: The deployment examples both nodes start from (daemons and engines).
DEPLOY = REPO / "deploy" / "tiers"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _load(name: str) -> Any:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    assert spec is not None and spec.loader is not None
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


replay = _load("serving_replay")
BLOCK = replay.BLOCK
TINY_MODEL = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512, "vocab": 1024}
REQUEST_TIMEOUT_S = 600.0
#: kvswapd's series this replay reads, per request.
POOL_HITS = 'kvswap_tier_ops_total{op="get",result="hit",tier="remote"}'
LOADED = replay.LOADED


# -- the proxy ----------------------------------------------------------------------------------------


class Proxy:
    """The disaggregated-serving proxy: the prompt to the prefill engine with ``max_tokens=1``
    and ``do_remote_decode``, then to the decode engine with the params the prefill returned.
    Engines are benchmarks/vllm_engine.py's ``EngineProcess``es (with or without kvswap).

    ``fresh_prefill``: empty the prefill engine's own prefix cache before each request (each
    turn on a prefill node that has not seen the session)."""

    def __init__(self, prefill: Any, decode: Any, fresh_prefill: bool = True) -> None:
        self.prefill, self.decode, self.fresh_prefill = prefill, decode, fresh_prefill

    def complete(self, prompt: list[int], max_tokens: int, rid: str,
                 decode_params: dict[str, Any] | None = None) -> dict[str, Any]:
        """One request through both engines: ``{"prefill", "decode"}`` (their completions),
        ``params`` (what went to the decode), ``ttft_s`` (from sending the prefill request to
        the decode's first token, on this host's monotonic clock, which the engines share).
        ``decode_params``: send these to the decode instead of the prefill's (a test's own)."""
        if self.fresh_prefill:
            self.prefill.call({"op": "reset_prefix_cache"})
        started = time.monotonic()
        first = self.prefill.result(self.prefill.submit(prompt, 1, f"{rid}-p",
                                                        kv_transfer_params={"do_remote_decode": True}),
                                    REQUEST_TIMEOUT_S)
        prefilled = time.monotonic()
        params = decode_params if decode_params is not None else first.get("kv_transfer_params")
        done = self.decode.result(self.decode.submit(prompt, max_tokens, f"{rid}-d", kv_transfer_params=params),
                                  REQUEST_TIMEOUT_S)
        return {"prefill": first, "decode": done, "params": params, "prefill_s": prefilled - started,
                "ttft_s": done["arrival_s"] + done["ttft_s"] - started}


# -- the rig: pool, daemons, engines ------------------------------------------------------------------


def pool_server(kind: str, work: Path) -> tuple[Any, str]:
    """A pool on loopback, started as the tests start theirs, and its ``--remote-url``."""
    from kvswap.testing import remote_servers as rs

    work = work / f"pool-{kind}"
    work.mkdir(parents=True, exist_ok=True)
    if kind == "redis":
        server = rs.RedisServer(work).start()
        return server, server.url
    if kind == "redis-cluster":
        cluster = rs.RedisClusterServers(work).start()
        return cluster, cluster.url
    if kind == "mooncake":
        # Records live in the clients' segments: each daemon gives the pool 256 MiB (with none,
        # the pool has nowhere to put a record and every put fails).
        master = rs.MooncakeMaster(work).start()
        return master, master.url(segment="256MiB")
    raise ValueError(f"unknown pool {kind!r}")


def pd_daemons(work: Path, pool_url: str, host_tier_mib: int, transport: str = "auto") -> tuple[Any, Any]:
    """The prefill node's kvswapd and the decode node's, started from deploy/tiers/prefill.toml
    and decode.toml with this host's ports, directories, pool and sizes over them. The prefill
    retrieves from the pool only (the example: RAM, then the pool): like its engine's emptied
    prefix cache, a node that has not served the session."""
    from kvswap.daemon.tools.local_daemon import free_port
    from kvswap.testing.daemon_process import DaemonProcess

    daemons: list[Any] = []
    try:
        for role, retrieve in (("prefill", ["--retrieve-locations", "remote"]), ("decode", [])):
            port = free_port()
            daemon = DaemonProcess(work / f"{role}-store", port, free_port(), extra_args=[
                "--config", str(DEPLOY / f"{role}.toml"), "--host-tier-bytes", str(host_tier_mib << 20),
                "--remote-url", pool_url, *retrieve, "--peer-address", f"tcp://127.0.0.1:{port}",
                "--peer-transport", transport])
            daemons.append(daemon.start(timeout=60))
    except BaseException:
        for daemon in daemons:
            daemon.stop()
        raise
    return daemons[0], daemons[1]


def engine_argv(model_dir: str, model: dict[str, int], cache_blocks: int, max_model_len: int,
                endpoint: str = "", stats_file: str = "", extra: dict[str, Any] | None = None,
                role: str = "") -> list[str]:
    """vllm_engine.py's flags; with ``role`` (prefill or decode), the connector configured from
    deploy/tiers/vllm-<role>.json, this host's daemon and ``extra`` over it."""
    argv = ["--model", model_dir, "--block-size", str(BLOCK), "--block-bytes", str(replay.block_bytes(model)),
            "--max-model-len", str(max_model_len), "--cache-blocks", str(cache_blocks)]
    if role:
        argv += ["--kv-transfer-file", str(DEPLOY / f"vllm-{role}.json")]
    if endpoint:
        argv += ["--endpoint", endpoint, "--load-policy", "always"]
        if stats_file:
            argv += ["--stats-file", stats_file]
        if extra:
            argv += ["--connector-extra", json.dumps(extra)]
    return argv


def engine_env() -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ENABLE_V1_MULTIPROCESSING="0")


def start_engines(python: str, argv: dict[str, list[str]], log_dir: Path) -> dict[str, Any]:
    """The engines, started side by side (each start is ~15-30 s here, mostly imports and
    compiling; they overlap well). Every one that came up is closed if another failed."""
    from concurrent.futures import ThreadPoolExecutor

    mod = _load("vllm_engine")
    with ThreadPoolExecutor(len(argv)) as pool:
        futures = {name: pool.submit(mod.EngineProcess, python, args, str(log_dir / f"engine-{name}.log"),
                                     env=engine_env()) for name, args in argv.items()}
    engines, failure = {}, None
    for name, future in futures.items():
        try:
            engines[name] = future.result()
        except Exception as exc:  # noqa: BLE001 - re-raised below, once the others are closed
            failure = failure or exc
    if failure is not None:
        close_engines(engines)
        raise failure
    return engines


def close_engines(engines: dict[str, Any]) -> None:
    """Shut the engines down side by side (each takes seconds to exit)."""
    from concurrent.futures import ThreadPoolExecutor

    if engines:
        with ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(lambda engine: engine.close(), engines.values()))


# -- the runs -----------------------------------------------------------------------------------------


@dataclass
class PdSample:
    run: str
    session: int
    turn: int
    prompt_tokens: int
    history_tokens: int
    ttft_s: float
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    #: Of the TTFT: the prefill request (sent to answered), the decode's own TTFT.
    prefill_s: float = 0.0
    decode_ttft_s: float = 0.0
    #: Prompt tokens by where they came from, on each engine (None: not measured in this run).
    prefill_cached: int = 0  # the prefill engine's own cache
    prefill_from_pool: int | None = None
    decode_cached: int = 0  # the decode engine's own cache
    decode_loaded: int | None = None


def engine_cached(done: dict[str, Any]) -> int:
    """Prompt tokens an engine's own prefix cache served: as its connector was told (vLLM's
    num_cached_tokens leaves an async load's tokens out at times), else num_cached_tokens
    (no connector: all of it is the engine's).

    >>> engine_cached({"engine_cached_tokens": 64, "num_cached_tokens": 0}), engine_cached({"num_cached_tokens": 32})
    (64, 32)
    """
    own = done.get("engine_cached_tokens")
    return int(own) if own is not None else int(done["num_cached_tokens"]) - int(done.get("external_tokens", 0))


def warm_up(engine: Any, seed: int, tokens: int, vocab: int) -> None:
    """serving_replay.py's warm-up (one request no turn shares, then an empty prefix cache), in
    this model's vocabulary: a token id past it crashes the engine."""
    rng = random.Random(f"{seed}:warm-up")
    engine.generate([[rng.randrange(3, vocab) for _ in range(tokens)]], 4)
    engine.call({"op": "reset_prefix_cache"})


def history_tokens(conversation: Any, session: int, turn: int, prompt: list[int]) -> int:
    """The prompt's tokens before this turn's user message."""
    return len(prompt) - conversation.sessions[session].user_lengths[turn]


def run_pair(name: str, proxy: Proxy, conversation: Any, answers: dict[tuple[int, int], list[int]], turns: int,
             prefill_daemon: Any = None, decode_daemon: Any = None,
             between: Callable[[], None] = lambda: None) -> list[PdSample]:
    """Every turn through the proxy, one request at a time; with the daemons given (the kvswap
    pair), where each engine's prompt tokens came from, from their metrics. ``between`` runs
    before each request (a test waits there for the decode's saves to land)."""
    samples = []
    for turn, session in replay.schedule(len(conversation.sessions), turns):
        between()
        prompt = conversation.prompt(session, turn, answers)
        if prompt is None:
            continue
        before = (replay.scrape(prefill_daemon.metrics_url), replay.scrape(decode_daemon.metrics_url)) \
            if prefill_daemon is not None else None
        got = proxy.complete(prompt, conversation.answer_tokens(session, turn), f"{name}-{session}-{turn}")
        p, d = got["prefill"], got["decode"]
        sample = PdSample(name, session, turn, len(prompt), history_tokens(conversation, session, turn, prompt),
                          got["ttft_s"], d["tokens"], d["logprobs"], got["prefill_s"], float(d["ttft_s"]),
                          prefill_cached=engine_cached(p), decode_cached=engine_cached(d))
        if before is not None:
            prefill_after, decode_after = replay.scrape(prefill_daemon.metrics_url), replay.scrape(decode_daemon.metrics_url)
            sample.prefill_from_pool = int(replay.delta(prefill_after, before[0], POOL_HITS)) * BLOCK
            sample.decode_loaded = int(replay.delta(decode_after, before[1], LOADED)) * BLOCK
        samples.append(sample)
    print(f"{name}: {len(samples)} requests", flush=True)
    return samples


def reference_samples(engine: Any, conversation: Any, answers: dict[tuple[int, int], list[int]],
                      turns: int) -> list[PdSample]:
    """The conversation on one engine that never evicts; its answers become ``answers``."""
    got, _ = replay.run_one("ideal", engine, conversation, answers, 1, turns, None)
    return [PdSample("reference", s.session, s.turn, s.prompt_tokens,
                     history_tokens(conversation, s.session, s.turn, conversation.prompt(s.session, s.turn, answers)),
                     s.ttft_s, s.tokens, s.logprobs, decode_cached=s.cached_tokens) for s in got]


# -- the report (pure functions of the samples) -------------------------------------------------------


def last_partial_tokens(prompt_tokens: int) -> int:
    """Prompt tokens a decode computes itself however much was loaded: those past the last full
    block a load may fill (never the prompt's last token; see plan.loadable_blocks).

    >>> last_partial_tokens(100), last_partial_tokens(96), last_partial_tokens(97)
    (4, 32, 1)
    """
    return prompt_tokens - (prompt_tokens - 1) // BLOCK * BLOCK


def _ttfts(group: list[PdSample]) -> dict[str, float]:
    ttft = [s.ttft_s * 1e3 for s in group]
    return {"ttft_p50_ms": replay.percentile(ttft, 50), "ttft_p99_ms": replay.percentile(ttft, 99)}


def turn_rows(samples: list[PdSample]) -> list[dict[str, Any]]:
    rows = []
    for turn in sorted({s.turn for s in samples}):
        pd = [s for s in samples if s.run == "pd" and s.turn == turn]
        prompt = sum(s.prompt_tokens for s in pd)
        decode_loaded = sum(s.decode_loaded or 0 for s in pd)
        pool = sum(s.prefill_from_pool or 0 for s in pd)
        row: dict[str, Any] = {
            "turn": turn, "requests": len(pd),
            "decode": {"prompt_tokens": prompt, "loaded_tokens": decode_loaded,
                       "engine_cache_tokens": sum(s.decode_cached for s in pd),
                       "recomputed_tokens": prompt - decode_loaded - sum(s.decode_cached for s in pd),
                       "last_partial_tokens": sum(last_partial_tokens(s.prompt_tokens) for s in pd)},
            "prefill": {"prompt_tokens": prompt, "history_tokens": sum(s.history_tokens for s in pd),
                        "loaded_from_pool_tokens": pool,
                        "engine_cache_tokens": sum(s.prefill_cached for s in pd),
                        "recomputed_tokens": prompt - pool - sum(s.prefill_cached for s in pd)},
            **_ttfts(pd)}
        for name in ("without_kvswap", "reference"):
            group = [s for s in samples if s.run == name and s.turn == turn]
            if group:
                row[name] = {"requests": len(group), **_ttfts(group)}
        rows.append(row)
    return rows


def compare(samples: list[PdSample], run: str, reference: str) -> dict[str, Any]:
    by_key = {(s.run, s.session, s.turn): s for s in samples}
    out: dict[str, Any] = {"compared": 0, "token_mismatches": 0, "max_abs_logprob_diff": 0.0, "differing": []}
    for s in samples:
        ref = by_key.get((reference, s.session, s.turn))
        if s.run != run or ref is None:
            continue
        out["compared"] += 1
        out["max_abs_logprob_diff"] = max(out["max_abs_logprob_diff"],
                                          max((abs(a - b) for a, b in zip(s.logprobs, ref.logprobs)), default=0.0))
        if s.tokens != ref.tokens:
            out["token_mismatches"] += 1
            first = next((i for i, (a, b) in enumerate(zip(s.tokens, ref.tokens)) if a != b),
                         min(len(s.tokens), len(ref.tokens)))
            out["differing"].append({"session": s.session, "turn": s.turn, "first_token": first})
    return out


#: The decode daemon's series of step 1 (its pulls), read before and after the run.
DIRECT = {"records": "kvswap_peer_pulled_records_total", "bytes": "kvswap_peer_pulled_bytes_total",
          "seconds": "kvswap_peer_pull_duration_seconds_sum"}


def peer_series(metrics_url: str) -> dict[str, float]:
    """The decode daemon's pull counters, from its /metrics."""
    import urllib.request

    with urllib.request.urlopen(metrics_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    wanted = set(DIRECT.values())
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in text.splitlines())
            if name in wanted}


def direct_totals(before: dict[str, float], after: dict[str, float], transport: str | None) -> dict[str, Any]:
    """Step 1 over the run: what the decode daemon pulled from the prefill's (records, bytes,
    and the time its lookups spent pulling: the peer's wait, the transfer, the checks).

    >>> direct_totals({DIRECT["records"]: 2.0}, {DIRECT["records"]: 9.0, DIRECT["bytes"]: 70.0}, "inline")
    {'records': 7, 'bytes': 70, 'seconds': 0.0, 'transport': 'inline'}
    """
    out: dict[str, Any] = {name: after.get(series, 0.0) - before.get(series, 0.0) for name, series in DIRECT.items()}
    out["records"], out["bytes"] = int(out["records"]), int(out["bytes"])
    out["transport"] = transport
    return out


def summarize(samples: list[PdSample], direct: dict[str, Any], connector: dict[str, Any]) -> dict[str, Any]:
    outputs = {"pd_vs_reference": compare(samples, "pd", "reference")}
    if any(s.run == "without_kvswap" for s in samples):
        outputs["without_kvswap_vs_reference"] = compare(samples, "without_kvswap", "reference")
    return {"per_turn": turn_rows(samples), "outputs": outputs, "direct": direct, "connector": connector}


def print_report(report: dict[str, Any]) -> None:
    print("\nturn |  n | decode: prompt loaded recomputed (last partial) | prefill: history from-pool recomputed "
          "| TTFT p50/p99 ms: pd | without kvswap | reference")
    for row in report["per_turn"]:
        d, p = row["decode"], row["prefill"]
        w, r = row.get("without_kvswap", {}), row.get("reference", {})
        share = p["loaded_from_pool_tokens"] / p["history_tokens"] if p["history_tokens"] else float("nan")
        print(f"{row['turn']:4d} | {row['requests']:2d} | {d['prompt_tokens']:6d} {d['loaded_tokens']:6d} "
              f"{d['recomputed_tokens']:6d} ({d['last_partial_tokens']:5d}) | {p['history_tokens']:6d} "
              f"{p['loaded_from_pool_tokens']:6d} ({share:5.1%}) {p['recomputed_tokens']:6d} | "
              f"{row['ttft_p50_ms']:7.1f} / {row['ttft_p99_ms']:7.1f} | "
              f"{w.get('ttft_p50_ms', float('nan')):7.1f} / {w.get('ttft_p99_ms', float('nan')):7.1f} | "
              f"{r.get('ttft_p50_ms', float('nan')):7.1f} / {r.get('ttft_p99_ms', float('nan')):7.1f}")
    for name, o in report["outputs"].items():
        print(f"outputs {name}: {o['compared']} compared, {o['token_mismatches']} differ in tokens, "
              f"max |logprob diff| {o['max_abs_logprob_diff']:.3g}")
    d = report["direct"]
    rate = d["bytes"] / d["seconds"] / 1e6 if d.get("seconds") else float("nan")
    print(f"direct (step 1, {d.get('transport')}): {d['records']} records, {d['bytes']} bytes in "
          f"{d['seconds']:.3f} s ({rate:.0f} MB/s)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    mod = _load("vllm_engine")
    model = TINY_MODEL if args.tiny else replay.MODEL
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sessions = replay.make_sessions(args.seed, args.sessions, args.turns, args.system_tokens, args.max_answer,
                                    model["vocab"])
    conversation = replay.Conversation(sessions, args.seed, args.max_model_len, model["vocab"])
    work = Path(tempfile.mkdtemp(prefix="kvswap-pd-replay-"))
    model_dir = mod.make_model_dir(str(work / "model"), model["layers"], model["hidden"], model["heads"],
                                   model["kv_heads"], model["intermediate"], model["vocab"])
    engines: dict[str, Any] = {}
    pool = prefill_daemon = decode_daemon = None
    samples: list[PdSample] = []
    answers: dict[tuple[int, int], list[int]] = {}
    stats_file = out / "connector-stats-decode.json"
    try:
        pool, pool_url = pool_server(args.pool, work)
        prefill_daemon, decode_daemon = pd_daemons(work, pool_url, args.host_tier_mib, args.transport)
        from kvswap.protocol.client import Client

        argv = {"reference": engine_argv(model_dir, model, args.reference_cache_blocks, args.max_model_len),
                "prefill": engine_argv(model_dir, model, args.cache_blocks, args.max_model_len,
                                       prefill_daemon.endpoint, str(out / "connector-stats-prefill.json"),
                                       role="prefill"),
                "decode": engine_argv(model_dir, model, args.cache_blocks, args.max_model_len, decode_daemon.endpoint,
                                      str(stats_file), {"pd_wait_ms": args.pd_wait_ms}, role="decode")}
        if args.pair:
            argv["plain_prefill"] = engine_argv(model_dir, model, args.cache_blocks, args.max_model_len)
            argv["plain_decode"] = engine_argv(model_dir, model, args.cache_blocks, args.max_model_len)
        started = time.monotonic()
        engines = start_engines(args.python, argv, out)
        print(f"{len(engines)} engines up in {time.monotonic() - started:.0f} s", flush=True)
        for engine in engines.values():
            warm_up(engine, args.seed, args.system_tokens + 2 * BLOCK, model["vocab"])
        samples += reference_samples(engines["reference"], conversation, answers, args.turns)
        if args.pair:
            samples += run_pair("without_kvswap", Proxy(engines["plain_prefill"], engines["plain_decode"]),
                                conversation, answers, args.turns)
        before = peer_series(decode_daemon.metrics_url)
        samples += run_pair("pd", Proxy(engines["prefill"], engines["decode"]), conversation, answers, args.turns,
                            prefill_daemon, decode_daemon)
        with Client(decode_daemon.endpoint, timeout=10) as c:
            transport = (c.stats().get("peer") or {}).get("transport")
        direct = direct_totals(before, peer_series(decode_daemon.metrics_url), transport)
    finally:
        close_engines(engines)
        for daemon in (prefill_daemon, decode_daemon):
            if daemon is not None:
                shutil.copy(daemon.log_path, out / f"kvswapd-{'prefill' if daemon is prefill_daemon else 'decode'}.log")
                daemon.stop()
        if pool is not None:
            pool.stop()
        shutil.rmtree(work, ignore_errors=True)
    connector = json.loads(stats_file.read_text()) if stats_file.exists() else {}
    report = summarize(samples, direct, connector)
    report["config"] = {k: v for k, v in vars(args).items()} | {"model": model, "block_size": BLOCK}
    report["samples"] = [{k: v for k, v in vars(s).items() if k not in ("tokens", "logprobs")} for s in samples]
    (out / "pd_replay.json").write_text(json.dumps(report, indent=1))
    return report


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Prefill/decode disaggregation on kvswap, end to end.")
    p.add_argument("--python", required=True, help="an interpreter with vllm-cpu and kvswap installed")
    p.add_argument("--out", default="pd-replay-out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--max-answer", type=int, default=8, help="tokens generated per answer at most")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--cache-blocks", type=int, default=72, help="each PD engine's own KV cache, in blocks")
    p.add_argument("--reference-cache-blocks", type=int, default=1024)
    p.add_argument("--host-tier-mib", type=int, default=256, help="each daemon's RAM tier")
    p.add_argument("--pool", default="redis-cluster", choices=("redis-cluster", "redis", "mooncake"))
    p.add_argument("--transport", default="auto", choices=("auto", "mooncake", "inline"),
                   help="the daemons' --peer-transport (step 1)")
    p.add_argument("--pd-wait-ms", type=int, default=5000, help="the decode connector's pd_wait_ms")
    p.add_argument("--no-pair", dest="pair", action="store_false", help="skip the pair without kvswap")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (CI)")
    return p


def main() -> int:
    args = parser().parse_args()
    started = time.monotonic()
    report = run(args)
    print_report(report)
    print(f"\ndata: {Path(args.out) / 'pd_replay.json'}; {time.monotonic() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
