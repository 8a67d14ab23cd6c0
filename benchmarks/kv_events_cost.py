"""What KV events cost: swap_out and lookup throughput with events off and on, in one run.

    python benchmarks/kv_events_cost.py [--records 512] [--record-bytes 262144] [--batch 16]
        [--rounds 11] [--lookup-keys 64] [--lookups 1000] [--copied] [--json PATH] [--plot PATH]

Two real kvswapds run side by side on loopback, each with its own storage directory and the
default tiers (RAM and file): one without KV events, one with ``--kv-events-endpoint`` and
``--kv-events-replay-endpoint``. A subscriber process connects to the second as a router
would: it subscribes to the PUB socket, decodes every batch (``decode_batch``), counts the
events and fills any gap in the sequence numbers through the replay socket.

Three configurations, measured in rounds that take turns (off, on, on+meta, off, on, ...) so
that whatever else the machine does hits them alike:

- ``off``: the daemon without events;
- ``on``: the daemon with events; swap_outs send keys only (events name blocks by their keys);
- ``on+meta``: the same daemon; each swap_out also sends ``block_meta``, one ``BlockMeta`` per
  key (a 32-byte hash, its parent's hash, 16 token ids), as the vLLM connector does.

Each round starts from an empty store (``clear``, not timed), then times ``--records``
swap_outs of fresh keys, ``--batch`` keys a request, each request one prefix chain, with
``wait="persisted"`` (and with ``--copied`` as many again with ``wait="copied"``, then a flush
not timed), waits until the subscriber has every event, then times ``--lookups`` lookups of a
``--lookup-keys``-key prefix that hits. The report gives the median of each configuration and
the ratio of each events-on median to the off median (1.0: no cost; 0.9: 10% slower), and the
daemon's CPU time per 1,000 records swapped out.

The subscriber's count of ``BlockStored`` events must equal what the swap_outs stored: records
x tiers (one event per record per tier); on+meta's must all carry the engine's hashes and
tokens. The script exits 1 when they differ (after writing the report).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Sequence

import zmq

from kvswap.daemon.tools.local_daemon import LocalDaemon, free_port
from kvswap.protocol import CacheLayout, Client, HostKVCache
from kvswap.protocol.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockMeta,
    BlockRemoved,
    BlockStored,
    decode_batch,
    seq_bytes,
)

CONFIGS = ("off", "on", "on+meta")
#: Tokens per block, and the layout's other dimensions: a record is ``num_layers`` x 16 KiB.
BLOCK_TOKENS = 16
KV_HEADS = 2
HEAD_DIM = 128
LAYER_BYTES = 2 * KV_HEADS * BLOCK_TOKENS * HEAD_DIM * 2  # key and value, bf16
#: How long the subscriber may take to show every event of a round once its swap_outs returned.
EVENTS_WAIT_S = 30.0


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def field_name(config: str) -> str:
    return config.replace("+", "_")


# -- the subscriber (its own process, as a router is) --------------------------------------------------


def subscribe(endpoint: str, replay_endpoint: str, conn: Connection) -> None:
    """Drain the PUB socket and count events until told to stop. Commands on ``conn``:
    ``"sync"`` (fetch any batch missed since the last one seen through replay, then send the
    counts) and ``"stop"``."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(endpoint)
    replay = ctx.socket(zmq.DEALER)
    replay.setsockopt(zmq.LINGER, 0)
    replay.connect(replay_endpoint)
    counts = {"batches_live": 0, "batches_replayed": 0, "duplicates_skipped": 0, "restarts": 0,
              "stored": 0, "stored_cpu": 0, "stored_storage": 0, "stored_with_meta": 0,
              "removed": 0, "cleared": 0, "decode_errors": 0}
    next_seq = 0  # the next batch to apply: a late start is caught up by replay from 0

    def apply(seq: int, payload: bytes, live: bool) -> None:
        nonlocal next_seq
        next_seq = seq + 1
        counts["batches_live" if live else "batches_replayed"] += 1
        try:
            _, events, _ = decode_batch(payload)
        except ValueError:
            counts["decode_errors"] += 1
            return
        for event in events:
            if isinstance(event, BlockStored):
                counts["stored"] += 1
                counts["stored_cpu" if event.medium == "CPU" else "stored_storage"] += 1
                if event.token_ids and all(isinstance(h, bytes) and len(h) == 32 for h in event.block_hashes):
                    counts["stored_with_meta"] += 1
            elif isinstance(event, BlockRemoved):
                counts["removed"] += len(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                counts["cleared"] += 1

    def catch_up() -> None:
        """Every buffered batch from ``next_seq`` on, through the replay socket."""
        replay.send_multipart([b"", seq_bytes(next_seq)])
        while True:
            if not replay.poll(5000):
                counts["replay_timeouts"] = counts.get("replay_timeouts", 0) + 1
                return
            frames = replay.recv_multipart()
            if len(frames) != 4 or frames[2] == END_SEQ:
                return
            seq = int.from_bytes(frames[2], "big")
            if seq >= next_seq:
                apply(seq, frames[3], live=False)

    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    poller.register(conn.fileno(), zmq.POLLIN)
    while True:
        ready = dict(poller.poll(1000))
        if sub in ready:
            for _ in range(256):  # drain what is there before looking at commands again
                try:
                    topic, seq_frame, payload = sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                seq = int.from_bytes(seq_frame, "big")
                if seq == 0 and next_seq > 1:
                    counts["restarts"] += 1  # not expected here: the daemon runs for the whole run
                    next_seq = 0
                if seq < next_seq:
                    counts["duplicates_skipped"] += 1
                    continue
                if seq > next_seq:
                    catch_up()  # batches this socket missed (the join, or a full queue)
                    if seq < next_seq:
                        counts["duplicates_skipped"] += 1
                        continue
                apply(seq, payload, live=True)
        if conn.fileno() in ready:
            command = conn.recv()
            if command == "stop":
                break
            catch_up()
            conn.send(dict(counts, next_seq=next_seq))
    sub.close(0)
    replay.close(0)
    ctx.term()


class Subscriber:
    def __init__(self, endpoint: str, replay_endpoint: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=subscribe, args=(endpoint, replay_endpoint, child), daemon=True)
        self._proc.start()
        child.close()

    def sync(self) -> dict[str, int]:
        self._conn.send("sync")
        if not self._conn.poll(60):
            raise RuntimeError("the subscriber did not answer within 60 s")
        counts: dict[str, int] = self._conn.recv()
        return counts

    def cpu_s(self) -> float:
        return process_cpu_s(self._proc.pid)

    def stop(self) -> None:
        try:
            self._conn.send("stop")
        except OSError:
            pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


# -- measuring ---------------------------------------------------------------------------------------------


def process_cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of a process so far (0 where /proc is missing)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def layout_for(record_bytes: int, num_blocks: int) -> CacheLayout:
    if record_bytes < LAYER_BYTES or record_bytes % LAYER_BYTES:
        raise SystemExit(f"--record-bytes must be a positive multiple of {LAYER_BYTES} "
                         f"(one layer of {BLOCK_TOKENS} tokens, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, bf16)")
    return CacheLayout("kv-events-cost", num_layers=record_bytes // LAYER_BYTES, num_blocks=num_blocks,
                       block_size=BLOCK_TOKENS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="bfloat16")


def block_hash(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def metas_for(keys: Sequence[str], parent: bytes | None) -> list[BlockMeta | None]:
    """One BlockMeta per key, as the vLLM connector sends: the block's hash, its parent's, and
    its tokens (made-up ids; only their count matters to the cost)."""
    out: list[BlockMeta | None] = []
    for key in keys:
        h = block_hash(key)
        tokens = tuple(int.from_bytes(h[i:i + 2], "big") for i in range(0, 2 * BLOCK_TOKENS, 2))
        out.append(BlockMeta((h,), parent, tokens, BLOCK_TOKENS))
        parent = h
    return out


def swap_out_pass(client: Client, keys: list[str], batch: int, num_blocks: int, wait: str,
                  meta: bool) -> float:
    """Swap ``keys`` out, ``batch`` a request; returns the seconds it took."""
    parent: bytes | None = None
    start = time.perf_counter()
    for s in range(0, len(keys), batch):
        chunk = keys[s:s + batch]
        blocks = [(s + i) % num_blocks for i in range(len(chunk))]
        metas = metas_for(chunk, parent) if meta else None
        result = client.swap_out(blocks, chunk, wait=wait, block_meta=metas)
        if result.stored + result.queued != len(chunk):
            raise RuntimeError(f"swap_out ({wait}) took {result.stored + result.queued} of {len(chunk)} keys: "
                               f"{result.status[:8]}")
        if meta:
            parent = block_hash(chunk[-1])
    return time.perf_counter() - start


def lookup_pass(client: Client, keys: list[str], lookups: int) -> float:
    start = time.perf_counter()
    for _ in range(lookups):
        hits = client.lookup(keys)
        if hits != len(keys):
            raise RuntimeError(f"lookup of {len(keys)} stored keys answered {hits}")
    return time.perf_counter() - start


def wait_for_events(subscriber: Subscriber, base: dict[str, int], expected: int) -> dict[str, int]:
    deadline = time.monotonic() + EVENTS_WAIT_S
    while True:
        counts = subscriber.sync()
        if counts["stored"] - base["stored"] >= expected or time.monotonic() > deadline:
            return counts
        time.sleep(0.02)


def store_tiers(client: Client) -> list[str]:
    return list(client.stats()["locations"]["store"])


def run(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    layout = layout_for(args.record_bytes, max(4 * args.batch, 64))
    pub, replay = free_port(), free_port()
    events_args = ["--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
                   "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}"]
    log_off = open(Path(workdir) / "kvswapd-off.log", "wb")
    log_on = open(Path(workdir) / "kvswapd-on.log", "wb")
    daemons = {"off": LocalDaemon(str(Path(workdir) / "off"), list(args.daemon_arg), log_off),
               "on": LocalDaemon(str(Path(workdir) / "on"), [*args.daemon_arg, *events_args], log_on)}
    subscriber: Subscriber | None = None
    try:
        pids: dict[str, int | None] = {}
        for name, daemon in daemons.items():
            proc = daemon.start().proc
            pids[name] = proc.pid if proc is not None else None
        subscriber = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
        with HostKVCache.create(layout) as cache, Client(daemons["off"].endpoint, timeout=300) as c_off, \
                Client(daemons["on"].endpoint, timeout=300) as c_on:
            cache.fill_random(7)
            clients = {"off": c_off, "on": c_on}
            for c in clients.values():
                c.register(cache)
            tiers = {name: store_tiers(c) for name, c in clients.items()}
            if tiers["off"] != tiers["on"]:
                raise RuntimeError(f"the two daemons store to different tiers: {tiers}")
            n_tiers = len(tiers["on"])
            progress(f"kv_events_cost: {args.records} records of {layout.record_bytes} bytes a round, "
                     f"{args.batch} a swap_out, tiers {'+'.join(tiers['on'])}; {args.rounds} rounds of "
                     f"{', '.join(CONFIGS)}; lookups of {args.lookup_keys} keys x {args.lookups}")

            # Warm-up, not measured: each daemon fills its RAM tier's pages once, and the
            # subscriber shows it receives (its SUB socket has joined).
            for name, c in clients.items():
                c.clear()
                keys = [f"warm-{name}-{i}" for i in range(args.records)]
                swap_out_pass(c, keys, args.batch, layout.num_blocks, "persisted", meta=False)
                lookup_pass(c, keys[:args.lookup_keys], min(args.lookups, 100))
            base = subscriber.sync()
            warm = wait_for_events(subscriber, {**base, "stored": 0}, args.records * n_tiers)
            if warm["stored"] < args.records * n_tiers:
                raise RuntimeError(f"the subscriber saw {warm['stored']} of the warm-up's "
                                   f"{args.records * n_tiers} BlockStored events")

            rounds: list[dict[str, Any]] = []
            received = expected = with_meta = with_meta_expected = 0
            for r in range(args.rounds):
                for config in CONFIGS:
                    daemon_name = "off" if config == "off" else "on"
                    c = clients[daemon_name]
                    pid = pids[daemon_name]
                    c.clear()
                    time.sleep(0.2)  # the clear's deletes and events settle before the clock starts
                    before = subscriber.sync()
                    meta = config == "on+meta"
                    keys = [f"r{r}-{field_name(config)}-{i}" for i in range(args.records)]
                    cpu0 = process_cpu_s(pid)
                    sub_cpu0 = subscriber.cpu_s()
                    seconds = swap_out_pass(c, keys, args.batch, layout.num_blocks, "persisted", meta)
                    row: dict[str, Any] = {"round": r, "config": config,
                                           "swap_out_records_per_s": args.records / seconds}
                    stored_now = args.records
                    if args.copied:
                        copied_keys = [f"r{r}-{field_name(config)}-c{i}" for i in range(args.records)]
                        copied_s = swap_out_pass(c, copied_keys, args.batch, layout.num_blocks, "copied", meta)
                        c.flush()
                        row["swap_out_copied_records_per_s"] = args.records / copied_s
                        stored_now += args.records
                    if config != "off":
                        # The daemon's CPU counts until its publisher has sent every event.
                        after = wait_for_events(subscriber, before, stored_now * n_tiers)
                        row["subscriber_cpu_ms_per_1k_records"] = (subscriber.cpu_s() - sub_cpu0) * 1e6 / stored_now
                    row["daemon_cpu_ms_per_1k_records"] = (process_cpu_s(pid) - cpu0) * 1e6 / stored_now
                    if config != "off":
                        row["events_received"] = after["stored"] - before["stored"]
                        row["events_expected"] = stored_now * n_tiers
                        received += row["events_received"]
                        expected += row["events_expected"]
                        if meta:
                            row["events_with_meta"] = after["stored_with_meta"] - before["stored_with_meta"]
                            with_meta += row["events_with_meta"]
                            with_meta_expected += row["events_expected"]
                    held = {tier: info.get("records") for tier, info in c.stats()["tiers"].items()}
                    if any(held.get(tier) != stored_now for tier in tiers["on"]):
                        progress(f"  note: after round {r} {config} the tiers hold {held}, not {stored_now} each")
                    lookup_s = lookup_pass(c, keys[:args.lookup_keys], args.lookups)
                    row["lookup_per_s"] = args.lookups / lookup_s
                    rounds.append(row)
                    progress(f"  round {r + 1}/{args.rounds} {config:8} "
                             f"swap_out {row['swap_out_records_per_s']:9.0f} rec/s"
                             + (f"  copied {row['swap_out_copied_records_per_s']:9.0f} rec/s" if args.copied else "")
                             + f"  lookup {row['lookup_per_s']:8.0f}/s"
                             + f"  daemon CPU {row['daemon_cpu_ms_per_1k_records']:6.0f} ms/1k rec"
                             + (f"  events {row['events_received']}/{row['events_expected']}"
                                if "events_received" in row else ""))
            final = subscriber.sync()
            for c in clients.values():
                c.clear()
                c.unregister()
        return summarize(args, layout, tiers["on"], rounds, received, expected, with_meta, with_meta_expected, final)
    finally:
        if subscriber is not None:
            subscriber.stop()
        for daemon in daemons.values():
            daemon.stop()
        log_off.close()
        log_on.close()


def summarize(args: argparse.Namespace, layout: CacheLayout, tiers: list[str], rounds: list[dict[str, Any]],
              received: int, expected: int, with_meta: int, with_meta_expected: int,
              counts: dict[str, int]) -> dict[str, Any]:
    report: dict[str, Any] = {
        "records": args.records, "record_bytes": layout.record_bytes, "batch": args.batch, "rounds": args.rounds,
        "lookup_keys": args.lookup_keys, "lookups": args.lookups, "tiers": tiers, "wait": "persisted",
        "copied": args.copied, "daemon_args": list(args.daemon_arg),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
    }
    measures = ["swap_out_records_per_s", "lookup_per_s", "daemon_cpu_ms_per_1k_records"]
    if args.copied:
        measures.insert(1, "swap_out_copied_records_per_s")
    for measure in measures:
        for config in CONFIGS:
            values = [row[measure] for row in rounds if row["config"] == config]
            report[f"{measure}_{field_name(config)}"] = statistics.median(values)
    for config in CONFIGS[1:]:
        values = [row["subscriber_cpu_ms_per_1k_records"] for row in rounds if row["config"] == config]
        report[f"subscriber_cpu_ms_per_1k_records_{field_name(config)}"] = statistics.median(values)
    for prefix, measure in (("swap_out", "swap_out_records_per_s"),
                            ("swap_out_copied", "swap_out_copied_records_per_s"), ("lookup", "lookup_per_s")):
        if measure not in measures:
            continue
        off = report[f"{measure}_off"]
        report[f"{prefix}_ratio"] = report[f"{measure}_on"] / off
        report[f"{prefix}_meta_ratio"] = report[f"{measure}_on_meta"] / off
        # Each round's own ratio (its on or on+meta over the off just before it): their spread
        # shows how much of a ratio is the machine's noise.
        by_round = {(row["round"], row["config"]): row[measure] for row in rounds}
        for name, config in (("ratio", "on"), ("meta_ratio", "on+meta")):
            report[f"{prefix}_{name}_per_round"] = [round(by_round[(r, config)] / by_round[(r, "off")], 3)
                                                    for r in range(args.rounds)]
    report.update({
        "swap_outs_records_stored": sum(args.records * (2 if args.copied else 1) for _ in rounds),
        "events_received": received, "events_expected": expected,
        "events_with_meta_received": with_meta, "events_with_meta_expected": with_meta_expected,
        "events_ok": received == expected and with_meta == with_meta_expected,
        "subscriber": {k: v for k, v in counts.items()},
        "per_round": rounds,
    })
    return report


def plot(report: dict[str, Any], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed; no plot written (pip install matplotlib)")
        return
    panels = [("swap_out_records_per_s", "swap_out persisted (records/s)"), ("lookup_per_s", "lookup (lookups/s)")]
    if report["copied"]:
        panels.insert(1, ("swap_out_copied_records_per_s", "swap_out copied (records/s)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4))
    for ax, (measure, title) in zip(axes, panels):
        for i, config in enumerate(CONFIGS):
            values = [row[measure] for row in report["per_round"] if row["config"] == config]
            ax.bar(i, statistics.median(values), color=("#888", "#3a7", "#37a")[i])
            ax.plot([i] * len(values), values, "k.", markersize=4)
        ax.set_xticks(range(len(CONFIGS)), CONFIGS)
        ax.set_title(title)
    fig.suptitle(f"KV events cost: {report['records']} x {report['record_bytes']} B records, "
                 f"{report['rounds']} rounds, {report['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def print_report(report: dict[str, Any]) -> None:
    print(f"\nKV events cost: {report['records']} records of {report['record_bytes']} bytes, "
          f"{report['batch']} a swap_out, tiers {'+'.join(report['tiers'])}, medians of {report['rounds']} rounds "
          f"({report['machine']})")
    rows = [("swap_out persisted (records/s)", "swap_out_records_per_s", "swap_out")]
    if report["copied"]:
        rows.append(("swap_out copied (records/s)", "swap_out_copied_records_per_s", "swap_out_copied"))
    rows.append((f"lookup of {report['lookup_keys']} keys (/s)", "lookup_per_s", "lookup"))
    print(f"{'':34}{'off':>10}{'on':>10}{'on+meta':>10}{'on/off':>9}{'meta/off':>9}")
    for title, measure, prefix in rows:
        print(f"{title:34}{report[measure + '_off']:10.0f}{report[measure + '_on']:10.0f}"
              f"{report[measure + '_on_meta']:10.0f}{report[prefix + '_ratio']:9.3f}"
              f"{report[prefix + '_meta_ratio']:9.3f}")
    cpu = "daemon_cpu_ms_per_1k_records"
    print(f"{'daemon CPU (ms per 1,000 records)':34}{report[cpu + '_off']:10.0f}{report[cpu + '_on']:10.0f}"
          f"{report[cpu + '_on_meta']:10.0f}")
    sub = "subscriber_cpu_ms_per_1k_records"
    print(f"{'subscriber CPU (ms per 1,000 rec)':34}{'':>10}{report[sub + '_on']:10.0f}"
          f"{report[sub + '_on_meta']:10.0f}")
    print("each round's ratio to the off round before it (the machine's noise):")
    for title, _, prefix in rows:
        on, meta = report[prefix + "_ratio_per_round"], report[prefix + "_meta_ratio_per_round"]
        print(f"  {title:32}on/off {min(on):.2f}..{max(on):.2f}, on+meta/off {min(meta):.2f}..{max(meta):.2f}")
    print(f"BlockStored events: {report['events_received']} received of {report['events_expected']} expected "
          f"(on+meta named by the engine's hashes: {report['events_with_meta_received']} of "
          f"{report['events_with_meta_expected']}); batches live {report['subscriber']['batches_live']}, "
          f"through replay {report['subscriber']['batches_replayed']}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=512, help="records swapped out per round (default 512)")
    parser.add_argument("--record-bytes", type=int, default=256 * 1024,
                        help=f"bytes of one record, a multiple of {LAYER_BYTES} (default 262144)")
    parser.add_argument("--batch", type=int, default=16, help="keys per swap_out request, one chain (default 16)")
    parser.add_argument("--rounds", type=int, default=11, help="rounds of each configuration (default 11)")
    parser.add_argument("--lookup-keys", type=int, default=64, help="keys in each lookup, all stored (default 64)")
    parser.add_argument("--lookups", type=int, default=1000, help="lookups timed per round (default 1000)")
    parser.add_argument("--copied", action="store_true", help="also time swap_outs with wait=copied")
    parser.add_argument("--daemon-arg", action="append", default=[], metavar="ARG",
                        help="an argument for both daemons (repeat it: --daemon-arg=--fsync --daemon-arg=data)")
    parser.add_argument("--storage-dir", default=None, help="where the daemons' directories go (default: a temp dir)")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON to PATH")
    parser.add_argument("--plot", metavar="PATH", help="bar chart of the medians (needs matplotlib)")
    args = parser.parse_args(argv)
    for name in ("records", "batch", "rounds", "lookup_keys", "lookups"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.lookup_keys > args.records:
        parser.error("--lookup-keys cannot be more than --records (a lookup of keys that hit)")
    with tempfile.TemporaryDirectory(prefix="kvswap-events-cost-", dir=args.storage_dir) as workdir:
        report = run(args, workdir)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"report written to {args.json}")
    if args.plot:
        plot(report, args.plot)
    if not report["events_ok"]:
        print(f"FAIL: the subscriber counted {report['events_received']} BlockStored events, "
              f"{report['events_expected']} expected ({report['events_with_meta_received']} of "
              f"{report['events_with_meta_expected']} named by block_meta)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
