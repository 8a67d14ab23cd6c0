"""``kvswap events``: what a daemon's KV events say each tier holds, as a router would see it.

It joins the stream as a late router must (subscribe, replay from 0; see
:mod:`kvswap.protocol.kv_events_subscriber`), prints how many blocks each tier holds by the
events, and with ``--follow`` prints every batch as it arrives (one line per event; JSON lines
with ``--json``) until ``--seconds`` pass or it is interrupted. For an operator checking what a
router is told, or why it routes as it does.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click

from kvswap.protocol.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event
from kvswap.protocol.kv_events_subscriber import Subscriber, hash_text


def _hash(h: BlockHash) -> str | int:
    return h if isinstance(h, int) else hash_text(h)  # ints stay numbers in JSON


def event_record(seq: int, event: Event) -> dict[str, Any]:
    """One event as a JSON-ready map (what ``--json`` prints, one per line)."""
    out: dict[str, Any] = {"seq": seq, "type": type(event).__name__}
    if isinstance(event, (BlockStored, BlockRemoved)):
        out.update(medium=event.medium, locality=event.locality, ownership=event.ownership,
                   block_hashes=[_hash(h) for h in event.block_hashes])
    if isinstance(event, BlockStored):
        out.update(parent_block_hash=None if event.parent_block_hash is None else _hash(event.parent_block_hash),
                   token_ids=list(event.token_ids), block_size=event.block_size, lora_name=event.lora_name)
    return out


def _line(seq: int, event: Event) -> str:
    if isinstance(event, AllBlocksCleared):
        return f"{seq:>8}  AllBlocksCleared"
    rec = event_record(seq, event)
    hashes = rec["block_hashes"]
    shown = ", ".join(str(h)[:20] for h in hashes[:3]) + (f", ... ({len(hashes)})" if len(hashes) > 3 else "")
    extra = ""
    if isinstance(event, BlockStored):
        extra = f"  parent {str(rec['parent_block_hash'])[:20]}  {len(event.token_ids)} tokens"
    return f"{seq:>8}  {rec['type']:<12} {rec['ownership'] or rec['medium']:<14} {shown}{extra}"


def summary(sub: Subscriber) -> dict[str, int]:
    """Blocks each tier holds by the events: ``ownership`` (or medium) -> count."""
    return {owner or medium or "?": len(hashes) for (medium, owner), hashes in sorted(
        sub.view.held.items(), key=lambda kv: str(kv[0])) if hashes}


@click.command()
@click.argument("endpoint")
@click.option("--replay", "replay_endpoint", required=True,
              help="The daemon's --kv-events-replay-endpoint (a late joiner needs the past batches).")
@click.option("--topic", default="", help="The daemon's --kv-events-topic.")
@click.option("--follow", is_flag=True, help="Then print every batch as it arrives.")
@click.option("--seconds", type=click.FloatRange(0), default=None,
              help="With --follow: stop after this long. [default: until interrupted]")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per event (and the summary as one).")
@click.option("--timeout", type=click.FloatRange(0.1), default=10.0, help="Seconds to wait for the replay.")
def events(endpoint: str, replay_endpoint: str, topic: str, follow: bool, seconds: float | None, as_json: bool,
           timeout: float) -> None:
    """What kvswapd's KV events say each tier holds: ENDPOINT is its --kv-events-endpoint."""
    def show(seq: int, batch: list[Event]) -> None:
        for event in batch:
            click.echo(json.dumps(event_record(seq, event)) if as_json else _line(seq, event))

    sub = Subscriber(endpoint, replay_endpoint, topic.encode(), on_batch=show if follow else None)
    try:
        try:
            sub.join(timeout)
        except TimeoutError:
            raise click.ClickException(f"no answer from the replay socket {replay_endpoint} in {timeout:g} s "
                                       "(is it the daemon's --kv-events-replay-endpoint?)") from None
        counts = summary(sub)
        if as_json:
            click.echo(json.dumps({"summary": counts, "batches": sub.batches, "next_seq": sub.next_seq}))
        else:
            click.echo(f"{sub.batches} batches replayed (next seq {sub.next_seq}); blocks held by the events:", err=follow)
            for tier, n in counts.items() or [("(none)", 0)]:
                click.echo(f"  {tier:<16} {n}", err=follow)
        if follow:
            deadline = None if seconds is None else time.monotonic() + seconds
            while deadline is None or time.monotonic() < deadline:
                left_ms = 200 if deadline is None else max(1, min(200, int((deadline - time.monotonic()) * 1000)))
                sub.poll(left_ms)
                sys.stdout.flush()
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
