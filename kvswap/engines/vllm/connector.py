"""kvswap as vLLM's KV store: a ``KVConnectorBase_V1`` loaded out of tree.

    --kv-transfer-config '{"kv_connector": "KvswapConnector",
        "kv_connector_module_path": "kvswap.engines.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}'

Scheduler side (:class:`SchedulerSide`): for a new request, the stored prefix of the
engine's chained block hashes past what the engine's own prefix cache holds: from what the
scheduler knows kvswap holds (:mod:`.known`: this engine's saves, loads and lookup answers),
else from a ``lookup`` sent to every rank's daemon when vLLM added the request, answered "ask
again" (None) until all replied, after at most ``lookup_wait_ms`` of waiting (:mod:`.lookups`);
claim the stored prefix as an external hit, loaded asynchronously,
only when the load policy (:mod:`.policy`) expects loading to beat recomputing; plan a
``swap_in`` into the blocks vLLM allocates, and a ``swap_out`` of every block the step
completes that kvswap does not already hold.

Worker side (:class:`WorkerSide`): the KV cache is allocated in shared memory
(:mod:`.memory`) and registered without a copy. Loads are sent after the forward and
collected in ``get_finished`` of a later step, the request waiting meanwhile in vLLM's
WAITING_FOR_REMOTE_KVS while the others run; saves are sent after the forward
(``swap_out(wait="copied")``) and collected when they are done, a step waiting only for a save
that still reads a block it is about to zero or overwrite (``handle_preemptions``). The write to
storage continues in the daemon. A load that does not fully land reports its blocks through
``get_block_ids_with_load_errors``, so vLLM (with ``kv_load_failure_policy="recompute"``)
recomputes them instead of attending to garbage. Any kvswap error is a miss or a skipped save:
the engine never fails a request for it.

KV events: each save tells kvswapd the engine's names of its blocks (``block_meta``: hashes
converted as vLLM converts them for its own events, parent, tokens), and with
``kv_events_endpoint`` set and vLLM's ``--kv-events-config`` on, the scheduler forwards the
daemon's events (what its RAM, file and remote tiers store and remove) into vLLM's own stream
through ``take_events`` (:mod:`.events`).

The daemon: ``kv_connector_extra_config["endpoint"]`` (one endpoint, or a list in rank
order), else ``KVSWAP_ENDPOINTS`` as ``kvswap launch`` sets it (rank i -> i-th), else
``tcp://127.0.0.1:55500``. The other ``kv_connector_extra_config`` keys (``load_policy``,
``timeout_s``, ``lookup_timeout_s``, ``lookup_wait_ms``, ``known_keys``, ``load_async``,
``connect_timeout_s``, ``retry_s``, ``model_id``,
``stats_file``, ``block_meta``, ``kv_events_endpoint``, ``kv_events_replay_endpoint``,
``kv_events_topic``, ``pd_wait_ms``) are listed in docs/integration.md.

Prefill/decode on separate engines (:mod:`.pd`): a prefill request (``kv_transfer_params``
``do_remote_decode``) returns, when it finishes, the peer addresses of its daemons; a decode
request carrying them is looked up with ``peer`` set, its daemon pulling the prompt's blocks
from the prefill's, and what that finds is always loaded (no load policy: a decode engine is
there not to prefill).

vLLM and torch are imported here, at import time: this module is only imported by vLLM.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import zmq
from vllm.distributed import kv_events as vllm_events
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvswap.protocol import kv_events as kvswap_events
from kvswap.protocol.client import Client
from kvswap.protocol.errors import KvswapError, Unavailable
from kvswap.protocol.limits import MAX_WAIT_MS

from .events import EventForwarder
from .known import DEFAULT_CAPACITY, KnownKeys
from .lookups import Lookups
from .pd import DEFAULT_WAIT_MS, PeerAddresses, decode_params, remote_blocks, remote_peers, wants_remote_decode
from .plan import (
    Backoff,
    block_meta_setting,
    block_metas,
    blocks_to_save,
    flag_setting,
    keys_for,
    loadable_blocks,
    resolve_endpoints,
)
from .policy import LoadPolicy
from .stats import ConnectorStats
from .worker import KvswapMetadata, KvswapWorkerMetadata, Transfer, WorkerSide

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
        # vLLM calls this at the start of every step, before it zeroes or copies into the
        # step's new blocks: a save still reading one of them must be copied by then.
        if self.worker and isinstance(kv_connector_metadata, KvswapMetadata):
            self.worker.settle(kv_connector_metadata.reused_blocks)

    def get_mem_pool_context(self):
        return self.worker.memory_context() if self.worker else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.worker:
            self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.worker:
            self.worker.start_step(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are whole requests: an async one finishes before vLLM schedules its request, a
        # synchronous one in start_load_kv, before the forward.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves are whole blocks after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        if self.worker and self.has_connector_metadata():
            self.worker.end_step(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Saves never delay a request's end (see WorkerSide.settle); loads report here.
        return None, (self.worker.finished_loads() or None) if self.worker else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.take_report() if self.worker else None

    # -- scheduler side ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        tokens = self.scheduler.matched_tokens(request, num_computed_tokens)
        return tokens, bool(tokens) and self.scheduler.load_async

    def on_new_request(self, request: Request) -> None:
        if self.scheduler is not None:
            self.scheduler.prefetch(request)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.scheduler is not None and isinstance(connector_output.kv_connector_worker_meta, KvswapWorkerMetadata):
            self.scheduler.take_report(connector_output.kv_connector_worker_meta)

    def take_events(self) -> Iterable[vllm_events.KVCacheEvent]:
        # The scheduler calls this once a step and publishes what it returns with the GPU's events.
        return self.scheduler.take_events() if self.scheduler is not None else ()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves are copied before the next step touches any block (WorkerSide.settle), so the
        # blocks may be freed now. A prefill request for a remote decode returns where the
        # decode's daemon pulls its blocks from (:mod:`.pd`).
        params = self.scheduler.finished(request) if self.scheduler is not None else None
        return False, params

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
    #: Leading blocks known stored (loaded, found in the engine's cache or in kvswap, or saved).
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
        self.backoff = Backoff(float(extra.get("retry_s", 5.0)))
        self.load_async = flag_setting(extra, "load_async", True)
        # kv_both (the default) loads and saves; kv_producer only saves, kv_consumer only loads.
        kv_role = getattr(vllm_config.kv_transfer_config, "kv_role", None) or "kv_both"
        self.loads, self.saves = kv_role != "kv_producer", kv_role != "kv_consumer"
        if kv_role != "kv_both":
            # Said once at start: vLLM's own disaggregation examples set these roles, and with
            # kvswap each end of a pair both loads and saves (docs/integration.md).
            log.warning("kvswap connector: kv_role %s: this engine %s; in a prefill/decode pair both engines "
                        "run kv_both (the prefill loads the history from the pool, the decode saves the "
                        "conversation to it)", kv_role,
                        "saves to kvswap and never loads" if not self.loads else "loads and never saves")
        self.pd_wait_ms = int(float(extra.get("pd_wait_ms", DEFAULT_WAIT_MS)))
        if not 0 <= self.pd_wait_ms <= MAX_WAIT_MS:
            raise ValueError(f"kv_connector_extra_config pd_wait_ms must be 0..{MAX_WAIT_MS}, got {self.pd_wait_ms}")
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        endpoints = resolve_endpoints(extra)[:tp_size]
        # Every rank's daemon must hold a block for the load to land everywhere: ask all.
        self.clients = [Client(e, timeout=timeout) for e in endpoints]
        self.policy = LoadPolicy(self.block_size, str(extra.get("load_policy", "when_faster")))
        self.stats = ConnectorStats(extra.get("stats_file"))
        self.lookups = Lookups(self.clients, float(extra.get("lookup_timeout_s", 1.0)), self.stats.lookup,
                               self._lookup_failed, wait_s=float(extra.get("lookup_wait_ms", 2.0)) / 1000)
        #: What kvswap holds as far as this scheduler knows (:mod:`.known`): answered at once.
        self.known = KnownKeys(int(extra.get("known_keys", DEFAULT_CAPACITY)))
        #: Where a decode engine's daemons reach this engine's (for prefill requests, :mod:`.pd`).
        self.peer_addresses = PeerAddresses(self.clients, timeout, self.backoff.retry_s)
        self._pending: dict[str, tuple[int, int]] = {}  # req_id -> (first block, blocks to load)
        #: Scheduler time the connector spent on each request not yet admitted (its lookups'
        #: calls and the load's planning): the cost a new request pays on the scheduler.
        self._admit_s: dict[str, float] = {}
        self._loads: list[Transfer] = []
        self._tracked: dict[str, _Tracked] = {}
        #: Block metadata for saves (for the daemon's KV events), unless ``block_meta`` is false.
        self.build_metas = block_meta_setting(extra) is not False
        self.events = _forwarder(vllm_config, extra)
        if self.events is not None:
            forwarder = self.events
            self.stats.sections["kv_events"] = lambda: asdict(forwarder.counts)
        log.info("kvswap connector (scheduler): daemons %s, load policy %s%s", ", ".join(endpoints), self.policy.mode,
                 f", forwarding KV events from {self.events.endpoint}" if self.events else "")

    def _keys(self, request: Any) -> list[str]:
        return keys_for(request.block_hashes, self.hashes_per_block)

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens to load past ``num_computed_tokens``, or None while the lookup is out."""
        t = time.perf_counter()
        try:
            return self._matched(request, num_computed_tokens)
        finally:
            req_id = request.request_id
            self._admit_s[req_id] = self._admit_s.get(req_id, 0.0) + time.perf_counter() - t

    def prefetch(self, request: Any) -> None:
        """A request was added: send its lookup now (see :mod:`.lookups`)."""
        t = time.perf_counter()
        if wants_remote_decode(getattr(request, "kv_transfer_params", None)):
            self.peer_addresses.prepare()
        if self.loads and self.backoff.open:
            keys = self._keys(request)
            peers = self._peers(request)
            self.lookups.prefetch(request.request_id, keys[:self._usable(request, len(keys), peers)],
                                  peers or (), self.pd_wait_ms if peers else 0)
        self._admit_s[request.request_id] = time.perf_counter() - t

    def _peers(self, request: Any) -> list[str] | None:
        """A decode request's prefill daemons, one per rank (:mod:`.pd`), or None."""
        return remote_peers(getattr(request, "kv_transfer_params", None), len(self.clients))

    def _usable(self, request: Any, num_keys: int, peers: list[str] | None) -> int:
        """Leading blocks a load may fill; for a decode request, no more than the prefill saved
        or found stored (:func:`.pd.remote_blocks`)."""
        usable = loadable_blocks(num_keys, request.num_tokens, self.block_size)
        saved = remote_blocks(request.kv_transfer_params) if peers is not None else None
        return usable if saved is None else min(usable, saved)

    def _matched(self, request: Any, num_computed_tokens: int) -> int | None:
        req_id = request.request_id
        self._pending.pop(req_id, None)
        keys = self._keys(request)
        peers = self._peers(request)
        usable = self._usable(request, len(keys), peers)
        first = num_computed_tokens // self.block_size
        if first >= usable or not self.loads or not self.backoff.open:
            self.lookups.forget(req_id)
            return 0
        # Both ends of a prefill/decode pair see only part of what is stored: a decode engine's
        # view lacks what the prefill computed (its daemons pull the rest), a prefill engine's
        # lacks what the decode engines stored in the pool (the blocks of the last answer). Their
        # requests are claimed from the view only where it has every block.
        partial_view = peers is None and not wants_remote_decode(getattr(request, "kv_transfer_params", None))
        hits: int | None = self.known.prefix(keys[first:usable])
        if hits and (partial_view or first + hits == usable):
            self.lookups.forget(req_id)  # the prefetched lookup is not needed
            self.stats.counts["lookups_answered_locally"] += 1
        else:
            hits = self.lookups.ask(req_id, keys[:usable], first, peers or (), self.pd_wait_ms if peers else 0)
            if not hits:
                return hits  # None: ask again next step
            self.known.add(keys[first:first + hits])
        # Stored in kvswap, so not worth saving again whether or not it is loaded.
        tracked = self._tracked.setdefault(req_id, _Tracked(request))
        tracked.saved = max(tracked.saved, first + hits)
        if peers is not None:
            # A decode engine is there not to prefill: what the prefill computed is always loaded.
            self.stats.counts["pd_decode_requests"] += 1
            self.stats.decision("remote_prefill", hits * self.block_size)
        else:
            decision = self.policy.decide(hits)
            self.stats.decision(decision.reason, hits * self.block_size)
            if not decision.load:
                return 0
        self._pending[req_id] = (first, hits)
        return hits * self.block_size

    def _lookup_failed(self, exc: KvswapError) -> None:
        self.stats.error("lookup", exc)
        if not isinstance(exc, Unavailable):
            # A daemon that takes the lookups and does not answer costs every request a wait:
            # stop asking for a while. One not connected (down, restarting) costs nothing, since
            # the send fails at once, so the next request may find it back.
            self.backoff.failed(exc)

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        t = time.perf_counter()
        req_id = request.request_id
        tracked = self._tracked.setdefault(req_id, _Tracked(request))
        plan = self._pending.pop(req_id, None)
        if num_external_tokens > 0 and plan is not None:
            first, _ = plan
            count = num_external_tokens // self.block_size
            keys = self._keys(request)[first:first + count]
            self._loads.append(Transfer(req_id, keys, list(block_ids[first:first + count])))
            tracked.saved = max(tracked.saved, first + count)
        spent = self._admit_s.pop(req_id, None)
        if spent is not None:  # vLLM calls this again for an async load once it landed: not a new request
            self.stats.admitted(spent + time.perf_counter() - t)

    def build_meta(self, out: SchedulerOutput) -> KvswapMetadata:
        t = time.perf_counter()
        meta = self._build_meta(out)
        self.stats.step(time.perf_counter() - t)
        return meta

    def _build_meta(self, out: SchedulerOutput) -> KvswapMetadata:
        meta = KvswapMetadata(loads=self._loads, step_tokens=out.total_num_scheduled_tokens,
                              load_async=self.load_async, reused_blocks=_reused_blocks(out, self._loads, self.block_size))
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
        if not self.saves:
            return
        keys = self._keys(tracked.request)
        todo = blocks_to_save(tracked.saved, computed_after, self.block_size, len(keys), len(tracked.block_ids))
        if todo:
            request = tracked.request
            metas = None
            if self.build_metas:
                lora = request.lora_request.name if request.lora_request else None
                metas = block_metas(request.block_hashes, request.all_token_ids, self.hashes_per_block,
                                    self.block_size, todo, maybe_convert_block_hash, lora)
            meta.saves.append(Transfer(request.request_id, keys[todo.start:todo.stop],
                                       tracked.block_ids[todo.start:todo.stop], metas))
            # Known from now on: a request arriving while the copy is out finds it in flight
            # in the daemon, or fails its load and recomputes.
            self.known.add(keys[todo.start:todo.stop])
            tracked.saved = todo.stop

    def take_report(self, report: KvswapWorkerMetadata) -> None:
        self.known.forget(report.failed_keys)
        for blocks, seconds in report.load_samples:
            self.policy.observe_load(blocks, seconds)
        for tokens, seconds in report.forward_samples:
            self.policy.observe_forward(tokens, seconds)
        self.stats.worker(report, self.block_size)

    def finished(self, request: Any) -> dict[str, Any] | None:
        """The request left; for a prefill request whose decode runs on another engine, the
        params that engine's connector pulls the prompt's blocks with (:mod:`.pd`), or None."""
        req_id = request.request_id
        tracked = self._tracked.pop(req_id, None)
        self._pending.pop(req_id, None)
        self._admit_s.pop(req_id, None)
        self.lookups.forget(req_id)
        self.stats.maybe_write(self.policy)
        if not wants_remote_decode(getattr(request, "kv_transfer_params", None)):
            return None
        peers = self.peer_addresses.get()
        self.stats.counts["pd_prefill_requests"] += 1
        if peers is None:
            self.stats.counts["pd_prefill_without_peers"] += 1
            return None
        # Blocks saved by this request's steps or found stored: the ones the decode can pull.
        return decode_params(peers, tracked.saved if tracked is not None else 0)

    def take_events(self) -> list[vllm_events.KVCacheEvent]:
        if self.events is None:
            return []
        try:
            return [_to_vllm(e) for e in self.events.take()]
        except zmq.ZMQError as exc:  # never the scheduler's problem: stop forwarding
            log.error("kvswap connector: KV events from %s stop (%s)", self.events.endpoint, exc)
            self.events.close()
            self.events = None
            return []

    def close(self) -> None:
        self.stats.write(self.policy)
        log.info("kvswap connector (scheduler): %s", json.dumps(self.stats.summary(self.policy)))
        if self.events is not None:
            self.events.close()
            self.events = None
        self.lookups.close()
        for client in self.clients:
            client.close()


