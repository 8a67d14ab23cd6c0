"""``kvswapd``: flags (each also read from ``KVSWAP_<FLAG>``) into a :class:`Config`, then
:func:`run`. Nothing else happens here."""

from __future__ import annotations

import re
import sys

import click

from kvswap import __version__

from .config import Config, default_host_tier_bytes, default_storage_dir
from .config_file import load_config_option, print_config
from .logs import LOG_FORMATS, configure_logging

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


class ByteSize(click.ParamType):
    """``268435456``, ``256M``, ``256MiB`` and ``256MB`` all mean 256 * 2**20 bytes."""

    name = "bytes"

    def convert(self, value, param, ctx):  # type: ignore[override]
        if isinstance(value, int):
            return value
        match = _SIZE_RE.match(str(value))
        if not match:
            self.fail(f"{value!r} is not a size such as 4096, 256M or 2GiB", param, ctx)
        unit = (match.group(2) or "").lower()[:1]
        return int(match.group(1)) * _UNITS[unit]


BYTES = ByteSize()


class HostTierSize(ByteSize):
    """A size, or ``auto``: the machine's default RAM tier (see ``default_host_tier_bytes``)."""

    def convert(self, value, param, ctx):  # type: ignore[override]
        if isinstance(value, str) and value.strip().lower() == "auto":
            return default_host_tier_bytes()
        return super().convert(value, param, ctx)
_DEFAULTS = Config(storage_dir="")


def setup_logging(level: str, fmt: str = "text") -> None:
    configure_logging(level, fmt)


@click.command(context_settings={"auto_envvar_prefix": "KVSWAP", "show_default": True,
                                 "help_option_names": ["-h", "--help"]})
@click.option("--host", default=_DEFAULTS.host, help="Address to bind the control socket and metrics endpoint to.")
@click.option("--curve-secret-key-file", default=_DEFAULTS.curve_secret_key_file, show_default=False,
              help="CURVE on the control socket: the daemon's secret key file (kvswap keygen). Needs --authorized-keys.")
@click.option("--authorized-keys", default=_DEFAULTS.authorized_keys, show_default=False,
              help="CURVE: directory of the public key files (*.key) of the clients allowed to connect.")
@click.option("--cache-queue-port", type=click.IntRange(0, 65535), default=_DEFAULTS.cache_queue_port,
              help="The engine's cache-queue port: the ZMQ socket engines send commands to (0 = any free port).")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=_DEFAULTS.metrics_port,
              help="HTTP port for /metrics, /healthz and /readyz (0 = any free port).")
@click.option("--storage-dir", default=None,
              help="Root directory of the file tier. [default: $FILE_BACKEND_STORAGE_DIR, else ./kvswap-store]")
@click.option("--fsync", type=click.Choice(["none", "data", "strict"]), default=_DEFAULTS.fsync,
              help="none: rely on checksums; data: fdatasync each record; strict: also fsync its directory.")
@click.option("--storage-max-bytes", type=BYTES, default=_DEFAULTS.storage_max_bytes,
              help="Cap on the file tier's bytes per namespace; least recently used records are evicted (0 = none).")
@click.option("--storage-min-free-bytes", type=BYTES, default=_DEFAULTS.storage_min_free_bytes,
              help="Evict to keep at least this much free space on the storage file system (0 = none).")
@click.option("--direct-io", type=click.Choice(["auto", "on", "off"]), default=_DEFAULTS.direct_io,
              help="O_DIRECT for record files: auto uses it where the file system supports it.")
@click.option("--storage-rescan-interval-s", type=click.FloatRange(0), default=_DEFAULTS.storage_rescan_interval_s,
              help="How often the evicting daemon re-lists a shared directory (0 = only at start-up).")
@click.option("--maintenance-interval-s", type=click.FloatRange(0.01), default=_DEFAULTS.maintenance_interval_s,
              help="How often background eviction checks the watermarks.")
@click.option("--host-tier-bytes", type=HostTierSize(), default="auto",
              help="RAM for the host tier, least recently used out; auto = 1/8 of physical memory, at most "
                   "4 GiB (0 = no host tier).")
