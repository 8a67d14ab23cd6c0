"""``kvswap inspect | verify | gc DIR``: offline views and repairs of a storage directory,
with progress bars (they walk every record file)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Callable, TypeVar

import click

from kvswap.backends import file_tools

from ..cli import BYTES

T = TypeVar("T")


def _with_progress(root: str, label: str, work: Callable[[Callable[[int], None]], T], quiet: bool) -> T:
    if quiet:
        return work(lambda n: None)
    total = file_tools.count_records(root)
    with click.progressbar(length=total, label=label, file=sys.stderr, show_pos=True) as bar:
        return work(bar.update)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


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
        click.echo(f"\nnamespace {s.namespace}")
        click.echo(f"  model      {layout.get('model_id', '?')}  dtype {layout.get('dtype', '?')}  "
                   f"tp {layout.get('tp_rank', '?')}/{layout.get('tp_size', '?')}  "
                   f"block {layout.get('block_size', '?')} tokens  record {s.description.get('record_bytes', '?')} B")
        click.echo(f"  records    {s.records:,}  ({_mib(s.bytes)})   temp files {s.temp_files}")
        click.echo("  last used  " + "  ".join(f"{name} {count:,}" for name, count in s.ages.items()))


@click.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--remove", is_flag=True, help="Delete records that fail their checks.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def verify(directory: str, remove: bool, as_json: bool) -> None:
    """Check every record's header and checksum. Exit code 1 when bad records were found."""
    report = _with_progress(directory, "verifying", lambda p: file_tools.verify(directory, remove, p), as_json)
    if as_json:
        click.echo(json.dumps(asdict(report), indent=2))
    else:
        click.echo(f"checked {report.checked:,} records: {report.good:,} good, {len(report.bad):,} bad"
                   + (f", {report.removed:,} removed" if remove else ""))
        for path, reason in report.bad[:50]:
            click.echo(f"  bad  {path}: {reason}")
        if len(report.bad) > 50:
            click.echo(f"  ... and {len(report.bad) - 50:,} more")
    sys.exit(1 if report.bad else 0)


@click.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--max-bytes", type=BYTES, required=True, help="Evict least recently used records down to this.")
@click.option("--all", "remove_all", is_flag=True, help="Confirm that --max-bytes 0 means: remove every record.")
@click.option("--dry-run", is_flag=True, help="Delete nothing; report what would be removed.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def gc(directory: str, max_bytes: int, remove_all: bool, dry_run: bool, as_json: bool) -> None:
    """Offline eviction: delete least recently used records until DIRECTORY holds MAX_BYTES.

    Exit code 1 when a namespace was skipped (a running daemon holds its eviction lock) or a
    record could not be removed: the directory may still hold more than MAX_BYTES.
    """
    if max_bytes == 0 and not remove_all:
        raise click.UsageError("--max-bytes 0 removes every record; add --all to mean it")
    report = _with_progress(directory, "collecting",
                            lambda p: file_tools.gc(directory, max_bytes, p, dry_run=dry_run), as_json)
    if as_json:
        click.echo(json.dumps({**asdict(report), "dry_run": dry_run}, indent=2))
    else:
        verb = "would remove" if dry_run else "removed"
        click.echo(f"{_mib(report.before_bytes)} -> {_mib(report.after_bytes)}: {verb} {report.removed:,} records"
                   + (" (dry run: nothing was deleted)" if dry_run else ""))
        for ns in report.skipped_namespaces:
            click.echo(f"  skipped namespace {ns}: a running daemon holds its eviction lock")
        if report.failures:
            click.echo(f"  {report.failures} records could not be removed")
    sys.exit(1 if report.skipped_namespaces or report.failures else 0)
