"""The worker side of the vLLM connector: the KV cache in shared memory and registered with
kvswapd, loads sent without waiting and collected between steps, saves sent after the forward
and collected when their blocks are about to be reused; and the metadata the scheduler side
sends it each step. See :mod:`.connector` for the whole.

Every copy is the daemon's, into or out of memory the engine keeps using, so the one rule is
when a block is the engine's again: only once the daemon answered the request that copies it,
or once the client's wait for that answer is over (``Client.done``: the request carried its
deadline as ``deadline_ns``, so a daemon that reads it later never starts it, and one in
progress stopped at the deadline). Until then a loading request stays in vLLM's
WAITING_FOR_REMOTE_KVS (its blocks held), and a block being saved is not zeroed or given to
another request: :meth:`WorkerSide.settle` waits, at the start of the step that would reuse
it, for exactly the saves that read such a block.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvswap.protocol.client import Client
from kvswap.protocol.errors import InvalidLayout, KvswapError, NotRegistered
from kvswap.protocol.kv_events import BlockMeta
from kvswap.protocol.messages import SwapIn, SwapOut
from kvswap.protocol.results import SwapInResult

from .memory import CacheFacts, SharedKVAllocation, build_registration
from .plan import Backoff, block_meta_setting, resolve_endpoints

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: Under vLLM's logger, so these lines land in the engine's log with its own.
log = logging.getLogger("vllm.kvswap")


# -- what the scheduler tells the worker, and back ------------------------------------------------


@dataclass
class Transfer:
    req_id: str
    keys: list[str]
    block_ids: list[int]
    #: Saves: per key, what kvswapd's KV events name the record by (the scheduler builds them
    #: unless ``block_meta`` is false; the worker sends them when events are on).
    metas: list[BlockMeta] | None = None


@dataclass
class KvswapMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    #: Tokens the step computes (the forward's work), for the prefill-speed estimate.
    step_tokens: int = 0
    #: Loads run between steps (vLLM's ``load_kv_async``): sent, not waited for.
    load_async: bool = True
    #: Blocks this step may write before its forward (newly allocated: zeroed, copied into,
    #: loaded): a save still reading one must finish first.
    reused_blocks: frozenset[int] = frozenset()


@dataclass
class KvswapWorkerMetadata(KVConnectorWorkerMetadata):
    """Measurements and outcomes from the workers, aggregated over ranks per step."""

    #: (blocks, seconds) per load call and (tokens, seconds) per forward.
    load_samples: list[tuple[int, float]] = field(default_factory=list)
    forward_samples: list[tuple[int, float]] = field(default_factory=list)
    loaded_blocks: int = 0
    failed_blocks: int = 0
    saved_blocks: int = 0
    save_failures: int = 0
    #: Time the steps spent sending saves and waiting for their copies (``settle``).
    save_s: float = 0.0
    #: Saves a step had to wait for because it reuses one of their blocks.
    save_waits: int = 0
    #: Keys whose load or save failed: the scheduler's view of what kvswap holds forgets them.
    failed_keys: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvswapWorkerMetadata)
        return KvswapWorkerMetadata(
            self.load_samples + other.load_samples, self.forward_samples + other.forward_samples,
            self.loaded_blocks + other.loaded_blocks, self.failed_blocks + other.failed_blocks,
            self.saved_blocks + other.saved_blocks, self.save_failures + other.save_failures,
            self.save_s + other.save_s, self.save_waits + other.save_waits, self.failed_keys + other.failed_keys)


class WorkerSide:
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: Any, extra: dict[str, Any]) -> None:
        self.config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.timeout = float(extra.get("timeout_s", 5.0))
        self.connect_timeout = float(extra.get("connect_timeout_s", 30.0))
        self.model_id = str(extra.get("model_id") or vllm_config.model_config.model)[-256:]
        rank = _local_rank()
        endpoints = resolve_endpoints(extra)
        self.endpoint = endpoints[rank] if rank < len(endpoints) else None
        self.allocation = SharedKVAllocation() if vllm_config.device_config.device_type == "cpu" else None
        self._gpu_cache: Any = None
        self.client: Client | None = None
        self.registration: dict[str, Any] | None = None
        self.write_slots = 0
        self.registered = False
        #: Send each save's block metadata: the ``block_meta`` setting, or (auto) whether the
        #: daemon publishes KV events, asked at each registration.
        self.block_meta = block_meta_setting(extra)
        self.send_meta = bool(self.block_meta)
        self.backoff = Backoff(float(extra.get("retry_s", 5.0)))
        self._errors: set[int] = set()
        #: swap_out requests sent, replies not collected: request id -> (the blocks they read,
        #: their keys).
        self._saves: dict[int, tuple[frozenset[int], tuple[str, ...]]] = {}
        #: Loads sent, replies not collected: request id -> (the load, when it was sent).
        self._loads: dict[int, tuple[Transfer, float]] = {}
        #: vLLM requests whose loads ended (landed or not), for the next ``get_finished``.
        self._loaded: set[str] = set()
        self._report = KvswapWorkerMetadata()
        self._forward_started: float | None = None
        if self.endpoint is None:
            log.error("kvswap connector: no endpoint for local rank %d in %s; running without offload", rank, endpoints)

    def memory_context(self) -> SharedKVAllocation | None:
        return self.allocation

    def register(self, kv_caches: dict[str, Any]) -> None:
        if self.endpoint is None:
            return
        model = self.config.model_config
        parallel = self.config.parallel_config
        facts = CacheFacts(self.model_id, num_blocks=self.kv_cache_config.num_blocks,
                           block_size=self.config.cache_config.block_size,
                           num_kv_heads=model.get_num_kv_heads(parallel), head_dim=model.get_head_size(),
                           tp_rank=_tp_rank(), tp_size=parallel.tensor_parallel_size)
        try:
            if self.allocation is not None:
                self.registration = build_registration(kv_caches, self.allocation, facts)
            else:
                # A GPU engine: the cache goes to kvswapd as CUDA IPC handles (.cuda). The object
                # kept holds the cache tensors for as long as the registration stands.
                from .cuda import cuda_registration

                self.registration, self._gpu_cache = cuda_registration(kv_caches, facts)
        except InvalidLayout as exc:
            log.error("kvswap connector: cannot describe the KV cache (%s); running without offload", exc)
            return
        self.client = Client(self.endpoint, timeout=self.timeout)
        try:
            self.client.wait_ready(self.connect_timeout)
            self._register()
        except KvswapError as exc:
            # Not fatal: every later call retries the registration (see _call).
            self.backoff.failed(exc)
            log.warning("kvswap connector: kvswapd at %s not usable yet (%s); will retry", self.endpoint, exc)

    def _register(self) -> None:
        assert self.client is not None and self.registration is not None
        reply = self.client.register(self.registration)
        self.registered = True
        self.write_slots = int(reply.get("write_slots") or 0)
        if self.block_meta is None:
            self.send_meta = self._daemon_publishes_events()
        log.info("kvswap connector: registered with %s, namespace %s, %d regions%s", self.endpoint,
                 reply.get("namespace"), len(self.registration["regions"]),
                 "; saves name their blocks for KV events" if self.send_meta else "")

    def _daemon_publishes_events(self) -> bool:
        assert self.client is not None
        try:
            events = self.client.stats().get("kv_events")
        except KvswapError:
            return self.send_meta  # keep what the last answer said
        return isinstance(events, dict) and bool(events.get("enabled"))

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """One kvswap call; registers first where the daemon does not know this engine (it
        restarted, or was not up at start-up) and retries once."""
        try:
            if not self.registered:
                self._register()
            try:
                return fn(*args, **kwargs)
            except NotRegistered:
                self.registered = False
                self._register()
                return fn(*args, **kwargs)
        except KvswapError as exc:
            self.backoff.failed(exc)
            raise

    @property
    def usable(self) -> bool:
        """Calls are worth trying: a cache described, a client, and no recent failure."""
        return self.client is not None and self.registration is not None and self.backoff.open

    def begin_step(self) -> None:
        """The metadata is bound before the forward, every step (``start_load_kv`` comes after
        the forward in steps without loads): the forward's clock starts here."""
        self._forward_started = time.perf_counter()

    def start_step(self, meta: KvswapMetadata) -> None:
        """Loads. Synchronous ones run here, before the forward reads their blocks; async ones
        (vLLM calls this after the forward then) are only sent, and :meth:`finished_loads`
        collects them in a later step."""
        if not meta.loads:
            return
        for load in meta.loads:
            if not self.usable:
                self._failed(load, 0)
                if meta.load_async:
                    self._loaded.add(load.req_id)
            elif meta.load_async:
                self._send_load(load)
            else:
                self._load(load)
        if not meta.load_async:
            self._forward_started = time.perf_counter()  # the forward starts after the loads

    def _failed(self, load: Transfer, start: int) -> None:
        """The load ended; its blocks from ``start`` on did not land."""
        blocks = load.block_ids[start:]
        self._report.failed_blocks += len(blocks)
        self._report.failed_keys.extend(load.keys[start:])
        self._errors.update(blocks)

    def _load(self, load: Transfer) -> None:
        t = time.perf_counter()
        assert self.client is not None
        try:
            loaded = self._call(self.client.swap_in, load.keys, load.block_ids).loaded
        except KvswapError as exc:
            log.warning("kvswap connector: load of %d blocks failed (%s); recomputing", len(load.keys), exc)
            loaded = 0
        self._landed(load, loaded, time.perf_counter() - t)

    def _landed(self, load: Transfer, loaded: int, seconds: float) -> None:
        if loaded:
            self._report.load_samples.append((loaded, seconds))
        self._report.loaded_blocks += loaded
        self._failed(load, loaded)

    def _send_load(self, load: Transfer) -> None:
        assert self.client is not None
        try:
            if not self.registered:
                self._register()
            request_id = self.client.send(SwapIn, {"keys": tuple(load.keys), "block_ids": tuple(load.block_ids)},
                                          timeout=self.timeout, block=False)
        except KvswapError as exc:
            self.backoff.failed(exc)
            log.warning("kvswap connector: load of %d blocks not sent (%s); recomputing", len(load.keys), exc)
            self._failed(load, 0)
            self._loaded.add(load.req_id)
            return
        self._loads[request_id] = (load, time.perf_counter())

    def finished_loads(self) -> set[str]:
        """The vLLM requests whose async loads ended since the last call; the blocks that did
        not land are in :meth:`take_load_errors` by then. Never blocks."""
        if self._loads:
            assert self.client is not None
            for request_id in [r for r in self._loads if self.client.done(r)]:
                load, sent = self._loads.pop(request_id)
                # The policy learns what the load cost the daemon, not how long its reply waited
                # for this step to end: an async load does not hold the engine meanwhile.
                seconds: float | None = None
                try:
                    result = SwapInResult.from_wire(self.client.wait(request_id))
                    loaded, seconds = result.loaded, result.elapsed_s
                except NotRegistered:
                    self.registered = False  # the daemon restarted: register again on the next call
                    loaded = 0
                except KvswapError as exc:
                    self.backoff.failed(exc)
                    log.warning("kvswap connector: load of %d blocks failed (%s); recomputing", len(load.keys), exc)
                    loaded = 0
                self._landed(load, loaded, time.perf_counter() - sent if seconds is None else seconds)
                self._loaded.add(load.req_id)
        finished, self._loaded = self._loaded, set()
        return finished

    def end_step(self, meta: KvswapMetadata) -> None:
        """After the forward: time it, then send the blocks it completed to kvswapd without
        waiting. The replies ("copied") are collected by :meth:`settle` at the start of the
        next step, before vLLM zeroes or reuses any block; until then the step's output goes
        back to the user, so a save's copy is not on the path to the first token."""
        if self._forward_started is not None and meta.step_tokens:
            self._report.forward_samples.append((meta.step_tokens, time.perf_counter() - self._forward_started))
        self._forward_started = None
        if not self.usable or not meta.saves:
            return
        assert self.client is not None
        started = time.perf_counter()
        try:
            if not self.registered:
                self._register()
            for save in meta.saves:
                step = max(1, self.write_slots or len(save.keys))
                for i in range(0, len(save.keys), step):
                    body: dict[str, Any] = {"block_ids": tuple(save.block_ids[i:i + step]),
                                            "keys": tuple(save.keys[i:i + step]), "wait": "copied", "partial": True}
                    if self.send_meta and save.metas:
                        body["block_meta"] = tuple(m.to_wire() for m in save.metas[i:i + step])
                    self._saves[self.client.send(SwapOut, body, timeout=self.timeout, block=False)] = \
                        (frozenset(save.block_ids[i:i + step]), tuple(save.keys[i:i + step]))
        except KvswapError as exc:
            # Nothing to undo: the blocks are simply not offloaded.
            self.backoff.failed(exc)
            log.warning("kvswap connector: save failed (%s)", exc)
            self._report.save_failures += 1
        self._report.save_s += time.perf_counter() - started

    def settle(self, reused: frozenset[int] | None = None) -> None:
        """Collect the saves whose copies are done, without waiting; then wait for each one
        still reading a block in ``reused`` (None: every save), which this step may zero or
        overwrite before its forward. vLLM calls ``handle_preemptions`` at the start of each
        step, before it zeroes new blocks or copies into them; a block of a finished or
        preempted request is only ever written after it was allocated again, in a step that
        lists it."""
        if not self._saves:
            return
        assert self.client is not None
        started = time.perf_counter()
        for request_id, (blocks, _) in list(self._saves.items()):
            must_wait = reused is None or not blocks.isdisjoint(reused)
            ready = self.client.done(request_id)
            if must_wait or ready:
                self._report.save_waits += not ready
                self._collect_save(request_id)
        self._report.save_s += time.perf_counter() - started

    def _collect_save(self, request_id: int) -> None:
        assert self.client is not None
        _, keys = self._saves.pop(request_id)
        try:
            out = self.client.wait(request_id, timeout=self.timeout)
        except KvswapError as exc:
            if isinstance(exc, NotRegistered):
                self.registered = False  # the daemon restarted: these blocks are not offloaded
            else:
                self.backoff.failed(exc)
            self._report.save_failures += 1
            self._report.failed_keys.extend(keys)
        else:
            self._report.saved_blocks += out["queued"] + out["exists"]
            self._report.save_failures += out["failed"]
            self._report.failed_keys.extend(k for k, st in zip(keys, out["status"]) if st not in ("queued", "exists"))

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def take_report(self) -> KvswapWorkerMetadata | None:
        report, self._report = self._report, KvswapWorkerMetadata()
        return report if report != KvswapWorkerMetadata() else None

    def close(self) -> None:
        if self.client is not None:
            self.settle()
            for request_id in list(self._loads):
                with contextlib.suppress(KvswapError):
                    self.client.wait(request_id)  # no copy into the cache may outlive the engine
            self._loads.clear()
            try:
                self.client.unregister()
            except KvswapError:
                pass
            self.client.close()
        if self.allocation is not None:
            self.allocation.close()


def _local_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().local_rank)
    except (ImportError, AssertionError, AttributeError):
        return 0


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, AttributeError):
        return 0
