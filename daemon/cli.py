"""``kvswapd``: flags (each also read from ``KVSWAP_<FLAG>``) into a :class:`Config`, then
:func:`run`. Nothing else happens here.

A configuration kvswapd cannot use ends the process with exit code 2 and one log line on
stderr (JSON under ``--log-format json``) that names where the bad value came from: the flag,
the ``KVSWAP_*`` variable, or ``file.toml: key``.
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
from typing import Any, Sequence

import click

from kvswap import __version__

from .config import OTHER_ENV_VARS, Config, ConfigError, default_host_tier_bytes, default_storage_dir
# BYTES, the flags' size type, lives in config_file (which checks a file's sizes with it);
# tools and tests import it from here, with the flags.
from .config_file import BYTES, FILE_VALUES_KEY, ByteSize, load_config_option, print_config, value_source
from .logs import LOG_FORMATS, configure_logging

log = logging.getLogger("kvswap.daemon")


class HostTierSize(ByteSize):
    """A size, or ``auto``: the machine's default RAM tier (see ``default_host_tier_bytes``)."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value.strip().lower() == "auto":
            return default_host_tier_bytes()
        return super().convert(value, param, ctx)


_DEFAULTS = Config(storage_dir="")


def setup_logging(level: str, fmt: str = "text") -> None:
    configure_logging(level, fmt)


class DaemonCommand(click.Command):
    """kvswapd's command: click parses as usual, but a bad configuration is reported as one
    log line in the chosen log format, naming the value's source, instead of click's usage
    block."""

    # Not click's overloads on standalone_mode: this command always runs click with
    # standalone_mode=False and reports errors itself.
    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,  # type: ignore[override]
             **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        extra.pop("standalone_mode", None)
        try:
            code = super().main(argv, prog_name, standalone_mode=False, **extra)
        except click.ClickException as exc:
            report_config_error(exc, argv)
            sys.exit(exc.exit_code)
        except click.Abort:
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


def report_config_error(exc: click.ClickException, argv: Sequence[str]) -> None:
    """One line on stderr, in the log format asked for (JSON keeps the source as a field)."""
    ctx = getattr(exc, "ctx", None)
    message, source = _describe(exc, ctx, argv)
    configure_logging("error", _requested_log_format(argv, ctx))
    fields = {"exit_code": exc.exit_code, **({"source": source} if source else {})}
    log.error("bad configuration: %s", message, extra=fields)


def _describe(exc: click.ClickException, ctx: click.Context | None, argv: Sequence[str]) -> tuple[str, str]:
    """The message, and where the offending value came from ("" when click does not say)."""
    param = getattr(exc, "param", None)
    if isinstance(exc, click.BadParameter) and isinstance(param, click.Option) and ctx is not None:
        if param.name == "config":  # a config file problem: the message names the file and key
            where = exc.message.split(" = ", 1)[0] if " = " in exc.message else exc.message.split(":", 1)[0]
            return exc.message, where  # "file.toml: key", or the file alone
        # click records a value's source only once the value converts, so look for the flag.
        flags = [*param.opts, *param.secondary_opts]
        on_command_line = any(a == f or a.startswith(f + "=") for a in argv for f in flags)
        envvar = param.envvar if isinstance(param.envvar, str) else f"KVSWAP_{(param.name or '').upper()}"
        if not on_command_line and envvar in os.environ:
            return f"{envvar}={os.environ[envvar]}: {exc.message}", envvar
        return exc.format_message(), param.opts[-1]
    return exc.format_message(), ""


def _requested_log_format(argv: Sequence[str], ctx: click.Context | None) -> str:
    """The log format the operator asked for, read without relying on the parse that failed:
    the command line, then KVSWAP_LOG_FORMAT, then the config file."""
    for i, arg in enumerate(argv):
        if arg == "--log-format" and i + 1 < len(argv):
            return _known_format(argv[i + 1])
        if arg.startswith("--log-format="):
            return _known_format(arg.partition("=")[2])
    if "KVSWAP_LOG_FORMAT" in os.environ:
        return _known_format(os.environ["KVSWAP_LOG_FORMAT"])
    file_values = ctx.meta.get(FILE_VALUES_KEY, {}) if ctx is not None else {}
    return _known_format(str(file_values.get("log_format", "text")))


