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
              help="The daemon's --fsync; the raw write baseline syncs the same way.")
@click.option("--daemon-arg", "daemon_args", multiple=True, help="Extra kvswapd flag (repeatable).")
@click.option("--idle-seconds", type=click.FloatRange(0.1), default=5.0, show_default=True,
              help="How long to sample the idle daemon's CPU use.")
@click.option("--latency-samples", type=click.IntRange(1), default=300, show_default=True,
              help="ping and lookup requests timed under load (100+ for a meaningful p99).")
@click.option("--drop-caches", is_flag=True,
              help="Where O_DIRECT is unavailable, measure cold reads by writing /proc/sys/vm/drop_caches "
                   "(root only): this drops the page cache of the WHOLE machine.")
@click.option("--quick", is_flag=True, help="A seconds-long smoke run (tiny layout, few blocks, a 1 MiB RAM tier).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--plot", "plot_path", default=None, metavar="FILE.png",
              help="Also sweep block sizes and plot throughput vs record size (needs matplotlib).")
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True,
              help="Runs per block size in the --plot sweep (error bars span them).")
@click.option("--rounds", type=click.IntRange(1), default=4, show_default=True,
              help="Rounds in which the disk rows (swap_out persisted, copied until written, swap_in cold) "
                   "take turns with their raw baselines, so the disk's drift falls on both.")
def bench(preset: str, blocks: int, batch: int, storage_dir: str | None, fsync: str, daemon_args: tuple[str, ...],
          idle_seconds: float, latency_samples: int, drop_caches: bool, quick: bool, as_json: bool,
          plot_path: str | None, repeats: int, rounds: int) -> None:
    """Measure the daemon against raw disk and memcpy baselines from the same run."""
    from .bench import plot_sweep, run_bench

    if plot_path:  # before the minutes of measuring, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.ClickException("--plot needs matplotlib: pip install 'kvswap[bench]'") from None
    if quick:
        preset, blocks, batch, idle_seconds = "tiny", min(blocks, 64), min(batch, 16), 0.5
        latency_samples = min(latency_samples, 30)
        rounds = min(rounds, 2)
    say = (lambda s: click.echo(s, err=True))
    if drop_caches:
        say("--drop-caches: where cold reads need it, the page cache of the whole machine is dropped")
    args = ("--fsync", fsync, *daemon_args)
    if quick:  # a RAM tier the run can fill in a second (the bench fills it once first)
        args = ("--host-tier-bytes", "1MiB", *args)
    report = run_bench(preset, blocks, batch, storage_dir, args, idle_s=idle_seconds,
                       latency_samples=latency_samples, say=say, drop_caches=drop_caches, rounds=rounds)
    out = report.as_dict()
    if plot_path:
        sizes = [16, 32] if quick else [16, 32, 64, 128, 256]
        out["sweep"] = plot_sweep(plot_path, preset, sizes, report.record_bytes * report.blocks, storage_dir, args,
                                  say, repeats=1 if quick else repeats, drop_caches=drop_caches)
        say(f"plot written to {plot_path}")
    if as_json:
        click.echo(json.dumps(out, indent=2))
        for warning in report.warnings:
            say(f"warning: {warning}")
    else:
        click.echo(report.table())  # the table ends with the warnings
    sys.exit(0)
