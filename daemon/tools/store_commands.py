"""``kvswap inspect | verify | gc DIR``: offline views and repairs of a storage directory,
with progress bars (they walk every file of the directory).

Exit codes: 0 nothing wrong was found; 1 problems were found (listed in the output); 2 the
command line was wrong.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Callable, TypeVar

import click

from kvswap.backends import file_tools
from kvswap.common.units import PAGE_BYTES

from ..cli import BYTES
from ..config import Config

T = TypeVar("T")

#: Lines of each kind of finding printed in text mode (--json has them all).
SHOWN = 50


def daemon_max_record_bytes(config: Config | None = None) -> int:
    """The largest record payload a daemon with ``config`` accepts: registration refuses a
    layout whose page-rounded staging slot does not fit the smaller staging pool."""
    config = config or Config()
    return min(config.write_staging_bytes, config.read_staging_bytes) // PAGE_BYTES * PAGE_BYTES


def _with_progress(root: str, label: str, work: Callable[[Callable[[int], None]], T], quiet: bool,
                   steps_per_file: int = 1) -> T:
    if quiet:
        return work(lambda n: None)
    click.echo(f"counting files under {root} ...", err=True)
    total = file_tools.count_files(root) * steps_per_file
    with click.progressbar(length=total, label=label, file=sys.stderr, show_pos=True) as bar:
        return work(bar.update)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _list(kind: str, items: list[tuple[str, str]]) -> None:
    for path, reason in items[:SHOWN]:
        click.echo(f"  {kind}  {path}: {reason}")
    if len(items) > SHOWN:
        click.echo(f"  ... and {len(items) - SHOWN:,} more {kind}")


@click.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def inspect(directory: str, as_json: bool) -> None:
    """Namespaces in DIRECTORY: records, bytes, temp files and an age histogram."""
    summaries = _with_progress(directory, "inspecting", lambda p: file_tools.inspect(directory, p), as_json)
    if as_json:
        click.echo(json.dumps([asdict(s) for s in summaries], indent=2))
        return
    if not summaries:
        click.echo(f"no namespaces under {directory}")
    for s in summaries:
        layout = s.description.get("layout", {})
        layout = layout if isinstance(layout, dict) else {}
        click.echo(f"\nnamespace {s.namespace}")
        click.echo(f"  model      {layout.get('model_id', '?')}  dtype {layout.get('dtype', '?')}  "
                   f"tp {layout.get('tp_rank', '?')}/{layout.get('tp_size', '?')}  "
                   f"block {layout.get('block_size', '?')} tokens  record {s.description.get('record_bytes', '?')} B")
        click.echo(f"  records    {s.records:,}  ({_mib(s.bytes)})   temp files {s.temp_files}"
                   + (f"   misplaced {s.misplaced:,}, unknown {s.unknown:,} (kvswap verify lists them)"
                      if s.misplaced or s.unknown else ""))
        click.echo("  last used  " + "  ".join(f"{name} {count:,}" for name, count in s.ages.items()))


@click.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--remove", is_flag=True,
              help="Delete records that fail their checks and misplaced record files (unknown files are kept).")
@click.option("--max-record-bytes", type=BYTES, default=daemon_max_record_bytes(),
              help="Largest record payload to read: what a daemon with the default staging accepts. Where your "
                   "daemons run with more --read-staging-bytes and --write-staging-bytes, give the smaller.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def verify(directory: str, remove: bool, max_record_bytes: int, as_json: bool) -> None:
    """Check every record's size, header and checksum, and report every file that is not a
    record at its place (misplaced record files, unknown files).

    Exit code 0 when every file checked is good and nothing else was found; 1 when bad,
    misplaced, unknown or unchecked files or a broken namespace.json were found, or a
    removal failed.
    """
    if max_record_bytes < 1:
        raise click.UsageError("--max-record-bytes must be at least 1")
    report = _with_progress(directory, "verifying",
                            lambda p: file_tools.verify(directory, remove, p, max_record_bytes), as_json)
    if as_json:
        click.echo(json.dumps(asdict(report), indent=2))
    else:
        click.echo(f"checked {report.checked:,} records: {report.good:,} good, {len(report.bad):,} bad; "
                   f"{len(report.misplaced):,} misplaced, {len(report.unknown):,} unknown"
                   + (f"; {report.unchecked:,} not checked" if report.unchecked else "")
                   + (f"; {report.removed:,} removed" if remove else ""))
        _list("namespace.json", report.namespace_problems)
        _list("bad", report.bad)
        _list("misplaced", report.misplaced)
        _list("unknown", report.unknown)
        _list("not removed", report.removal_failures)
    sys.exit(1 if report.problems else 0)


@click.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--max-bytes", type=BYTES, required=True, help="Evict least recently used records down to this.")
@click.option("--all", "remove_all", is_flag=True, help="Confirm that --max-bytes 0 means: remove every record.")
@click.option("--dry-run", is_flag=True, help="Delete nothing; report what would be removed.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def gc(directory: str, max_bytes: int, remove_all: bool, dry_run: bool, as_json: bool) -> None:
    """Offline eviction: delete least recently used records until DIRECTORY holds MAX_BYTES.

    Every file counts towards MAX_BYTES, but only records at their places are removed:
    misplaced and unknown files (see kvswap verify) and temp files are left and reported.
    Exit code 0 when DIRECTORY now holds at most MAX_BYTES and nothing was left out; 1 when
    a namespace was skipped (a running daemon holds its eviction lock), a record could not
    be removed, or gc left files it does not remove.
    """
    if max_bytes == 0 and not remove_all:
        raise click.UsageError("--max-bytes 0 removes every record; add --all to mean it")
    report = _with_progress(directory, "collecting",
                            lambda p: file_tools.gc(directory, max_bytes, p, dry_run=dry_run), as_json,
                            steps_per_file=2)
    if as_json:
        click.echo(json.dumps({**asdict(report), "dry_run": dry_run, "over_budget": report.over_budget}, indent=2))
    else:
        verb = "would remove" if dry_run else "removed"
        click.echo(f"{_mib(report.before_bytes)} -> {_mib(report.after_bytes)}: {verb} {report.removed:,} records "
                   f"({_mib(report.removed_bytes)})" + (" (dry run: nothing was deleted)" if dry_run else ""))
        for ns in report.skipped_namespaces:
            click.echo(f"  skipped namespace {ns}: a running daemon holds its eviction lock")
        if report.failures:
            click.echo(f"  {report.failures} records could not be removed")
        for path, size, what in report.skipped_files[:SHOWN]:
            hint = " (kvswap verify --remove removes it)" if what.startswith(("misplaced", "not a regular")) else ""
            click.echo(f"  left  {path}: {_mib(size)}, {what}{hint}")
        if len(report.skipped_files) > SHOWN:
            click.echo(f"  ... and {len(report.skipped_files) - SHOWN:,} more files left")
        if report.temp_files:
            click.echo(f"  {report.temp_files:,} temp files ({_mib(report.temp_bytes)}): writes in progress, or "
                       "leftovers a daemon reclaims")
        if report.over_budget:
            click.echo(f"the directory {'would still hold' if dry_run else 'still holds'} {_mib(report.after_bytes)}, "
                       f"over --max-bytes {_mib(max_bytes)}")
    sys.exit(1 if report.problems else 0)