def _known_format(value: str) -> str:
    return value if value in LOG_FORMATS else "text"


def warn_unknown_env_vars(command: click.Command, environ: dict[str, str]) -> None:
    """A mistyped ``KVSWAP_*`` variable would otherwise leave a default in place in silence."""
    known = {f"KVSWAP_{p.name.upper()}" for p in command.params if p.name} | OTHER_ENV_VARS
    for name in sorted(n for n in environ if n.startswith("KVSWAP_") and n not in known):
        close = difflib.get_close_matches(name, sorted(known), n=1)
        log.warning("unknown environment variable %s ignored%s", name,
                    f" (did you mean {close[0]}?)" if close else "", extra={"variable": name})


def _config_error(ctx: click.Context, exc: ValueError, effective: dict[str, Any]) -> click.UsageError:
    """``Config.validate``'s reason, with the source of each setting it names."""
    settings = exc.settings if isinstance(exc, ConfigError) else ()
    sources = [f"{name} from {value_source(ctx, name, effective.get(name))}" for name in settings]
    return click.UsageError(str(exc) + (f" ({'; '.join(sources)})" if sources else ""), ctx=ctx)


@click.command(cls=DaemonCommand, context_settings={"auto_envvar_prefix": "KVSWAP", "show_default": True,
                                 "help_option_names": ["-h", "--help"]})
@click.option("--host", default=_DEFAULTS.host,
              help="Address to bind the control socket (and the metrics endpoint, unless --metrics-host) to.")
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
@click.option("--file-layout", type=click.Choice(["slab", "files"]), default=_DEFAULTS.file_layout,
              help="slab: records in slots of preallocated files with journals; files: one file per record.")
@click.option("--storage-rescan-interval-s", type=click.FloatRange(0), default=_DEFAULTS.storage_rescan_interval_s,
              help="How often the evicting daemon re-lists a shared directory (0 = only at start-up).")
@click.option("--maintenance-interval-s", type=click.FloatRange(0.01), default=_DEFAULTS.maintenance_interval_s,
              help="How often background eviction checks the watermarks.")
@click.option("--host-tier-bytes", type=HostTierSize(), default="auto",
              help="RAM for the host tier, tails of prefix chains out first; auto = 1/8 of physical memory, at most "
                   "4 GiB (0 = no host tier).")
@click.option("--remote-url", default=_DEFAULTS.remote_url, show_default=False,
              help="Remote tier: redis://HOST:PORT/DB, redis+cluster://HOST:PORT or "
                   "mooncake://MASTER:PORT?metadata=URL&protocol=tcp|rdma (empty = none).")
@click.option("--store-locations", default=_DEFAULTS.store_locations, show_default=False,
              help="Comma list of tiers swap_out writes to (host, file, remote). [default: every configured tier]")
@click.option("--retrieve-locations", default=_DEFAULTS.retrieve_locations, show_default=False,
              help="Comma list of tiers swap_in and lookup search, in order. [default: all, host, file, remote]")
@click.option("--promote-to-host/--no-promote-to-host", default=_DEFAULTS.promote_to_host,
              help="Copy records found in a lower tier into the host tier.")
@click.option("--remote-check-interval-s", type=click.FloatRange(0.1), default=_DEFAULTS.remote_check_interval_s,
              help="How often the remote tier's health is probed in the background.")
@click.option("--ready-when-degraded/--no-ready-when-degraded", default=_DEFAULTS.ready_when_degraded,
              help="Answer /readyz 200 even while a store or retrieve location (the remote tier) cannot serve.")
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
@click.option("--max-inflight-request-bytes", type=BYTES, default=_DEFAULTS.max_inflight_request_bytes,
              help="Bytes the decoded requests in flight may hold, all clients together (one client: its share of "
                   "it); beyond this the daemon answers busy.")