@click.option("--remote-url", default=_DEFAULTS.remote_url, show_default=False,
              help="Remote tier: redis://HOST:PORT/DB, redis+cluster://HOST:PORT or "
                   "mooncake://MASTER:PORT?metadata=URL&protocol=tcp|rdma (empty = none).")
@click.option("--store-locations", default=_DEFAULTS.store_locations,
              help="Comma list of tiers swap_out writes to (host, file, remote). [default: every configured tier]")
@click.option("--retrieve-locations", default=_DEFAULTS.retrieve_locations,
              help="Comma list of tiers swap_in and lookup search, in order. [default: all, host, file, remote]")
@click.option("--promote-to-host/--no-promote-to-host", default=_DEFAULTS.promote_to_host,
              help="Copy records found in a lower tier into the host tier.")
@click.option("--remote-check-interval-s", type=click.FloatRange(0.1), default=_DEFAULTS.remote_check_interval_s,
              help="How often the remote tier's health is probed in the background.")
@click.option("--write-threads", type=click.IntRange(1, 256), default=_DEFAULTS.write_threads,
              help="Threads writing records.")
@click.option("--read-threads", type=click.IntRange(1, 256), default=_DEFAULTS.read_threads,
              help="Threads reading records.")
@click.option("--data-thread-nice", type=click.IntRange(0, 19), default=_DEFAULTS.data_thread_nice,
              help="Nice value added to the I/O and upkeep threads (half of it to the copy thread), so the control loop runs first (0: none).")
@click.option("--write-staging-bytes", type=BYTES, default=_DEFAULTS.write_staging_bytes,
              help="Staging memory for copied blocks awaiting their write; full means swap_out answers busy.")
@click.option("--read-staging-bytes", type=BYTES, default=_DEFAULTS.read_staging_bytes,
              help="Staging memory for swap_in.")
@click.option("--default-timeout-ms", type=click.IntRange(1), default=_DEFAULTS.default_timeout_ms,
              help="Deadline of a request that carries none.")
@click.option("--drain-timeout-s", type=click.FloatRange(0), default=_DEFAULTS.drain_timeout_s,
              help="On SIGTERM, how long in-flight requests and writes may take to finish.")
@click.option("--max-inflight-requests", type=click.IntRange(1), default=_DEFAULTS.max_inflight_requests,
              help="Requests handled at once; beyond this the daemon answers busy.")
@click.option("--max-inflight-per-client", type=click.IntRange(1), default=_DEFAULTS.max_inflight_per_client,
              help="Requests one client connection may have in flight; beyond this it is answered busy.")
@click.option("--engine-check-interval-s", type=click.FloatRange(0.05), default=_DEFAULTS.engine_check_interval_s,
              help="How often to check that the registered engine process is alive.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default=_DEFAULTS.log_level)
@click.option("--log-format", type=click.Choice(LOG_FORMATS), default=_DEFAULTS.log_format,
              help="text: human-readable lines; json: one object per line (ts, level, logger, msg).")
@click.option("--config", type=click.Path(dir_okay=False), default=None, is_eager=True, callback=load_config_option,
              help="TOML file of settings named like the flags; flags and KVSWAP_* variables override it.")
@click.option("--print-config", is_flag=True, default=False,
              help="Print the effective configuration and where each value came from, then exit.")
@click.version_option(__version__, prog_name="kvswapd")
def main(**options: object) -> None:
    """kvswapd: swaps an inference engine's paged KV-cache blocks to storage and back.

    Every flag can also be set as an environment variable KVSWAP_<FLAG>, e.g.
    KVSWAP_CACHE_QUEUE_PORT=55500.
    """
    from .server import run  # imported late so --help stays fast

    options.pop("config", None)  # already applied: its values are click's default_map
    show_config = options.pop("print_config", False)
    options["storage_dir"] = options["storage_dir"] or default_storage_dir()
    config = Config(**options)  # type: ignore[arg-type]
    setup_logging(config.log_level, config.log_format)
    try:
        config.validate()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if show_config:
        print_config(click.get_current_context(), config.as_dict())
        sys.exit(0)
    sys.exit(run(config))


if __name__ == "__main__":  # pragma: no cover
    main()
