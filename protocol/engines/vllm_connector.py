"""kvswap as vLLM's KV store: a ``KVConnectorBase_V1`` loaded out of tree.

    --kv-transfer-config '{"kv_connector": "KvswapConnector",
        "kv_connector_module_path": "kvswap.protocol.engines.vllm_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}'

Scheduler side (:class:`SchedulerSide`): for a new request, ``lookup`` the engine's chained
block hashes past what the engine's own prefix cache holds; claim the stored prefix as an
external hit only when the load policy (:mod:`.vllm_policy`) expects loading to beat
recomputing; plan a ``swap_in`` into the blocks vLLM allocates, and a ``swap_out`` of every
block the step completes.

Worker side (:class:`WorkerSide`): the KV cache is allocated in shared memory
(:mod:`.vllm_memory`) and registered without a copy; loads run before the forward
(``swap_in``), saves are sent after it (``swap_out(wait="copied")``) and their replies
collected at the start of the next step, before vLLM zeroes or reuses a block
(``handle_preemptions``): the copy overlaps the step's output and the next schedule, and the
write to storage continues in the daemon. A load that does not fully land
reports its blocks through ``get_block_ids_with_load_errors``, so vLLM (with
``kv_load_failure_policy="recompute"``) recomputes them instead of attending to garbage.
Any kvswap error is a miss or a skipped save: the engine never fails a request for it.

The daemon: ``kv_connector_extra_config["endpoint"]`` (one endpoint, or a list in rank
order), else ``KVSWAP_ENDPOINTS`` as ``kvswap launch`` sets it (rank i -> i-th), else
``tcp://127.0.0.1:55500``. The other ``kv_connector_extra_config`` keys (``load_policy``,
``timeout_s``, ``lookup_timeout_s``, ``connect_timeout_s``, ``retry_s``, ``model_id``,
``stats_file``) are listed in docs/integration.md.

vLLM and torch are imported here, at import time: this module is only imported by vLLM.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ..client import Client
from ..errors import InvalidLayout, KvswapError, NotRegistered
from ..messages import SwapOut
from .vllm_memory import CacheFacts, SharedKVAllocation, build_registration
from .vllm_plan import (
    Backoff,
    blocks_to_save,
    keys_for,
    loadable_blocks,
    resolve_endpoints,
)
from .vllm_policy import LoadPolicy
from .vllm_stats import ConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

#: Under vLLM's logger, so these lines land in the engine's log with its own.
log = logging.getLogger("vllm.kvswap")


# -- what the scheduler tells the worker, and back ------------------------------------------------


@dataclass
class Transfer:
    req_id: str
    keys: list[str]
    block_ids: list[int]


@dataclass
class KvswapMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    #: Tokens the step computes (the forward's work), for the prefill-speed estimate.
    step_tokens: int = 0


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
    #: Time the steps spent in swap_out (waiting for "copied").
    save_s: float = 0.0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvswapWorkerMetadata)
        return KvswapWorkerMetadata(
            self.load_samples + other.load_samples, self.forward_samples + other.forward_samples,
            self.loaded_blocks + other.loaded_blocks, self.failed_blocks + other.failed_blocks,
            self.saved_blocks + other.saved_blocks, self.save_failures + other.save_failures,
            self.save_s + other.save_s)


class KvswapConnector(KVConnectorBase_V1):
    """The class vLLM instantiates, once per role; each role's work lives in its own object."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler: SchedulerSide | None = SchedulerSide(vllm_config, extra)
            self.worker: WorkerSide | None = None
        else:
            self.scheduler = None
            self.worker = WorkerSide(vllm_config, kv_cache_config, extra)

    # -- worker side -------------------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker:
            self.worker.begin_step()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # vLLM calls this at the start of every step, before it zeroes new blocks or frees
        # preempted ones: the last step's saves must be copied by then.
        if self.worker:
            self.worker.settle()

    def get_mem_pool_context(self):
        return self.worker.memory_context() if self.worker else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.worker:
            self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.worker:
            self.worker.start_step(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every load finished in start_load_kv, before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves are whole blocks after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        if self.worker and self.has_connector_metadata():
            self.worker.end_step(self._get_connector_metadata())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.take_report() if self.worker else None

    # -- scheduler side ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.scheduler is not None and isinstance(connector_output.kv_connector_worker_meta, KvswapWorkerMetadata):
            self.scheduler.take_report(connector_output.kv_connector_worker_meta)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is not None:
            self.scheduler.finished(request.request_id)
        # Saves are copied before the next step touches any block (WorkerSide.settle), so the
        # blocks may be freed now.
        return False, None

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        if self.worker is not None:
            self.worker.close()


# -- scheduler side ---------------------------------------------------------------------------------


@dataclass
class _Tracked:
    """A request the scheduler plans transfers for."""

    request: Any
    block_ids: list[int] = field(default_factory=list)
    #: Leading blocks known stored (loaded, found in the engine's cache, or saved).
    saved: int = 0


class SchedulerSide:
    def __init__(self, vllm_config: VllmConfig, extra: dict[str, Any]) -> None:
        cache = vllm_config.cache_config
        self.block_size = cache.block_size
        hash_block_size = getattr(cache, "hash_block_size", None) or self.block_size
        if self.block_size % hash_block_size:
            raise ValueError(f"block size {self.block_size} is not a multiple of the hash block size {hash_block_size}")
        self.hashes_per_block = self.block_size // hash_block_size
        timeout = float(extra.get("timeout_s", 5.0))
        self.lookup_timeout = float(extra.get("lookup_timeout_s", 1.0))
        self.backoff = Backoff(float(extra.get("retry_s", 5.0)))
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        endpoints = resolve_endpoints(extra)[:tp_size]
        # Every rank's daemon must hold a block for the load to land everywhere: ask all.
        self.clients = [Client(e, timeout=timeout) for e in endpoints]
        self.policy = LoadPolicy(self.block_size, str(extra.get("load_policy", "when_faster")))
        self.stats = ConnectorStats(extra.get("stats_file"))
        self._pending: dict[str, tuple[int, int]] = {}  # req_id -> (first block, blocks to load)
        self._loads: list[Transfer] = []
        self._tracked: dict[str, _Tracked] = {}
        log.info("kvswap connector (scheduler): daemons %s, load policy %s", ", ".join(endpoints), self.policy.mode)

    def _keys(self, request: Any) -> list[str]:
        return keys_for(request.block_hashes, self.hashes_per_block)

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        self._pending.pop(request.request_id, None)
        keys = self._keys(request)
        usable = loadable_blocks(len(keys), request.num_tokens, self.block_size)
        first = num_computed_tokens // self.block_size
        if first >= usable:
            return 0
        hits = self._lookup(keys[first:usable])
        if hits == 0:
            return 0
        decision = self.policy.decide(hits)
        self.stats.decision(decision.reason, hits * self.block_size)
        if not decision.load:
            return 0
        self._pending[request.request_id] = (first, hits)
        return hits * self.block_size

    def _lookup(self, keys: list[str]) -> int:
        if not self.backoff.open:
            return 0
        t = time.perf_counter()
        hits = len(keys)
        try:
            for client in self.clients:
                hits = min(hits, client.lookup(keys, timeout=self.lookup_timeout))
                if hits == 0:
                    break
        except KvswapError as exc:
            self.stats.error("lookup", exc)
            self.backoff.failed(exc)
            hits = 0
        self.stats.lookup(time.perf_counter() - t, len(keys), hits)
        return hits

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        tracked = self._tracked.setdefault(request.request_id, _Tracked(request))
        plan = self._pending.pop(request.request_id, None)
        if num_external_tokens <= 0 or plan is None:
            return
        first, _ = plan
        count = num_external_tokens // self.block_size
        keys = self._keys(request)[first:first + count]
        self._loads.append(Transfer(request.request_id, keys, list(block_ids[first:first + count])))
        tracked.saved = max(tracked.saved, first + count)

    def build_meta(self, out: SchedulerOutput) -> KvswapMetadata:
        meta = KvswapMetadata(loads=self._loads, step_tokens=out.total_num_scheduled_tokens)
        self._loads = []
        for new in out.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            # What the step starts from is already stored (loaded) or in the engine's cache.
            tracked.saved = max(tracked.saved, new.num_computed_tokens // self.block_size)
            self._plan_save(meta, tracked, new.num_computed_tokens + out.num_scheduled_tokens[new.req_id])
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                tracked.block_ids.extend(new_ids[0])
            self._plan_save(meta, tracked, cached.num_computed_tokens[i] + out.num_scheduled_tokens[req_id])
        return meta

    def _plan_save(self, meta: KvswapMetadata, tracked: _Tracked, computed_after: int) -> None:
        """Save the blocks this step fills, once the forward has computed them."""
        keys = self._keys(tracked.request)
        todo = blocks_to_save(tracked.saved, computed_after, self.block_size, len(keys), len(tracked.block_ids))
        if todo:
            meta.saves.append(Transfer(tracked.request.request_id, keys[todo.start:todo.stop],
                                       tracked.block_ids[todo.start:todo.stop]))
            tracked.saved = todo.stop

    def take_report(self, report: KvswapWorkerMetadata) -> None:
        for blocks, seconds in report.load_samples:
            self.policy.observe_load(blocks, seconds)
        for tokens, seconds in report.forward_samples:
            self.policy.observe_forward(tokens, seconds)
        self.stats.worker(report, self.block_size)

    def finished(self, req_id: str) -> None:
        self._tracked.pop(req_id, None)
        self._pending.pop(req_id, None)
        self.stats.maybe_write(self.policy)

    def close(self) -> None:
        self.stats.write(self.policy)
        log.info("kvswap connector (scheduler): %s", json.dumps(self.stats.summary(self.policy)))
        for client in self.clients:
            client.close()


# -- worker side ------------------------------------------------------------------------------------


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
        self.client: Client | None = None
        self.registration: dict[str, Any] | None = None
        self.write_slots = 0
        self.registered = False
        self.backoff = Backoff(float(extra.get("retry_s", 5.0)))
        self._errors: set[int] = set()
        self._inflight: list[int] = []  # ids of swap_out requests sent, replies not collected
        self._report = KvswapWorkerMetadata()
        self._forward_started: float | None = None
        if self.endpoint is None:
            log.error("kvswap connector: no endpoint for local rank %d in %s; running without offload", rank, endpoints)

    def memory_context(self) -> SharedKVAllocation | None:
        return self.allocation

    def register(self, kv_caches: dict[str, Any]) -> None:
        if self.endpoint is None:
            return
        if self.allocation is None:
            log.error("kvswap connector: only CPU engines are supported (the cache must be in shared memory); "
                      "running without offload")
            return
        model = self.config.model_config
        parallel = self.config.parallel_config
        facts = CacheFacts(self.model_id, num_blocks=self.kv_cache_config.num_blocks,
                           block_size=self.config.cache_config.block_size,
                           num_kv_heads=model.get_num_kv_heads(parallel), head_dim=model.get_head_size(),
                           tp_rank=_tp_rank(), tp_size=parallel.tensor_parallel_size)
        try:
            self.registration = build_registration(kv_caches, self.allocation, facts)
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
        log.info("kvswap connector: registered with %s, namespace %s, %d regions", self.endpoint,
                 reply.get("namespace"), len(self.registration["regions"]))

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
        """Loads, before the forward reads the blocks (vLLM calls this before the forward in
        steps that have loads)."""
        if not meta.loads:
            return
        for load in meta.loads:
            if self.usable:
                self._load(load)
            else:
                self._errors.update(load.block_ids)
                self._report.failed_blocks += len(load.block_ids)
        self._forward_started = time.perf_counter()

    def _load(self, load: Transfer) -> None:
        t = time.perf_counter()
        assert self.client is not None
        try:
            loaded = self._call(self.client.swap_in, load.keys, load.block_ids).loaded
        except KvswapError as exc:
            log.warning("kvswap connector: load of %d blocks failed (%s); recomputing", len(load.keys), exc)
            loaded = 0
        if loaded:
            self._report.load_samples.append((loaded, time.perf_counter() - t))
        self._report.loaded_blocks += loaded
        failed = load.block_ids[loaded:]
        self._report.failed_blocks += len(failed)
        self._errors.update(failed)

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
                    body = {"block_ids": tuple(save.block_ids[i:i + step]), "keys": tuple(save.keys[i:i + step]),
                            "wait": "copied", "partial": True}
                    self._inflight.append(self.client.send(SwapOut, body, timeout=self.timeout))
        except KvswapError as exc:
            # Nothing to undo: the blocks are simply not offloaded.
            self.backoff.failed(exc)
            log.warning("kvswap connector: save failed (%s)", exc)
            self._report.save_failures += 1
        self._report.save_s += time.perf_counter() - started

    def settle(self) -> None:
        """Wait for every save sent so far to be copied (vLLM calls ``handle_preemptions``
        at the start of each step, before it zeroes new blocks or frees preempted ones)."""
        if not self._inflight:
            return
        assert self.client is not None
        started = time.perf_counter()
        inflight, self._inflight = self._inflight, []
        for request_id in inflight:
            try:
                out = self.client.wait(request_id, timeout=self.timeout)
            except NotRegistered:
                self.registered = False  # the daemon restarted: these blocks are not offloaded
                self._report.save_failures += 1
            except KvswapError as exc:
                self.backoff.failed(exc)
                self._report.save_failures += 1
            else:
                self._report.saved_blocks += out["queued"] + out["exists"]
                self._report.save_failures += out["failed"]
        self._report.save_s += time.perf_counter() - started

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def take_report(self) -> KvswapWorkerMetadata | None:
        report, self._report = self._report, KvswapWorkerMetadata()
        return report if report != KvswapWorkerMetadata() else None

    def close(self) -> None:
        if self.client is not None:
            self.settle()
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