@click.option("--max-connections", type=click.IntRange(1), default=_DEFAULTS.max_connections,
              help="Connections the control socket keeps open at once; a handshake beyond this is refused.")
@click.option("--engine-check-interval-s", type=click.FloatRange(0.05), default=_DEFAULTS.engine_check_interval_s,
              help="How often to check that the registered engine process is alive.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default=_DEFAULTS.log_level,
              help="Least severe log lines written to stderr.")
@click.option("--log-format", type=click.Choice(LOG_FORMATS), default=_DEFAULTS.log_format,
              help="text: human-readable lines; json: one object per line (ts, level, logger, msg).")
@click.option("--metrics-host", default=_DEFAULTS.metrics_host, show_default=False,
              help="Address the metrics endpoint binds to. [default: as --host]")
@click.option("--kv-events-endpoint", default=_DEFAULTS.kv_events_endpoint, show_default=False,
              help="ZMQ PUB address to publish KV events on, in vLLM's format: what each tier stores and removes "
                   "(loopback or ipc:// only; empty = off).")
@click.option("--kv-events-replay-endpoint", default=_DEFAULTS.kv_events_replay_endpoint, show_default=False,
              help="ZMQ ROUTER address answering KV-event replay requests from the buffer (empty = no replay).")
@click.option("--kv-events-topic", default=_DEFAULTS.kv_events_topic, show_default=False,
              help="Topic frame of every KV-events message. [default: empty, as vLLM's]")
@click.option("--kv-events-buffer-bytes", type=BYTES, default=_DEFAULTS.kv_events_buffer_bytes,
              help="Bytes of past KV-event batches kept for replay.")
@click.option("--kv-events-encoding", type=click.Choice(["map", "array"]), default=_DEFAULTS.kv_events_encoding,
              help="map: tagged maps, as vLLM 0.32 decodes; array: the tagged arrays of earlier vLLM releases.")
@click.option("--peer-address", default=_DEFAULTS.peer_address, show_default=False,
              help="Prefill/decode transfer: the tcp:// endpoint other daemons reach this daemon on (empty = off).")
@click.option("--peer-transport", type=click.Choice(["auto", "mooncake", "inline"]), default=_DEFAULTS.peer_transport,
              help="How records move between daemons: Mooncake's transfer engine, inline in replies, or auto.")
@click.option("--peer-te-protocol", type=click.Choice(["tcp", "rdma"]), default=_DEFAULTS.peer_te_protocol,
              help="The transfer engine's protocol between daemons (peer transport mooncake).")
@click.option("--peer-export-bytes", type=BYTES, default=_DEFAULTS.peer_export_bytes,
              help="Memory for records in transit between daemons (each side: export buffer, receive buffer).")
@click.option("--peer-lease-s", type=click.FloatRange(0, 600, min_open=True), default=_DEFAULTS.peer_lease_s,
              help="How long exported records are held for a peer that does not release them.")
@click.option("--peer-server-key-file", default=_DEFAULTS.peer_server_key_file, show_default=False,
              help="CURVE between daemons: the peers' public key file. [default: this daemon's own public key]")
@click.option("--pd-role", type=click.Choice(["none", "prefill", "decode"]), default=_DEFAULTS.pd_role,
              help="Prefill/decode role, checked at start-up against the tiers and reported in hello.")
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
    ctx = click.get_current_context()
    try:
        config.validate()
    except ValueError as exc:
        raise _config_error(ctx, exc, config.as_dict()) from None
    if show_config:
        print_config(ctx, config.as_dict())
        sys.exit(0)
    setup_logging(config.log_level, config.log_format)
    warn_unknown_env_vars(ctx.command, dict(os.environ))
    from kvswap.backends.remote import RemoteConfigError

    try:
        code = run(config)
    except RemoteConfigError as exc:  # the remote tier's client package is missing
        raise click.UsageError(exc.problem, ctx=ctx) from None
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
