#!/usr/bin/env python3
"""kvswap's GPU device check: one command on a CUDA machine.

    python benchmarks/gpu_check.py            # full check, about two minutes
    python benchmarks/gpu_check.py --quick    # small sizes, no bandwidth target (CI-style)

A second process plays the engine: it allocates a paged KV cache on the GPU (torch, paddle or
CuPy, whichever is installed, in that order) and exports it with
``kvswap.protocol.cuda_export``. Then, for every layout kind (bf16, fp16, fp8 with scales,
MLA, MLA with fp8, extra speculative layers) and every daemon GPU backend installed (paddle,
CuPy):

1. **mover** - this process attaches the engine's cache like the daemon does
   (``Registration.attach``), gathers blocks (repeats included) into staging slots and
   scatters random records into other blocks (a duplicate target included); every record
   and every block of the cache is compared with the engine's own bytes (blake2b per block).
2. **daemon** - a real ``kvswapd`` subprocess: the engine registers, swaps blocks out
   (``wait=persisted``), swaps them into other blocks, and checks every block of its cache.
3. **bandwidth** - on a large bf16 cache: gather+D2H and H2D+scatter GB/s of the mover, next
   to plain pinned ``cuMemcpy`` D2H/H2D of the same bytes, measured in the same run. The
   target is gather+D2H >= 0.8x plain pinned D2H.
4. **lifecycle** - an engine registers with the daemon and is killed (SIGKILL); the daemon
   must notice and close its mappings, so the engine's GPU memory comes back. Free GPU
   memory is printed before the engine, with its cache, after registration, and after its
   death.

5. **vLLM layouts** - a torch engine builds vLLM 0.32's GPU KV cache as vLLM does (one int8
   buffer viewed per layer as ``[blocks, heads, tokens, K|V]`` in a ``KVCacheLayout``: vLLM's own
   ``create_kv_cache_views`` where vLLM is installed, else the same arithmetic) filled with
   random bytes, registers it through the connector's ``kvswap.engines.vllm.cuda``, swaps
   blocks out, scrambles them through vLLM's views, swaps them back in and compares the whole
   buffer; GB/s of swap_out (copied) and swap_in on a larger cache. Skipped, and said so, where
   torch or its CUDA is missing.

    python benchmarks/gpu_check.py --only vllm   # just the vLLM layouts

Exit codes: 0 every check passed; 1 a correctness check failed; 2 no CUDA device, driver or
GPU framework here (nothing was checked); 3 correct, but gather+D2H below 0.8x plain pinned.
The last line printed is a JSON summary (also written to --json PATH).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from kvswap.protocol import CacheLayout, Client
from kvswap.protocol.cuda_export import CudaDriver, CudaError, export_cuda_cache

EXIT_OK, EXIT_WRONG, EXIT_NO_GPU, EXIT_SLOW = 0, 1, 2, 3
TARGET_RATIO = 0.8
ENGINE_TIMEOUT_S = 300
GiB = 1024**3

KINDS: dict[str, dict[str, Any]] = {
    "bf16": dict(dtype="bfloat16"),
    "fp16": dict(dtype="float16"),
    "fp8_scales": dict(dtype="uint8"),
    "mla": dict(dtype="bfloat16", has_values=False, num_kv_heads=1, head_dim=576),
    "mla_fp8": dict(dtype="uint8", has_values=False, num_kv_heads=1, head_dim=576),
    "extra_layers": dict(dtype="bfloat16", num_extra_layers=1),
}
#: Kinds whose tensors the engine carves out of one allocation (one IPC handle for all),
#: as paddle's and torch's caching allocators do; the others get one allocation per tensor.
SHARED_ALLOCATION = {"fp16", "mla_fp8"}


def kind_layout(kind: str, quick: bool) -> CacheLayout:
    spec = dict(num_layers=3 if quick else 4, num_blocks=40, block_size=16, num_kv_heads=4, head_dim=64)
    spec.update(KINDS[kind])
    return CacheLayout(f"gpu-check-{kind}", **spec)


def perf_layout(quick: bool) -> CacheLayout:
    if quick:
        return CacheLayout("gpu-check-perf", num_layers=8, num_blocks=48, block_size=64, num_kv_heads=8, head_dim=128)
    # Llama-3-8B-like: 32 layers, 8 kv heads, 64-token blocks: 8 MiB records, 1.5 GiB cache.
    return CacheLayout("gpu-check-perf", num_layers=32, num_blocks=192, block_size=64, num_kv_heads=8, head_dim=128)


def digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def say(line: str) -> None:
    print(line, flush=True)


# ===================================================================================== engine


class EngineCache:
    """One layout's cache on the GPU, in the engine process."""

    def __init__(self, fw: str, layout: CacheLayout, shared: bool, seed: int) -> None:
        self.fw, self.layout = fw, layout
        self.mod = __import__(fw)
        self.rows: dict[str, Any] = {}      # region -> [num_blocks, block_bytes] uint8 view
        self.tensors: dict[str, Any] = {}   # region -> typed tensor, as an engine holds it
        sizes = [(r.name, r.block_bytes) for r in layout.regions]
        if shared:
            total = sum(_round(layout.num_blocks * bb) for _, bb in sizes)
            big = self._random_u8((total,), seed)
            at = 0
            for name, bb in sizes:
                n = layout.num_blocks * bb
                self.rows[name] = big[at:at + n].reshape(layout.num_blocks, bb) if fw != "paddle" else \
                    big[at:at + n].reshape([layout.num_blocks, bb])
                at += _round(n)
            self._keep = big
        else:
            for i, (name, bb) in enumerate(sizes):
                shape = (layout.num_blocks, bb)
                self.rows[name] = self._random_u8(shape if fw != "paddle" else list(shape), seed + i)
        for r in layout.regions:
            self.tensors[r.name] = self._typed(r.name, self.rows[r.name])
        n = layout.total_layers
        pick = lambda p: [self.tensors[f"{p}.{i}"] for i in range(n)]  # noqa: E731
        self.export = export_cuda_cache(
            layout, pick("k"), pick("v") if layout.has_values else None, pick("ks") if layout.has_scales else None,
            pick("vs") if layout.has_scales and layout.has_values else None)

    def _random_u8(self, shape, seed: int):
        m = self.mod
        if self.fw == "torch":
            g = m.Generator(device="cuda").manual_seed(seed)
            return m.randint(0, 256, shape, dtype=m.uint8, device="cuda", generator=g)
        if self.fw == "cupy":
            return m.random.RandomState(seed).randint(0, 256, shape, dtype=m.uint8)
        m.seed(seed)
        return m.randint(0, 256, shape, dtype="int32").astype("uint8")

    def _typed(self, name: str, rows):
        """The region's tensor with the engine's shape and element type, on the same bytes."""
        lay = self.layout
        is_scale = name.startswith(("ks.", "vs."))
        shape = lay.scale_shape() if is_scale else lay.tensor_shape()
        dtype = lay.scale_dtype if is_scale else lay.dtype
        m = self.mod
        if self.fw == "torch":
            dt = {"bfloat16": m.bfloat16, "float16": m.float16, "uint8": m.uint8, "float32": m.float32}[dtype]
            return rows.view(dt).view(shape)
        if self.fw == "cupy":  # CuPy has no bfloat16: same-size integers carry the bits
            dt = {"bfloat16": m.uint16, "float16": m.float16, "uint8": m.uint8, "float32": m.float32}[dtype]
            return rows.view(dt).reshape(shape)
        dt = {"bfloat16": "bfloat16", "float16": "float16", "uint8": "uint8", "float32": "float32"}[dtype]
        return rows.view(dt).reshape(list(shape))

    def block_bytes(self, blocks: list[int]) -> list[bytes]:
        """Each block's record: every region's chunk in region order (read back with the
        framework's own ops, independently of kvswap)."""
        if not blocks:
            return []
        m, per_region = self.mod, []
        for r in self.layout.regions:
            rows = self.rows[r.name]
            if self.fw == "torch":
                per_region.append(rows[m.tensor(blocks, device=rows.device)].cpu().numpy())
            elif self.fw == "cupy":
                per_region.append(m.asnumpy(rows[m.asarray(blocks)]))
            else:
                per_region.append(m.gather(rows, m.to_tensor(blocks, dtype="int64"), axis=0).numpy())
        return [b"".join(a[i].tobytes() for a in per_region) for i in range(len(blocks))]

    def hashes(self, blocks: list[int]) -> list[str]:
        return [digest(x) for x in self.block_bytes(blocks)]


