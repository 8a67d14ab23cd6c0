"""``kvswap bench``: the command line over :mod:`kvswap.daemon.tools.bench`."""

from __future__ import annotations

import json
import sys

import click

from .presets import PRESETS


@click.command()
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="small", show_default=True,
              help="Cache layout the engine plays.")
@click.option("--blocks", type=click.IntRange(4), default=512, show_default=True, help="Blocks per key set.")
@click.option("--batch", type=click.IntRange(1), default=32, show_default=True, help="Blocks per request.")
@click.option("--storage-dir", default=None, help="Directory to benchmark (default: a temp dir under .).")
@click.option("--fsync", type=click.Choice(["none", "data", "strict"]), default="none", show_default=True,
              help="The benchmarked daemon's --fsync mode.")
@click.option("--daemon-arg", "daemon_args", multiple=True, help="Extra kvswapd flag (repeatable).")
@click.option("--idle-seconds", type=click.FloatRange(0.1), default=5.0, show_default=True,
              help="How long to measure the daemon's CPU use while it is idle.")
@click.option("--quick", is_flag=True, help="A seconds-long smoke run (tiny layout, few blocks).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--plot", "plot_path", default=None, metavar="FILE.png",
              help="Also sweep block sizes and plot throughput vs record size (needs matplotlib).")
def bench(preset: str, blocks: int, batch: int, storage_dir: str | None, fsync: str, daemon_args: tuple[str, ...],
          idle_seconds: float, quick: bool, as_json: bool, plot_path: str | None) -> None:
    """Measure the daemon against raw disk and memcpy baselines from the same run."""
    from .bench import plot_sweep, run_bench

    if quick:
        preset, blocks, batch, idle_seconds = "tiny", min(blocks, 64), min(batch, 16), 0.5
    say = (lambda s: click.echo(s, err=True))
    args = ("--fsync", fsync, *daemon_args)
    report = run_bench(preset, blocks, batch, storage_dir, args, idle_s=idle_seconds,
                       latency_samples=30 if quick else 300, say=say)
    out = report.as_dict()
    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.ClickException("--plot needs matplotlib: pip install 'kvswap[bench]'") from None
        sizes = [16, 32] if quick else [16, 32, 64, 128, 256]
        out["sweep"] = plot_sweep(plot_path, preset, sizes, report.record_bytes * report.blocks, storage_dir, args, say)
        say(f"plot written to {plot_path}")
    if as_json:
        click.echo(json.dumps(out, indent=2))
    else:
        click.echo(report.table())
    sys.exit(0)
