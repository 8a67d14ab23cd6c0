"""KV events through vLLM (issue 26, the engine side): the connector names every save's blocks
as vLLM's own events do, and forwards kvswapd's events into the engine's published stream.

Three parts:

- the forwarder (kvswap/engines/vllm/events.py, plain Python) against a publisher this test
  drives batch by batch: a late join, a gap, a duplicate, a restart, a bounded take;
- the forwarder against a real kvswapd that is killed and started again;
- a real vLLM engine (marked ``vllm``; see tests/test_vllm_connector.py for its environment)
  with ``--kv-events-config`` beside a kvswapd with events on. The engine process subscribes to
  its own published stream and decodes it with vLLM's ``KVEventBatch`` (benchmarks/vllm_engine.py,
  ``--kv-events-log``); the test compares kvswap's blocks in that stream with the engine's GPU
  events for the same prompt: the same hashes, parents and tokens.
"""

from __future__ import annotations

import hashlib
import json
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq
from support import DaemonProcess, free_port, vllm_env

from kvswap.engines.vllm import events as forwarding
from kvswap.engines.vllm.events import EventForwarder
from kvswap.protocol import CacheLayout, Client, HostKVCache
from kvswap.protocol.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockMeta,
    BlockRemoved,
    BlockStored,
    Event,
    encode_batch,
    seq_bytes,
)
from test_vllm_connector import BLOCK, BLOCK_BYTES, HEADS, HIDDEN, KV_HEADS, LAYERS, _load_engine_module, _prompt
from test_vllm_connector import vllm_python  # noqa: F401  (a fixture)

MASK64 = (1 << 64) - 1


def to_int(raw: bytes) -> int:
    """vLLM's maybe_convert_block_hash with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (its default)."""
    return int.from_bytes(raw, "big") & MASK64