def _reused_blocks(out: SchedulerOutput, loads: list[Transfer], block_size: int) -> frozenset[int]:
    """The blocks the step may write before its forward: every block allocated for it (zeroed,
    copy-on-write targets, prompt chunks) and the targets of the loads it starts. A new
    request's leading computed blocks are prefix-cache hits, read only; they are left out."""
    blocks: set[int] = set()
    for new in out.scheduled_new_reqs:
        blocks.update(new.block_ids[0][new.num_computed_tokens // block_size:])
    for new_ids in out.scheduled_cached_reqs.new_block_ids:
        if new_ids:
            blocks.update(new_ids[0])
    for load in loads:
        blocks.update(load.block_ids)
    blocks.update(getattr(out, "new_block_ids_to_zero", None) or ())
    return frozenset(blocks)


def _forwarder(vllm_config: VllmConfig, extra: dict[str, Any]) -> EventForwarder | None:
    """The forwarder of rank 0's daemon's events, when both ends have events on."""
    endpoint = str(extra.get("kv_events_endpoint") or "")
    if not endpoint:
        return None
    events_config = getattr(vllm_config, "kv_events_config", None)
    if events_config is None or not events_config.enable_kv_cache_events:
        log.warning("kvswap connector: kv_events_endpoint is set but vLLM publishes no KV events "
                    "(--kv-events-config enable_kv_cache_events); not forwarding kvswapd's")
        return None
    return EventForwarder(endpoint, str(extra.get("kv_events_replay_endpoint") or "") or None,
                          str(extra.get("kv_events_topic") or ""), maybe_convert_block_hash,
                          retry_s=float(extra.get("retry_s", 5.0)))


def _to_vllm(event: kvswap_events.Event) -> vllm_events.KVCacheEvent:
    """One kvswap event as vLLM's own. ``group_idx`` 0: the connector saves the blocks of the
    first KV cache group, whose GPU events carry 0."""
    if isinstance(event, kvswap_events.BlockStored):
        return vllm_events.BlockStored(
            block_hashes=list(event.block_hashes), parent_block_hash=event.parent_block_hash,
            token_ids=list(event.token_ids), block_size=event.block_size, lora_id=None, medium=event.medium,
            lora_name=event.lora_name, group_idx=0, locality=event.locality, ownership=event.ownership)
    if isinstance(event, kvswap_events.BlockRemoved):
        return vllm_events.BlockRemoved(block_hashes=list(event.block_hashes), medium=event.medium, group_idx=0,
                                        locality=event.locality, ownership=event.ownership)
    return vllm_events.AllBlocksCleared()