def _round(n: int, to: int = 512) -> int:
    return (n + to - 1) // to * to


def engine_main(args: argparse.Namespace) -> int:
    """The engine process: JSON requests on stdin, one JSON answer per line on stdout."""
    fw = args.framework
    if fw == "torch":
        # Legacy CUDA IPC shares cudaMalloc memory only; expandable segments are cuMemCreate.
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:False"
    if fw == "paddle":
        import paddle

        paddle.set_device("gpu:0")
    driver = CudaDriver.load()
    caches: dict[str, EngineCache] = {}
    out = sys.stdout
    sys.stdout = sys.stderr  # frameworks print; keep the answer channel clean
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        try:
            if op == "create":
                layout = CacheLayout(**req["layout"])
                cache = EngineCache(fw, layout, req["shared"], req["seed"])
                caches[req["id"]] = cache
                path = Path(args.workdir) / f"registration-{req['id']}.msgpack"
                path.write_bytes(msgpack.packb(cache.export.registration(), use_bin_type=True))
                with driver.on_device(cache.export.device):
                    free, total = driver.mem_get_info()
                answer = {"registration": str(path), "handles": len(cache.export.handles), "free": free,
                          "total": total, "cache_bytes": layout.num_blocks * layout.record_bytes}
            elif op == "hashes":
                answer = {"hashes": caches[req["id"]].hashes(req["blocks"])}
            elif op == "roundtrip":
                answer = engine_roundtrip(caches[req["id"]], req)
            elif op == "register":
                with Client(req["endpoint"], timeout=60) as c:
                    answer = {"result": c.register(caches[req["id"]].export)}
            elif op == "vllm":
                answer = engine_vllm(req)
            elif op == "drop":
                caches.pop(req["id"]).export.tensors.clear()
                _empty_cache(fw)
                answer = {}
            elif op == "exit":
                out.write(json.dumps({"ok": True}) + "\n")
                out.flush()
                return 0
            else:
                raise ValueError(f"unknown op {op}")
            out.write(json.dumps({"ok": True, **answer}) + "\n")
        except Exception as exc:
            traceback.print_exc()
            out.write(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
    return 0


def _empty_cache(fw: str) -> None:
    if fw == "torch":
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    elif fw == "cupy":
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
    else:
        import paddle

        paddle.device.cuda.empty_cache()


def engine_roundtrip(cache: EngineCache, req: dict) -> dict:
    """Through the real daemon: swap blocks out, into other blocks, and check every block."""
    sources, targets = req["sources"], req["targets"]
    n = cache.layout.num_blocks
    before = cache.hashes(list(range(n)))
    keys = [f"{req['prefix']}-{b}" for b in sources]
    with Client(req["endpoint"], timeout=120) as c:
        c.register(cache.export)
        out = c.swap_out(sources, keys, wait="persisted")
        back = c.swap_in(keys, targets)
        c.unregister()
    after = cache.hashes(list(range(n)))
    wrong = [t for s, t in zip(sources, targets) if after[t] != before[s]]
    expected = list(before)
    for s, t in zip(sources, targets):
        expected[t] = before[s]
    stray = [b for b in range(n) if b not in targets and after[b] != expected[b]]
    return {"stored": out.stored, "loaded": back.loaded, "wrong_targets": wrong, "stray_blocks": stray,
            "blocks": len(sources), "bytes": len(sources) * cache.layout.record_bytes}


# -- vLLM's GPU cache (section 4), in the engine process -------------------------------------------

#: vLLM 0.32's KVCacheLayout (vllm/v1/kv_cache_layout.py): physical order of the logical [L, B, H, N, C].
VLLM_ORDERS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
               "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


def vllm_cases(quick: bool) -> list[tuple[str, dict[str, Any]]]:
    """The caches section 4 checks: vLLM's layouts kvswap can describe, one of each kind."""
    base = dict(layers=3 if quick else 4, num_blocks=40, block_size=16, heads=4, head_dim=64, dtype="bfloat16",
                ratio=1, mla=False)
    return [
        ("FlashAttention LBNHC", {**base, "layout": "LBNHC"}),
        ("LBHNC, 64-token blocks as 4 kernel blocks", {**base, "layout": "LBHNC", "block_size": 64, "ratio": 4}),
        ("block-outermost BLNHC fp16", {**base, "layout": "BLNHC", "dtype": "float16"}),
        ("MLA BLHNC", {**base, "layout": "BLHNC", "heads": 1, "head_dim": 576, "mla": True}),
    ]


def vllm_perf_case(quick: bool) -> dict[str, Any]:
    if quick:  # 512 KiB records, 32 MiB cache
        return dict(layout="LBNHC", layers=8, num_blocks=64, block_size=16, heads=8, head_dim=128,
                    dtype="bfloat16", ratio=1, mla=False)
    # Llama-3-8B-like on FlashAttention's layout: 2 MiB records, 512 MiB cache.
    return dict(layout="LBNHC", layers=32, num_blocks=256, block_size=16, heads=8, head_dim=128, dtype="bfloat16",
                ratio=1, mla=False)


def _layout_strides(order: tuple[int, ...], shape: tuple[int, ...], fixed: tuple[int | None, ...]) -> list[int]:
    """vllm/v1/kv_cache_interface.py compute_layout_strides without page padding."""
    strides, current = [0] * 5, 1
    for dim in reversed(order):
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    return strides


def vllm_views(torch: Any, spec: dict[str, Any], names: list[str], device: str) -> tuple[Any, list[Any], str]:
    """vLLM 0.32's KV cache: allocate_kv_cache's one ``zeros(size, int8)`` and a view per layer
    from create_kv_cache_views (vLLM's own where it imports here, else the same arithmetic,
    as kv_cache_utils.get_kv_cache_config_from_groups places one group of layers)."""
    dtype = getattr(torch, spec["dtype"])
    itemsize = torch.empty((), dtype=dtype).element_size()
    layers, blocks, block_size, heads = spec["layers"], spec["num_blocks"], spec["block_size"], spec["heads"]
    content = spec["head_dim"] * (1 if spec["mla"] else 2)
    page = heads * block_size * content * itemsize
    raw = torch.zeros(layers * blocks * page, dtype=torch.int8, device=device)
    try:
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheTensor,
            MLAAttentionSpec,
            compute_layout_strides,
            create_kv_cache_views,
        )
        from vllm.v1.kv_cache_layout import KVCacheLayout

        kind = MLAAttentionSpec if spec["mla"] else FullAttentionSpec
        vspec = kind(block_size=block_size, num_kv_heads=heads, head_size=spec["head_dim"], dtype=dtype)
        layout = KVCacheLayout[spec["layout"]]
        fixed = layers * vspec.page_size_bytes if layout.is_block_outermost else None
        ls, bs, *_ = compute_layout_strides(vspec, blocks, layers, layout,
                                            fixed_strides=(None, fixed, None, None, None))
        tensor = KVCacheTensor(size=raw.numel(), layers=names, layer_stride=ls, block_stride=bs)
        views = create_kv_cache_views(raw, vspec, blocks, layout, tensor, kernel_block_size=block_size // spec["ratio"])
        return raw, views, "vLLM's create_kv_cache_views"
    except Exception as exc:  # noqa: BLE001 - no vLLM here, or another version: the same arithmetic
        source = f"kvswap's twin of vLLM 0.32 ({type(exc).__name__}: {str(exc)[:80]})"
    order, ratio = VLLM_ORDERS[spec["layout"]], spec["ratio"]
    shape = (layers, blocks, heads, block_size, content * itemsize)
    ls, bs, *_ = _layout_strides(order, shape, (None, layers * page if order[0] == 1 else None, None, None, None))
    view_shape = (layers, blocks * ratio, heads, block_size // ratio, content * itemsize)
    strides = _layout_strides(order, view_shape, (ls, bs // ratio, None, None, None))
    view5 = torch.as_strided(raw, view_shape, strides)
    return raw, [view5[layer].view(dtype) for layer in range(layers)], source


def engine_vllm(req: dict) -> dict:
    """Section 4 in the engine: vLLM's cache registered through kvswap.engines.vllm.cuda, blocks
    swapped out, scrambled through vLLM's views, swapped back in; the whole buffer compared."""
    import torch

    # ``device`` is for running this on a CPU with a stand-in daemon; the check always uses cuda.
    device = req.get("device", "cuda")
    if device == "cuda" and not torch.cuda.is_available():
        return {"skipped": f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)"}
    from kvswap.engines.vllm import cuda
    from kvswap.engines.vllm.memory import CacheFacts

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    spec, ratio = req["spec"], req["spec"]["ratio"]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(spec["layers"])]
    raw, views, source = vllm_views(torch, spec, names, device)
    g = torch.Generator(device=device).manual_seed(req["seed"])
    raw.copy_(torch.randint(-128, 128, raw.shape, dtype=torch.int8, device=device, generator=g))
    facts = CacheFacts(f"gpu-check-vllm-{req['prefix']}", num_blocks=spec["num_blocks"],
                       block_size=spec["block_size"], num_kv_heads=spec["heads"], head_dim=spec["head_dim"])
    body, keep = cuda.cuda_registration(dict(zip(names, views)), facts)
    record_bytes = CacheLayout.from_wire(body["layout"]).record_bytes
    original = raw.clone()
    blocks, warm = req["blocks"], req.get("warmup") or []
    calls = [blocks[i:i + req["per_call"]] for i in range(0, len(blocks), req["per_call"])]
    keys = lambda bs, tag: [f"{req['prefix']}-{tag}-{b}" for b in bs]  # noqa: E731
    out_s = in_s = 0.0
    queued = loaded = 0
    with Client(req["endpoint"], timeout=120) as c:
        c.register(body)
        try:
            if warm:  # staging, kernels and allocator warm before anything is timed
                c.swap_out(warm, keys(warm, "warm"))
                c.swap_in(keys(warm, "warm"), warm)
            for call in calls:
                sync()
                t0 = time.perf_counter()
                r = c.swap_out(call, keys(call, "out"))
                out_s += time.perf_counter() - t0
                queued += r.queued + r.stored
            c.flush(timeout=120)
            # Scrambled through vLLM's own views (not kvswap's regions): every kernel block of them.
            rows = torch.tensor([b * ratio + j for b in blocks for j in range(ratio)], device=device)
            for v in views:
                bits = v.view(torch.int8)
                bits[rows] = torch.randint(-128, 128, bits[rows].shape, dtype=torch.int8, device=device, generator=g)
            sync()
            scrambled = not torch.equal(raw, original)
            for call in calls:
                t0 = time.perf_counter()
                loaded += c.swap_in(keys(call, "out"), call).loaded
                in_s += time.perf_counter() - t0
        finally:
            c.unregister()
    sync()
    wrong = [b for b in blocks if any(not torch.equal(v.view(torch.int8)[b * ratio:(b + 1) * ratio],
                                                      o.view(torch.int8)[b * ratio:(b + 1) * ratio])
                                      for v, o in zip(views, _same_views(views, raw, original)))]
    return {"queued": queued, "loaded": loaded, "blocks": len(blocks), "exact": bool(torch.equal(raw, original)),
            "scrambled": scrambled, "wrong_blocks": wrong, "block_order": keep.block_order, "views": source,
            "regions": len(body["regions"]), "handles": len(body["handles"]), "record_bytes": record_bytes,
            "bytes": len(blocks) * record_bytes, "swap_out_s": out_s, "swap_in_s": in_s}


def _same_views(views: list[Any], raw: Any, other: Any) -> list[Any]:
    """``views`` with the same shape, strides and offset into ``other`` as into ``raw``."""
    import torch

    base = raw.data_ptr()
    return [torch.as_strided(other.view(v.dtype), v.shape, v.stride(), (v.data_ptr() - base) // v.element_size())
            for v in views]


class Engine:
    """The engine process, seen from here."""

    def __init__(self, fw: str, workdir: str, log: Path) -> None:
        self.log = log
        self._log = open(log, "ab")
        self.proc = subprocess.Popen([sys.executable, __file__, "--role", "engine", "--framework", fw,
                                      "--workdir", workdir], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True)

    def ask(self, op: str, **fields: Any) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], ENGINE_TIMEOUT_S)
        if not ready:
            self.kill()
            raise RuntimeError(f"the engine did not answer {op} in {ENGINE_TIMEOUT_S} s; its log:\n{self.tail()}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the engine process died (exit {self.proc.poll()}); its log:\n{self.tail()}")
        answer = json.loads(line)
        if not answer.get("ok"):
            raise RuntimeError(f"engine {op} failed: {answer.get('error')}\n{self.tail()}")
        return answer

    def tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("exit")
            except Exception:
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


# ======================================================================================= checks


class Report:
    def __init__(self) -> None:
        self.checks: list[dict] = []
        self.numbers: dict[str, Any] = {}

    def record(self, name: str, ok: bool, detail: str = "", **data: Any) -> None:
        self.checks.append({"check": name, "ok": ok, "detail": detail, **data})
        say(f"  [{'PASS' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}")

    @property
    def failed(self) -> list[dict]:
        return [c for c in self.checks if not c["ok"]]


def load_registration(path: str) -> dict:
    return msgpack.unpackb(Path(path).read_bytes(), raw=False)


def attach(body: dict, backend: str):
    from kvswap.daemon.registration import Registration

    return Registration.attach(body["layout"], body["handles"], body["regions"], body["pid"], gpu_backend=backend)


def check_mover(report: Report, engine: Engine, backend: str, kind: str, layout: CacheLayout, cache_id: str,
                body: dict, rng: np.random.Generator) -> None:
    from kvswap.daemon.staging import StagingPool

    name = f"mover {backend} {kind}"
    reg = attach(body, backend)
    pool = StagingPool(layout.record_bytes, 32 * ((layout.record_bytes + 4095) // 4096 * 4096))
    try:
        n = layout.num_blocks
        gather = [n - 1, 0, 5, 5, 17, 3, 30, 2]
        slots = [pool._slots[i].view for i in [4, 5, 6, 7, 0, 1, 20, 9]]
        ok = reg.mover.gather_blocks(gather, slots, lambda: True)
        got = [digest(s.tobytes()) for s in slots]
        want = engine.ask("hashes", id=cache_id, blocks=gather)["hashes"]
        bad_gather = [b for b, g, w in zip(gather, got, want) if g != w]

        before = engine.ask("hashes", id=cache_id, blocks=list(range(n)))["hashes"]
        targets = [11, 12, 13, 11, n - 2]  # 11 twice: the fourth record must win
        records = [rng.integers(0, 256, layout.record_bytes, dtype=np.uint8) for _ in targets]
        ok_scatter = reg.mover.scatter_blocks(targets, records, lambda: True)
        after = engine.ask("hashes", id=cache_id, blocks=list(range(n)))["hashes"]
        expected = list(before)
        for t, r in zip(targets, records):
            expected[t] = digest(r.tobytes())
        wrong = [b for b in range(n) if after[b] != expected[b]]
        good = ok and ok_scatter and not bad_gather and not wrong
        report.record(name, good, "" if good else f"gather wrong for blocks {bad_gather}, scatter wrong for {wrong}",
                      handles=len(body["handles"]), gathered=len(gather), scattered=len(targets))
    finally:
        reg.close()
        pool.close()


def check_daemon(report: Report, engine: Engine, endpoint: str, kind: str, layout: CacheLayout,
                 cache_id: str) -> None:
    n = layout.num_blocks
    sources = [0, 7, 8, 9, 21, n - 1]
    targets = [30, 31, 1, 2, 33, 34]
    r = engine.ask("roundtrip", id=cache_id, endpoint=endpoint, sources=sources, targets=targets, prefix=kind)
    good = r["stored"] == len(sources) and r["loaded"] == len(sources) and not r["wrong_targets"] \
        and not r["stray_blocks"]
    report.record(f"daemon round trip {kind}", good,
                  f"stored {r['stored']}, loaded {r['loaded']}/{len(sources)}"
                  + ("" if good else f", wrong {r['wrong_targets']}, stray {r['stray_blocks']}"))


def check_kinds(report: Report, engine: Engine, endpoint: str, backends: list[str], quick: bool,
                rng: np.random.Generator) -> None:
    """Section 1: every layout kind through each daemon backend's mover and a real daemon."""
    for i, kind in enumerate(KINDS):
        layout = kind_layout(kind, quick)
        try:
            info = engine.ask("create", id=kind, layout=layout.to_wire(), shared=kind in SHARED_ALLOCATION, seed=i)
            say(f"  {kind}: {len(layout.regions)} regions, record {layout.record_bytes} bytes, "
                f"{info['handles']} IPC handle(s)")
            body = load_registration(info["registration"])
            for backend in backends:
                check_mover(report, engine, backend, kind, layout, kind, body, rng)
            check_daemon(report, engine, endpoint, kind, layout, kind)
        except Exception as exc:
            report.record(f"{kind}", False, f"{type(exc).__name__}: {exc}")
            traceback.print_exc()
        finally:
            try:
                engine.ask("drop", id=kind)
            except Exception:
                pass


def timed(fn, repeat: int) -> float:
    """Median seconds of ``repeat`` calls (each call ends with the stream idle)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def check_bandwidth(report: Report, engine: Engine, backend: str, quick: bool, rng: np.random.Generator) -> dict:
    from kvswap.daemon.movers.cuda import CudaDevice
    from kvswap.daemon.staging import StagingPool

    layout = perf_layout(quick)
    cache_id = f"perf-{backend}"
    info = engine.ask("create", id=cache_id, layout=layout.to_wire(), shared=False, seed=99)
    body = load_registration(info["registration"])
    reg = attach(body, backend)
    count = 16 if quick else 64
    nbytes = count * layout.record_bytes
    pool = StagingPool(layout.record_bytes, count * ((layout.record_bytes + 4095) // 4096 * 4096))
    repeat = 2 if quick else 5
    driver = CudaDriver.load()
    device = CudaDevice(driver, reg.mover.info["device"])
    device.activate()
    stream = device.create_stream()
    dev_buf = device.alloc(nbytes)
    try:
        slots = [s.view for s in pool._slots[:count]]
        blocks = list(rng.permutation(layout.num_blocks)[:count].tolist())
        t0 = time.perf_counter()
        reg.mover.pin_host(pool.arena)
        pin_s = time.perf_counter() - t0
        reg.mover.gather_blocks(blocks, slots, lambda: True)  # warm-up (kernels, allocator)
        want = engine.ask("hashes", id=cache_id, blocks=blocks[:4])["hashes"]
        exact = [digest(s.tobytes()) for s in slots[:4]] == want
        gather_s = timed(lambda: reg.mover.gather_blocks(blocks, slots, lambda: True), repeat)
        scatter_s = timed(lambda: reg.mover.scatter_blocks(blocks, slots, lambda: True), repeat)
        per_slot_s = None
        copier = getattr(reg.mover, "copier", None)
        if copier is not None and hasattr(copier, "two_d"):
            copier.two_d = False
            per_slot_s = timed(lambda: reg.mover.gather_blocks(blocks, slots, lambda: True), repeat)
            copier.two_d = True
        arena = pool.arena.ctypes.data

        def d2h() -> None:
            device.copy_dtoh_async(arena, dev_buf, nbytes, stream)
            device.synchronize(stream)

        def h2d() -> None:
            device.copy_htod_async(dev_buf, arena, nbytes, stream)
            device.synchronize(stream)

        d2h()
        d2h_s, h2d_s = timed(d2h, repeat), timed(h2d, repeat)
    finally:
        device.free(dev_buf)
        device.destroy_stream(stream)
        device.release()
        reg.close()
        pool.close()
        engine.ask("drop", id=cache_id)
    gbps = lambda s: nbytes / s / 1e9  # noqa: E731
    numbers = {"backend": backend, "record_bytes": layout.record_bytes, "records": count, "bytes": nbytes,
               "gather_d2h_GBps": gbps(gather_s), "h2d_scatter_GBps": gbps(scatter_s),
               "pinned_d2h_GBps": gbps(d2h_s), "pinned_h2d_GBps": gbps(h2d_s), "pin_arena_s": pin_s,
               "gather_per_slot_copies_GBps": gbps(per_slot_s) if per_slot_s else None}
    numbers["gather_ratio"] = numbers["gather_d2h_GBps"] / numbers["pinned_d2h_GBps"]
    numbers["scatter_ratio"] = numbers["h2d_scatter_GBps"] / numbers["pinned_h2d_GBps"]
    say(f"  {backend}: {count} records of {layout.record_bytes / 2**20:.1f} MiB ({nbytes / 2**20:.0f} MiB) per call")
    say(f"    gather+D2H   {numbers['gather_d2h_GBps']:7.2f} GB/s   plain pinned D2H {numbers['pinned_d2h_GBps']:7.2f}"
        f" GB/s   ratio {numbers['gather_ratio']:.2f}")
    say(f"    H2D+scatter  {numbers['h2d_scatter_GBps']:7.2f} GB/s   plain pinned H2D {numbers['pinned_h2d_GBps']:7.2f}"
        f" GB/s   ratio {numbers['scatter_ratio']:.2f}")
    if per_slot_s:
        say("    gather+D2H with one copy per slot instead of 2D runs: "
            f"{numbers['gather_per_slot_copies_GBps']:.2f} GB/s")
    say(f"    pinning the {pool.capacity * pool.slot_bytes / 2**20:.0f} MiB staging arena took {pin_s * 1000:.0f} ms")
    report.record(f"bandwidth {backend} records byte-exact", exact)
    return numbers


def gpu_free(driver: CudaDriver, ordinal: int) -> int:
    with driver.on_device(ordinal):
        return driver.mem_get_info()[0]


def check_lifecycle(report: Report, engine_fw: str, workdir: str, endpoint: str, quick: bool, ordinal: int) -> dict:
    """The engine dies; the daemon must close its mappings so the memory comes back."""
    driver = CudaDriver.load()
    # Large enough (1 or 2 GiB) that a leaked mapping cannot hide behind the engine's own CUDA
    # context or the daemon's staging, which are freed either way.
    layout = CacheLayout("gpu-check-death", num_layers=8 if quick else 16, num_blocks=512,
                         block_size=64, num_kv_heads=8, head_dim=128)
    free0 = gpu_free(driver, ordinal)
    engine = Engine(engine_fw, workdir, Path(workdir) / "engine-death.log")
    try:
        info = engine.ask("create", id="death", layout=layout.to_wire(), shared=False, seed=5)
        free_engine = info["free"]
        engine.ask("register", id="death", endpoint=endpoint)
        time.sleep(0.5)
        free_registered = gpu_free(driver, ordinal)
        engine.kill()
    finally:
        engine.close()
    with Client(endpoint, timeout=10) as c:
        deadline = time.monotonic() + 20
        while c.stats()["registered"] and time.monotonic() < deadline:
            time.sleep(0.1)
        released = not c.stats()["registered"]
    cache_bytes = info["cache_bytes"]
    # Back where it was before the engine started, give or take a tenth of the cache: a daemon
    # that kept the mapping (LMCache #4014) keeps the whole cache allocated.
    enough = free0 - 0.1 * cache_bytes
    deadline = time.monotonic() + 20
    free_after = gpu_free(driver, ordinal)
    while free_after < enough and time.monotonic() < deadline:
        time.sleep(0.2)
        free_after = gpu_free(driver, ordinal)
    numbers = {"cache_bytes": cache_bytes, "free_before_engine": free0, "free_engine_before_registration": free_engine,
               "free_after_registration": free_registered, "free_after_engine_death": free_after}
    say(f"  GPU free memory: before the engine {free0 / GiB:.2f} GiB; engine with its {cache_bytes / GiB:.2f} GiB"
        f" cache, before registration {free_engine / GiB:.2f} GiB; registered {free_registered / GiB:.2f} GiB;"
        f" after the engine's death {free_after / GiB:.2f} GiB")
    report.record("engine death releases the mapping", released and free_after >= enough,
                  f"daemon released: {released}; {(free_after - free_registered) / GiB:.2f} GiB came back, "
                  f"{(free0 - free_after) / GiB:+.2f} GiB short of before the engine (cache {cache_bytes / GiB:.2f} GiB)")
    return numbers


def check_vllm_layouts(report: Report, workdir: str, endpoint: str, quick: bool) -> dict:
    """Section 4: vLLM's GPU cache through the connector's registration (kvswap.engines.vllm.cuda)."""
    if importlib.util.find_spec("torch") is None:
        return skip_section("vLLM layouts", "torch is not installed here (vLLM's cache is torch tensors)")
    engine = Engine("torch", workdir, Path(workdir) / "engine-vllm.log")
    numbers: dict[str, Any] = {"cases": []}
    try:
        for i, (name, spec) in enumerate(vllm_cases(quick)):
            n = spec["num_blocks"]
            blocks = [0, 7, 8, 9, 21, n - 1]
            try:
                r = engine.ask("vllm", spec=spec, endpoint=endpoint, blocks=blocks, per_call=len(blocks), seed=40 + i,
                               prefix=f"vllm{i}")
            except Exception as exc:
                report.record(f"vllm {name}", False, f"{type(exc).__name__}: {exc}")
                continue
            if r.get("skipped"):
                return skip_section("vLLM layouts", r["skipped"])
            good = r["exact"] and r["scrambled"] and r["queued"] == len(blocks) and r["loaded"] == len(blocks)
            report.record(f"vllm {name}", good,
                          f"{r['regions']} regions, {r['handles']} handle(s), in-block order {r['block_order']}, "
                          f"queued {r['queued']}, loaded {r['loaded']}/{len(blocks)}"
                          + ("" if good else f", scrambled {r['scrambled']}, wrong blocks {r['wrong_blocks']}"),
                          views=r["views"])
            numbers["cases"].append({"case": name, **r})
        spec = vllm_perf_case(quick)
        n, per_call, calls = spec["num_blocks"], 16 if quick else 24, 3 if quick else 4
        blocks = list(range(2, 2 + calls * per_call))  # 0 and 1 warm up
        try:
            r = engine.ask("vllm", spec=spec, endpoint=endpoint, blocks=blocks, per_call=per_call, warmup=[0, 1],
                           seed=77, prefix="vllmperf")
        except Exception as exc:
            report.record("vllm bandwidth", False, f"{type(exc).__name__}: {exc}")
            return numbers
        if r.get("skipped"):
            return skip_section("vLLM layouts", r["skipped"])
        gbps = lambda s: r["bytes"] / s / 1e9 if s else 0.0  # noqa: E731
        numbers.update(record_bytes=r["record_bytes"], bytes=r["bytes"], swap_out_GBps=gbps(r["swap_out_s"]),
                       swap_in_GBps=gbps(r["swap_in_s"]), views=r["views"])
        say(f"  {spec['layout']} {spec['layers']} layers, {n} blocks: {len(blocks)} records of "
            f"{r['record_bytes'] / 2**20:.1f} MiB in calls of {per_call}, through a real kvswapd")
        say(f"    swap_out (copied) {numbers['swap_out_GBps']:7.2f} GB/s   "
            f"swap_in {numbers['swap_in_GBps']:7.2f} GB/s")
        good = r["exact"] and r["scrambled"] and r["queued"] == len(blocks) and r["loaded"] == len(blocks)
        report.record("vllm bandwidth round trip byte-exact", good,
                      "" if good else f"queued {r['queued']}, loaded {r['loaded']}, wrong blocks {r['wrong_blocks']}")
    finally:
        engine.close()
    return numbers


def skip_section(name: str, reason: str) -> dict:
    """A section that cannot run here: said so, not counted as a failure."""
    say(f"  [SKIP] {name}: {reason}")
    return {"skipped": reason}


# ========================================================================================= main


def preflight() -> tuple[CudaDriver, dict[str, Any]]:
    try:
        driver = CudaDriver.load()
        count = driver.device_count()
    except CudaError as exc:
        fail_no_gpu(f"no CUDA device: {exc.message}")
    if count == 0:
        fail_no_gpu("no CUDA device: the driver sees none")
    env: dict[str, Any] = {"devices": count, "device_uuid": driver.device_uuid(0)}
    env["engine_frameworks"] = [f for f in ("torch", "paddle", "cupy") if importlib.util.find_spec(f)]
    env["backends"] = []
    if importlib.util.find_spec("paddle"):
        import paddle

        if paddle.is_compiled_with_cuda():
            env["backends"].append("paddle")
    if importlib.util.find_spec("cupy"):
        env["backends"].append("cupy")
    if not env["engine_frameworks"]:
        fail_no_gpu("no GPU framework to play the engine: install torch, paddlepaddle-gpu or cupy")
    if not env["backends"]:
        fail_no_gpu("no daemon GPU backend: install paddlepaddle-gpu (kvswap[gpu]) or cupy")
    return driver, env


def fail_no_gpu(message: str) -> None:
    print(f"gpu_check: FAIL: {message}. Nothing was checked; run this on a machine with an NVIDIA GPU.",
          file=sys.stderr, flush=True)
    print(json.dumps({"result": "no_gpu", "reason": message}), flush=True)
    sys.exit(EXIT_NO_GPU)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, no bandwidth target")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--engine", default="auto", choices=["auto", "torch", "paddle", "cupy"])
    ap.add_argument("--backends", default="auto", help="comma list of daemon backends to check (paddle,cupy)")
    ap.add_argument("--only", default="all", choices=["all", "kinds", "bandwidth", "lifecycle", "vllm"],
                    help="run one section: layout kinds, bandwidth, lifecycle or vLLM layouts (default: all)")
    ap.add_argument("--role", default="check", choices=["check", "engine"], help=argparse.SUPPRESS)
    ap.add_argument("--framework", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "engine":
        return engine_main(args)

    driver, env = preflight()
    fw = env["engine_frameworks"][0] if args.engine == "auto" else args.engine
    backends = env["backends"] if args.backends == "auto" else args.backends.split(",")
    say(f"gpu_check: {env['devices']} CUDA device(s), {env['device_uuid']}; engine plays with {fw}; "
        f"daemon backends: {', '.join(backends)}")
    report = Report()
    wants = lambda section: args.only in ("all", section)  # noqa: E731
    rng = np.random.default_rng(2024)
    summary: dict[str, Any] = {"env": env, "engine": fw, "backends": backends}
    from kvswap.daemon.tools.local_daemon import LocalDaemon

    with tempfile.TemporaryDirectory(prefix="kvswap-gpu-check-") as workdir:
        engine = Engine(fw, workdir, Path(workdir) / "engine.log")
        daemon_log = open(Path(workdir) / "kvswapd.log", "ab")
        os.environ["KVSWAP_GPU_BACKEND"] = backends[0]
        daemon = LocalDaemon(str(Path(workdir) / "store"), ["--engine-check-interval-s", "0.2"], log=daemon_log)
        try:
            daemon.start()
            if wants("kinds"):
                say("\n1. mover and daemon round trips, byte-exact, per layout kind")
                check_kinds(report, engine, daemon.endpoint, backends, args.quick, rng)
            if wants("bandwidth"):
                say("\n2. bandwidth")
                perf = []
                for backend in backends:
                    try:
                        perf.append(check_bandwidth(report, engine, backend, args.quick, rng))
                    except Exception as exc:
                        report.record(f"bandwidth {backend}", False, f"{type(exc).__name__}: {exc}")
                        traceback.print_exc()
                summary["bandwidth"] = perf
            engine.close()
            if wants("lifecycle"):
                say("\n3. lifecycle: the engine dies, its GPU memory comes back")
                try:
                    summary["memory"] = check_lifecycle(report, fw, workdir, daemon.endpoint, args.quick, 0)
                except Exception as exc:
                    report.record("lifecycle", False, f"{type(exc).__name__}: {exc}")
                    traceback.print_exc()
            if wants("vllm"):
                say("\n4. vLLM layouts: vLLM's GPU cache registered through kvswap.engines.vllm.cuda")
                try:
                    summary["vllm"] = check_vllm_layouts(report, workdir, daemon.endpoint, args.quick)
                except Exception as exc:
                    report.record("vllm layouts", False, f"{type(exc).__name__}: {exc}")
                    traceback.print_exc()
        finally:
            engine.close()
            code = daemon.stop()
            daemon_log.close()
            if report.failed:
                say("\nkvswapd log (tail):")
                say("\n".join((Path(workdir) / "kvswapd.log").read_text(errors="replace").splitlines()[-40:]))
        summary["daemon_exit"] = code
    slow = [p for p in summary.get("bandwidth", []) if p["gather_ratio"] < TARGET_RATIO]
    if report.failed or code != 0:
        result, exit_code = "fail", EXIT_WRONG
    elif slow and not args.quick:
        result, exit_code = "slow", EXIT_SLOW
    else:
        result, exit_code = "pass", EXIT_OK
    summary.update(result=result, checks=report.checks)
    say(f"\ngpu_check: {result.upper()}: {len(report.checks) - len(report.failed)} of {len(report.checks)} checks "
        f"passed" + (f"; gather+D2H below {TARGET_RATIO}x pinned for {[p['backend'] for p in slow]}" if slow else ""))
    text = json.dumps(summary, default=str)
    if args.json:
        Path(args.json).write_text(text)
    say(text)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