def wait_for(what: str, condition: Callable[[], bool], step: Callable[[], None] = lambda: None,
             timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        step()
        time.sleep(0.01)


# -- the forwarder, against a publisher the test drives ------------------------------------------------


class ScriptedDaemon:
    """kvswapd's two event sockets, publishing what the test says: each batch is buffered for
    replay, and sent live unless the test simulates its loss."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.replay_endpoint = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0

    def publish(self, events: list[Event], live: bool = True, seq: int | None = None, ts: float | None = None,
                buffered: bool = True) -> int:
        seq = self.seq if seq is None else seq
        payload = encode_batch(time.time() if ts is None else ts, events)
        if seq == self.seq:
            if buffered:
                self.buffer.append((seq, payload))
            self.seq += 1
        if live:
            self.pub.send_multipart([b"", seq_bytes(seq), payload])
        return seq

    def serve(self) -> None:
        while self.router.poll(0):
            ident, _, start = self.router.recv_multipart()
            for seq, payload in self.buffer:
                if seq >= int.from_bytes(start, "big"):
                    self.router.send_multipart([ident, b"", b"", seq_bytes(seq), payload])
            self.router.send_multipart([ident, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


@pytest.fixture
def scripted():
    d = ScriptedDaemon()
    yield d
    d.close()


def stored(name: Any, medium: str = "CPU", parent: Any = None, tokens: tuple[int, ...] = ()) -> BlockStored:
    locality, ownership = ("LOCAL", "kvswap:host") if medium == "CPU" else ("LOCAL", "kvswap:file")
    return BlockStored((name,), parent, tokens, 16, medium, locality, ownership)


def removed(name: Any, medium: str = "CPU") -> BlockRemoved:
    return BlockRemoved((name,), medium, "LOCAL", "kvswap:host" if medium == "CPU" else "kvswap:file")


def drain(fw: EventForwarder, daemon: ScriptedDaemon, until: Callable[[list[Event]], bool],
          timeout: float = 10.0) -> list[Event]:
    got: list[Event] = []

    def step() -> None:
        daemon.serve()
        got.extend(fw.take())

    wait_for(f"forwarded events (so far {got}, {fw.counts})", lambda: until(got), step, timeout)
    return got


def subscribed(fw: EventForwarder, daemon: ScriptedDaemon) -> None:
    """Wait until the forwarder has its baseline and its SUB socket gets live batches (a PUB
    socket drops what it sends before the subscription reached it): empty batches, published
    until one arrives, carry no events."""
    drain(fw, daemon, lambda _: fw.synced)
    applied = fw.counts.batches

    def step() -> None:
        daemon.publish([])
        daemon.serve()
        assert fw.take() == []

    wait_for("a live batch", lambda: fw.synced and fw.counts.batches > applied + 1, step)


def test_forwarder_joins_late_fills_a_gap_and_drops_duplicates(scripted: ScriptedDaemon) -> None:
    key = hashlib.sha256(b"block 0").hexdigest()
    scripted.publish([AllBlocksCleared()], live=False)
    scripted.publish([stored(key.encode())], live=False)          # named by its key: renamed
    scripted.publish([stored(7, "STORAGE", parent=6, tokens=(1, 2))], live=False)
    fw = EventForwarder(scripted.endpoint, scripted.replay_endpoint, "", to_int, replay_idle_s=1.0)
    try:
        got = drain(fw, scripted, lambda got: fw.synced and len(got) == 2)
        # The daemon's first AllBlocksCleared cleared nothing the stream had: nothing is sent.
        assert got == [stored(to_int(bytes.fromhex(key))), stored(7, "STORAGE", parent=6, tokens=(1, 2))]
        # Batch 3 is lost on the way (the SUB queue overflowed): batch 4 shows the gap, the
        # replay fills it, and both come out in order.
        subscribed(fw, scripted)
        scripted.publish([stored(8, "STORAGE", parent=7)], live=False)
        scripted.publish([removed(7, "STORAGE")])
        got = drain(fw, scripted, lambda got: len(got) == 2)
        assert got == [stored(8, "STORAGE", parent=7), removed(7, "STORAGE")]
        # The same batch again (a replay and the live stream overlap): dropped.
        duplicates = fw.counts.duplicates
        seq, payload = scripted.buffer[2]
        assert fw.counts.lost == 0
        scripted.pub.send_multipart([b"", seq_bytes(seq), payload])
        wait_for("the duplicate", lambda: fw.take() == [] and fw.counts.duplicates > duplicates)
        assert fw.held() == {("CPU", "LOCAL", "kvswap:host"): {to_int(bytes.fromhex(key))},
                             ("STORAGE", "LOCAL", "kvswap:file"): {8}}
        assert fw.counts.lost == 0
    finally:
        fw.close()


def test_a_gap_the_replay_cannot_fill_is_counted_and_passed(scripted: ScriptedDaemon) -> None:
    fw = EventForwarder(scripted.endpoint, scripted.replay_endpoint, "", to_int, replay_idle_s=1.0)
    try:
        subscribed(fw, scripted)
        # Lost live and gone from the daemon's buffer (kvswapd --kv-events-buffer-bytes 0).
        scripted.publish([stored(1)], live=False, buffered=False)
        scripted.publish([stored(2)], buffered=False)
        got = drain(fw, scripted, lambda got: len(got) == 1)
        assert got == [stored(2)] and fw.counts.lost == 1
        scripted.publish([stored(3)], buffered=False)
        assert drain(fw, scripted, lambda got: len(got) == 1) == [stored(3)]
        assert fw.counts.lost == 1
    finally:
        fw.close()


def test_a_restart_removes_kvswaps_blocks_instead_of_clearing_all(scripted: ScriptedDaemon) -> None:
    """vLLM's AllBlocksCleared has no medium: forwarded, it would clear the GPU's blocks too."""
    fw = EventForwarder(scripted.endpoint, scripted.replay_endpoint, "", to_int, replay_idle_s=1.0)
    try:
        scripted.publish([AllBlocksCleared()], live=False)
        subscribed(fw, scripted)
        old_ts = time.time()
        scripted.publish([stored(1), stored(1, "STORAGE"), stored(2, "STORAGE", parent=1)], ts=old_ts)
        drain(fw, scripted, lambda got: len(got) == 3)
        # A new daemon (without a dropped connection: this one restarts in place) starts again
        # at 0 with AllBlocksCleared; then a batch of the old one, still queued, arrives late.
        scripted.seq, scripted.buffer = 0, []
        scripted.publish([AllBlocksCleared(), stored(2, "STORAGE")])
        scripted.publish([stored(9)], seq=5, ts=old_ts)
        scripted.publish([stored(3)])
        got = drain(fw, scripted, lambda got: any(e == stored(3) for e in got))
        assert not any(isinstance(e, AllBlocksCleared) for e in got)
        removals = {(e.medium, h) for e in got if isinstance(e, BlockRemoved) for h in e.block_hashes}
        assert removals == {("CPU", 1), ("STORAGE", 1), ("STORAGE", 2)}
        assert got[-2:] == [stored(2, "STORAGE"), stored(3)]
        assert stored(9) not in got and fw.counts.stale == 1
        assert fw.counts.resets == 1
    finally:
        fw.close()


def test_a_take_is_bounded(scripted: ScriptedDaemon) -> None:
    fw = EventForwarder(scripted.endpoint, scripted.replay_endpoint, "", to_int, replay_idle_s=1.0)
    try:
        subscribed(fw, scripted)
        many = forwarding.MAX_EVENTS_PER_TAKE + 100
        scripted.publish([stored(i) for i in range(many)], live=False)
        scripted.publish([])  # the gap shows, the replay brings the big batch
        sizes: list[int] = []

        def step() -> None:
            scripted.serve()
            sizes.append(len(fw.take()))

        wait_for("the big batch", lambda: sum(sizes) == many, step)
        assert max(sizes) == forwarding.MAX_EVENTS_PER_TAKE
    finally:
        fw.close()


# -- the forwarder, against a real kvswapd that restarts -----------------------------------------------


Ports = tuple[int, int, int, int]  # requests, metrics, events (PUB), replay (ROUTER)


def events_daemon(root: Path, ports: Ports | None = None) -> tuple[DaemonProcess, Ports]:
    """A kvswapd with KV events on (again on ``ports``, for a restart)."""
    ports = ports or (free_port(), free_port(), free_port(), free_port())
    port, metrics, pub, replay = ports
    d = DaemonProcess(root / "store", port, metrics,
                      extra_args=["--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
                                  "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}"])
    return d.start(), ports


def test_forwarder_through_a_daemon_restart(tmp_path: Path) -> None:
    daemon, ports = events_daemon(tmp_path)
    _, _, pub, replay = ports
    layout = CacheLayout("events", num_layers=2, num_blocks=8, block_size=16, num_kv_heads=1, head_dim=32)
    raw = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    keys = [h.hex() for h in raw]
    names = [to_int(h) for h in raw]
    fw = EventForwarder(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", "", to_int, replay_idle_s=1.0)
    got: list[Event] = []

    def step() -> None:
        got.extend(fw.take())

    host, file = ("CPU", "LOCAL", "kvswap:host"), ("STORAGE", "LOCAL", "kvswap:file")
    try:
        with HostKVCache.create(layout) as cache:
            cache.fill_random(seed=3)
            with Client(daemon.endpoint, timeout=10) as kv:
                kv.register(cache)
                metas = [BlockMeta((names[0],), None, tuple(range(16)), 16), None, None]
                kv.swap_out([0, 1, 2], keys, wait="persisted", block_meta=metas)
            wait_for("three blocks in two tiers", lambda: fw.held() == {host: set(names), file: set(names)}, step)
            first = next(e for e in got if isinstance(e, BlockStored) and e.block_hashes == (names[0],))
            assert first.token_ids == tuple(range(16))
            # Blocks without metadata are named by their key, and renamed to the engine's hash;
            # their parent is the key before them in the swap_out, renamed too.
            second = next(e for e in got if isinstance(e, BlockStored) and e.block_hashes == (names[1],))
            assert second.parent_block_hash == names[0]

            daemon.stop(signal.SIGKILL)
            got.clear()
            daemon, _ = events_daemon(tmp_path, ports)
            wait_for("the reset", lambda: fw.counts.resets == 1 and not fw.held(), step)
            removals = {(e.medium, h) for e in got if isinstance(e, BlockRemoved) for h in e.block_hashes}
            assert removals == {(m, n) for m in ("CPU", "STORAGE") for n in names}
            with Client(daemon.endpoint, timeout=10) as kv:
                kv.register(cache)  # the file tier's start-up scan announces its records again
                wait_for("the file tier's records again", lambda: fw.held() == {file: set(names)}, step)
        assert not any(isinstance(e, AllBlocksCleared) for e in got)
    finally:
        fw.close()
        daemon.stop()


# -- a real vLLM engine --------------------------------------------------------------------------------


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def per_block(events: list[dict[str, Any]], medium: str) -> dict[Any, tuple[Any, list[int], dict[str, Any]]]:
    """hash -> (parent, tokens, event) for every block a BlockStored of ``medium`` names (a GPU
    event names several blocks: its parent is the first's, its tokens all of theirs)."""
    out = {}
    for event in events:
        if event["type"] != "BlockStored" or event["medium"] != medium:
            continue
        parent, size = event["parent_block_hash"], event["block_size"]
        for i, h in enumerate(event["block_hashes"]):
            out[h] = (parent, event["token_ids"][i * size:(i + 1) * size], event)
            parent = h
    return out


def removed_hashes(events: list[dict[str, Any]], ownership: str) -> set[Any]:
    return {h for e in events if e["type"] == "BlockRemoved" and e.get("ownership") == ownership
            for h in e["block_hashes"]}


def held_after(events: list[dict[str, Any]], ownership: str) -> set[Any]:
    """The blocks a tier holds once ``events`` are applied in order (what a router ends up with)."""
    held: set[Any] = set()
    for e in events:
        if e.get("ownership") == ownership:
            (held.update if e["type"] == "BlockStored" else held.difference_update)(e["block_hashes"])
    return held


@dataclass
class EventsEngine:
    """A vLLM engine with KV events on, beside its own kvswapd with events on."""

    work: Path
    daemon: DaemonProcess  # replaced by the test that restarts it
    ports: Ports
    engine: Any
    log: Path  # the engine's published stream, decoded (benchmarks/vllm_engine.py --kv-events-log)
    stats: Path  # the connector's stats file, written when the engine exits


def start_events_engine(python: str, work: Path, model: str, int_hashes: bool) -> EventsEngine:
    """``int_hashes``: vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (1, its default: a block is named
    by its hash's low 64 bits; 0: by the hash's bytes). vLLM reads it once, at start: one engine
    each."""
    daemon, ports = events_daemon(work)
    _, _, pub, replay = ports
    mod = _load_engine_module()
    log = work / "engine-events.jsonl"
    stats = work / "connector-stats.json"
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{free_port()}"}
    extra = {"kv_events_endpoint": f"tcp://127.0.0.1:{pub}", "kv_events_replay_endpoint": f"tcp://127.0.0.1:{replay}",
             "retry_s": 0.2}
    env = vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES="1" if int_hashes else "0")
    started = time.monotonic()
    try:
        engine = mod.EngineProcess(python, [
            "--model", model, "--endpoint", daemon.endpoint, "--stats-file", str(stats), "--block-size", str(BLOCK),
            "--block-bytes", str(BLOCK_BYTES), "--cache-blocks", "80", "--max-model-len", "2048",
            "--load-policy", "always", "--connector-extra", json.dumps(extra),
            "--kv-events-config", json.dumps(events_config), "--kv-events-log", str(log)],
            str(work / "engine.log"), env=env)
    except BaseException:
        daemon.stop()
        raise
    print(f"\n[vllm] engine (int hashes: {int_hashes}) up in {time.monotonic() - started:.1f} s "
          f"(log {work / 'engine.log'})")
    return EventsEngine(work, daemon, ports, engine, log, stats)


@pytest.fixture(scope="module")
def events_engines(vllm_python, tmp_path_factory) -> Iterator[dict[bool, EventsEngine]]:  # noqa: F811
    """Both namings' engines, started side by side: each start is mostly one core's work
    (imports, loading the compiled model), so on 2 cores two take about as long as one (~25 s
    here); one after the other they took twice that. Each test uses its own engine and daemon."""
    model = _load_engine_module().make_model_dir(str(tmp_path_factory.mktemp("model")), LAYERS, HIDDEN, HEADS,
                                                 KV_HEADS, 512, 1024)
    works = {h: tmp_path_factory.mktemp("int-hashes" if h else "bytes-hashes") for h in (True, False)}
    with ThreadPoolExecutor(len(works)) as pool:
        futures = {h: pool.submit(start_events_engine, vllm_python, work, model, h) for h, work in works.items()}
    engines: dict[bool, EventsEngine] = {}
    failure: BaseException | None = None
    for h, future in futures.items():
        try:
            engines[h] = future.result()
        except Exception as exc:  # noqa: BLE001 - raised below, once the other is closed
            failure = failure or exc
    try:
        if failure is not None:
            raise failure
        yield engines
    finally:
        for pair in engines.values():
            pair.engine.close()
            pair.daemon.stop()


@pytest.mark.vllm
@pytest.mark.timeout(600)
@pytest.mark.parametrize("int_hashes", [True, False], ids=["int-hashes", "bytes-hashes"])
def test_vllm_publishes_kvswaps_blocks_with_the_engines_names(events_engines: dict[bool, EventsEngine],
                                                              int_hashes: bool) -> None:
    """``int_hashes``: see start_events_engine."""
    pair = events_engines[int_hashes]
    engine, log, tmp_path, ports = pair.engine, pair.log, pair.work, pair.ports
    small = iter(range(100, 10_000))

    def step() -> None:
        # The scheduler forwards kvswap's events when it steps: a short request (no full
        # block: nothing of its own to store) makes it step.
        engine.generate([_prompt(next(small), 5)], 1)

    try:
        prompt = _prompt(1, 600)
        engine.generate([prompt], 8)
        blocks = (600 + 8 - 1) // BLOCK  # full blocks once the answer is computed (all but its last token)
        kv: dict[str, dict[Any, Any]] = {}

        def both_tiers_hold_the_prompt() -> bool:
            events = [e for batch in read_events(log) for e in batch["events"]]
            kv["CPU"], kv["STORAGE"] = per_block(events, "CPU"), per_block(events, "STORAGE")
            return all(len(kv[m]) >= blocks for m in kv)

        wait_for("kvswap's blocks in the engine's stream", both_tiers_hold_the_prompt, step, timeout=120)
        events = [e for batch in read_events(log) for e in batch["events"]]
        gpu = per_block(events, "GPU")
        # The engine's own names of the prompt's blocks: its GPU BlockStored for the prompt.
        prompt_event = next(e for e in events if e["type"] == "BlockStored" and e["medium"] == "GPU"
                            and e["token_ids"][:BLOCK] == prompt[:BLOCK])
        assert prompt_event["parent_block_hash"] is None
        names = prompt_event["block_hashes"][:blocks]
        assert len(names) == blocks
        if int_hashes:
            assert all(isinstance(h, int) and 0 <= h < 2**64 for h in names)
        else:  # sha256 digests (the log writes bytes as "hex:...")
            assert all(isinstance(h, str) and len(bytes.fromhex(h.removeprefix("hex:"))) == 32 for h in names)
        for medium, ownership in (("CPU", "kvswap:host"), ("STORAGE", "kvswap:file")):
            assert set(kv[medium]) == set(names), f"{medium}: kvswap's blocks are not the engine's"
            for i, h in enumerate(names):
                parent, tokens, event = kv[medium][h]
                assert parent == (names[i - 1] if i else None), f"{medium} block {i}: parent"
                assert tokens == prompt[i * BLOCK:(i + 1) * BLOCK], f"{medium} block {i}: tokens"
                assert (parent, tokens) == gpu[h][:2]
                assert event["block_size"] == gpu[h][2]["block_size"] == BLOCK
                assert (event["locality"], event["ownership"]) == ("LOCAL", ownership)
                assert event["group_idx"] == gpu[h][2]["group_idx"] == 0
            # Each record once per tier: replayed and live batches were not both forwarded.
            assert sum(len(e["block_hashes"]) for e in events if e["type"] == "BlockStored"
                       and e.get("ownership") == ownership) == blocks
        batches = read_events(log)
        assert [b["seq"] for b in batches] == list(range(len(batches))), "the stream lost or repeated a batch"

        # kvswapd restarts: the stream removes kvswap's blocks (both tiers) and nothing else;
        # once the worker registered again, the file tier's scan names its records again, by
        # the engine's hashes.
        pair.daemon.stop(signal.SIGKILL)
        pair.daemon, _ = events_daemon(tmp_path, ports)
        after: list[dict[str, Any]] = []
        more = iter(range(20_000, 30_000))

        def step_with_saves() -> None:
            # Two full blocks: a save (the first is refused, not_registered; the next registers).
            engine.generate([_prompt(next(more), 2 * BLOCK + 1)], 1)

        def file_tier_announced_again() -> bool:
            after[:] = [e for batch in read_events(log)[len(batches):] for e in batch["events"]]
            return set(names) <= removed_hashes(after, "kvswap:file") and set(names) <= held_after(after, "kvswap:file")

        wait_for("the file tier's records after the restart", file_tier_announced_again, step_with_saves,
                 timeout=120)
        # The new daemon's RAM is empty: the RAM tier's blocks left the stream and stay gone.
        assert set(names) <= removed_hashes(after, "kvswap:host")
        assert not set(names) & held_after(after, "kvswap:host")
        assert not any(e["type"] == "AllBlocksCleared" for b in read_events(log) for e in b["events"])
    finally:
        engine.close()
        pair.daemon.stop()
    counts = json.loads(pair.stats.read_text())["kv_events"]
    print(f"\n[vllm] forwarder counts: {counts}")
    assert counts["resets"] >= 1 and counts["lost"] == 0 and counts["bad"] == 0
