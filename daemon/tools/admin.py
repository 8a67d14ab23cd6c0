"""``kvswap``: the operator's command line (demo, and the tools that follow it)."""

from __future__ import annotations

import sys

import click

from kvswap import __version__

from .presets import PRESETS


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(__version__, prog_name="kvswap")
def main() -> None:
    """kvswap: operate and try out kvswapd."""


@main.command()
@click.option("--storage-dir", default="./kvswap-demo-store", help="Directory the demo daemon stores records in.")
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="small", help="Cache layout to play.")
@click.option("--blocks", type=click.IntRange(1, 100_000), default=128, help="Blocks to swap out and back in.")
@click.option("--linger", type=click.FloatRange(0), default=0.0,
              help="Seconds to keep the daemon up at the end, to look at its metrics.")
def demo(storage_dir: str, preset: str, blocks: int, linger: float) -> None:
    """Start a daemon, swap random KV blocks out and back in, check every byte."""
    from .demo import run_demo

    ok = run_demo(storage_dir, preset=preset, blocks=blocks, linger_s=linger, say=click.echo)
    sys.exit(0 if ok else 1)


from .keygen import keygen  # noqa: E402  (CURVE keys; its own module)

main.add_command(keygen)

from .events_command import events  # noqa: E402  (what a daemon's KV events say each tier holds)
from .launcher import launch  # noqa: E402  (one kvswapd per GPU beside a server)
from .status import status  # noqa: E402  (a running daemon at a glance)

main.add_command(events)
main.add_command(launch)
main.add_command(status)

from .store_commands import gc, inspect, verify  # noqa: E402  (offline storage tools)
from .bench_command import bench  # noqa: E402  (throughput and latency against baselines)

main.add_command(bench)

main.add_command(inspect)
main.add_command(verify)
main.add_command(gc)


if __name__ == "__main__":  # pragma: no cover
    main()
