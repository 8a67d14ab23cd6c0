"""``kvswap status [ENDPOINT]``: a running daemon at a glance.

Asks the daemon for ``stats`` twice, ``--interval`` seconds apart, and shows its registration,
tiers, staging, work in flight and what changed in between (records and bytes stored per
second). It also reads ``/metrics`` at both samples, at the address ``stats`` names (or
``--metrics-url``), and adds request, error, byte, block and lookup-hit rates; when the
metrics cannot be read the report is printed without them and says why. ``--json`` prints
the same report as one JSON object.
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
from typing import Any, Callable, Final

import click

#: A sample of /metrics: (series name, sorted label pairs) -> value.
Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]

_LINE_RE: Final = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL_RE: Final = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_exposition(text: str) -> Series:
    """The samples of a Prometheus text exposition.

    >>> parse_exposition('# TYPE x counter\\nx_total{op="in",code="a"} 3.0\\nup 1\\n')
    {('x_total', (('code', 'a'), ('op', 'in'))): 3.0, ('up', ()): 1.0}
    """
    out: Series = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _LINE_RE.match(line)
        if not match:
            continue
        name, labels, value = match.groups()
        pairs = tuple(sorted(_LABEL_RE.findall(labels or "")))
        try:
            out[(name, pairs)] = float(value)
        except ValueError:
            continue
    return out


def normalize_endpoint(value: str) -> str:
    """``55501`` -> ``tcp://127.0.0.1:55501``; ``host:port`` -> ``tcp://host:port``; a ZMQ
    endpoint (``tcp://``, ``ipc://``) is kept as it is."""
    if "://" in value:
        return value
    if value.isdigit():
        return f"tcp://127.0.0.1:{value}"
    return f"tcp://{value}"


def normalize_metrics_url(value: str) -> str:
    """``55601`` -> ``http://127.0.0.1:55601/metrics``; ``HOST:PORT`` (``[::1]:55601`` for
    IPv6) -> ``http://HOST:PORT/metrics``; a URL without a path gets ``/metrics``.

    >>> [normalize_metrics_url(v) for v in ("55601", "[::1]:55601", "http://gpu0:55601")]
    ['http://127.0.0.1:55601/metrics', 'http://[::1]:55601/metrics', 'http://gpu0:55601/metrics']
    """
    if value.isdigit():
        return f"http://127.0.0.1:{value}/metrics"
    if "://" not in value:
        value = f"http://{value}"
    scheme, _, rest = value.partition("://")
    return value if "/" in rest else f"{scheme}://{rest}/metrics"


def metrics_url_from_stats(endpoint: str, stats: dict[str, Any]) -> str | None:
    """Where the daemon serves /metrics, from its ``stats``: its metrics port, on the host the
    control endpoint names unless the daemon binds metrics to one address of its own.

    >>> metrics_url_from_stats("tcp://gpu0:55500", {"metrics_port": 55600, "metrics_host": "0.0.0.0"})
    'http://gpu0:55600/metrics'
    >>> metrics_url_from_stats("tcp://127.0.0.1:55500", {"metrics_port": 55600, "metrics_host": "::1"})
    'http://[::1]:55600/metrics'
    """
    port = stats.get("metrics_port")
    if not isinstance(port, int) or port <= 0:
        return None
    bound = stats.get("metrics_host") or ""
    host = endpoint.partition("://")[2].rpartition(":")[0] if endpoint.startswith("tcp://") else ""
    if bound not in ("", "0.0.0.0", "::") or not host or host == "*":
        host = bound if bound not in ("", "0.0.0.0", "::") else "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}/metrics"


def diagnose_handshake(endpoint: str, timeout_s: float) -> str:
    """Why a plain (no CURVE) connection to ``endpoint`` gets no answer: ``"curve"`` when the
    daemon refused the handshake because it demands CURVE, ``"refused"`` when nothing accepted
    the TCP connection, ``""`` otherwise. Watches the socket's monitor events; sends nothing."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if "://[" in endpoint:
        sock.setsockopt(zmq.IPV6, 1)
    monitor = sock.get_monitor_socket()
    connected = False
    try:
        sock.connect(endpoint)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not monitor.poll(int(left * 1000) + 1):
                break
            event = recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_CONNECTED:
                connected = True
            elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and \
                    event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                return "curve"
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return ""
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
    return "" if connected else "refused"


def read_metrics(url: str, timeout: float) -> Series:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return parse_exposition(resp.read().decode("utf-8", "replace"))


def _sum_by(series: Series, name: str, label: str, where: dict[str, str] | None = None) -> dict[str, float]:
    """Sum of one metric's samples grouped by one label, optionally filtered on others."""
    out: dict[str, float] = {}
    for (n, pairs), value in series.items():
        if n != name:
            continue
        labels = dict(pairs)
        if where and any(labels.get(k) != v for k, v in where.items()):
            continue
        key = labels.get(label, "")
        out[key] = out.get(key, 0.0) + value
    return out


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per-key increase; a key that disappeared or shrank (a restart) counts from zero."""
    out = {}
    for key, value in after.items():
        prev = before.get(key, 0.0)
        out[key] = value - prev if value >= prev else value
    return out


def _metric_deltas(first: Series, second: Series) -> dict[str, dict[str, float]]:
    pick: dict[str, Callable[[Series], dict[str, float]]] = {
        "requests": lambda s: _sum_by(s, "kvswap_requests_total", "op"),
        "errors": lambda s: _sum_by(s, "kvswap_errors_total", "code"),
        "bytes": lambda s: _sum_by(s, "kvswap_bytes_total", "direction"),
        "swap_out_blocks": lambda s: _sum_by(s, "kvswap_blocks_total", "status", {"op": "swap_out"}),
        "swap_in_blocks": lambda s: _sum_by(s, "kvswap_blocks_total", "status", {"op": "swap_in"}),
        "lookup_keys": lambda s: _sum_by(s, "kvswap_lookup_keys_total", "result"),
        "evictions": lambda s: _sum_by(s, "kvswap_evictions_total", "reason"),
        "corrupt_records": lambda s: _sum_by(s, "kvswap_corrupt_records_total", "tier"),
    }
    return {name: _delta(f(first), f(second)) for name, f in pick.items()}


def _tier_counts(stats: dict[str, Any], field: str) -> dict[str, float]:
    return {tier: float(u.get(field, 0)) for tier, u in (stats.get("tiers") or {}).items()}


def collect(client: Any, interval_s: float, metrics_url: str | None = None, timeout_s: float = 5.0,
            pause: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """The status report: the second ``stats`` sample, plus what changed since the first.

    ``pause`` is what happens between the samples (``time.sleep``); a test passes a function
    that does known work instead, and checks the deltas count exactly that work.
    """
    first = client.stats()
    if metrics_url is None:
        metrics_url = metrics_url_from_stats(client.endpoint, first)
    metrics_error: list[str] = []

    def sample_metrics() -> Series | None:
        """One /metrics sample; None (and the reason kept) when it cannot be read, since the
        stats part of the report stands on its own."""
        if not metrics_url or metrics_error:
            return None
        try:
            return read_metrics(metrics_url, timeout_s)
        except (OSError, ValueError) as exc:
            metrics_error.append(f"{getattr(exc, 'reason', None) or exc}")
            return None

    first_metrics = sample_metrics() if interval_s > 0 else None
    started = time.monotonic()
    if interval_s > 0:
        pause(interval_s)
        second = client.stats()
    else:
        first, second = None, first
    elapsed = time.monotonic() - started
    second_metrics = sample_metrics()

    report: dict[str, Any] = {
        "endpoint": client.endpoint,
        "metrics_url": metrics_url,
        "metrics_error": metrics_error[0] if metrics_error else None,
        "version": second.get("version"),
        "uptime_s": second.get("uptime_s"),
        "storage_dir": second.get("storage_dir"),
        "fsync": second.get("fsync"),
        "registered": bool(second.get("registered")),
        "registration": _registration(second.get("registration")),
        "tiers": second.get("tiers") or {},
        "staging": {pool: second[f"{pool}_staging"] for pool in ("write", "read") if f"{pool}_staging" in second},
        "requests_in_flight": second.get("requests_in_flight"),
        "pending_writes": second.get("pending_writes"),
        "write_tasks": second.get("write_tasks"),
        "rates": None,
    }
    if first is not None:
        deltas: dict[str, dict[str, float]] = {}
        # Stored counts are levels, not counters: a shrinking store (eviction, delete) is a
        # negative rate here.
        for field, key in (("records", "stored_records"), ("bytes", "stored_bytes")):
            before, after = _tier_counts(first, field), _tier_counts(second, field)
            deltas[key] = {tier: after[tier] - before.get(tier, 0.0) for tier in after}
        if first_metrics is not None and second_metrics is not None:
            deltas.update(_metric_deltas(first_metrics, second_metrics))
        report["rates"] = {
            "interval_s": elapsed,
            "source": "stats+metrics" if second_metrics is not None else "stats",
            "deltas": deltas,
            "per_s": {k: {kk: vv / elapsed for kk, vv in v.items()} for k, v in deltas.items()} if elapsed > 0 else {},
        }
        lookups = deltas.get("lookup_keys")
        if lookups is not None:
            asked = lookups.get("hit", 0.0) + lookups.get("miss", 0.0)
            report["rates"]["lookup_hit_ratio"] = lookups.get("hit", 0.0) / asked if asked else None
    if second_metrics is not None:
        report["metrics"] = {
            "store_free_bytes": _sum_by(second_metrics, "kvswap_store_free_bytes", "tier"),
            "store_capacity_bytes": _sum_by(second_metrics, "kvswap_store_capacity_bytes", "tier"),
        }
    return report


def _registration(reg: dict[str, Any] | None) -> dict[str, Any] | None:
    if not reg:
        return None
    layout = reg.get("layout") or {}
    return {
        "namespace": reg.get("namespace"),
        "model": layout.get("model_id"),
        "pid": reg.get("pid"),
        "blocks": layout.get("num_blocks"),
        "block_size": layout.get("block_size"),
        "record_bytes": reg.get("record_bytes"),
        "regions": reg.get("regions"),
        "layers": layout.get("num_layers"),
        "dtype": layout.get("dtype"),
        "tp_rank": layout.get("tp_rank"),
        "tp_size": layout.get("tp_size"),
    }


# -- the table ---------------------------------------------------------------------------------------


def human_bytes(n: float | None) -> str:
    """``3072`` -> ``3.0 KiB``; ``None`` -> ``-``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} PiB"  # pragma: no cover


def human_duration(seconds: float | None) -> str:
    """``3723.4`` -> ``1h 02m 03s``."""
    if seconds is None:
        return "-"
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d {h:02d}h {m:02d}m"
    if h:
        return f"{h}h {m:02d}m {s:02d}s"
    return f"{m}m {s:02d}s" if m else f"{s}s"


def _rate_list(values: dict[str, float], fmt: Callable[[float], str] = lambda v: f"{v:.1f}") -> str:
    shown = [f"{k or '-'} {fmt(v)}" for k, v in sorted(values.items()) if v]
    return ", ".join(shown) if shown else "0"


def render_table(report: dict[str, Any]) -> str:
    uptime = human_duration(report.get("uptime_s"))
    lines = [f"kvswapd {report.get('version') or '?'}  {report['endpoint']}  up {uptime}",
             f"storage       {report.get('storage_dir')}  (fsync {report.get('fsync')})", ""]
    reg = report.get("registration")
    if reg:
        lines += [
            "Registration",
            f"  namespace   {reg['namespace']}",
            f"  model       {reg['model']}  (tp {reg['tp_rank']}/{reg['tp_size']}, {reg['dtype']}, "
            f"{reg['layers']} layers)",
            f"  engine pid  {reg['pid']}",
            f"  blocks      {reg['blocks']} x {reg['block_size']} tokens, record {human_bytes(reg['record_bytes'])} "
            f"({reg['record_bytes']} B, {reg['regions']} regions)",
        ]
    else:
        lines.append("Registration  none (no engine has registered)")
    lines.append("")

    tiers = report.get("tiers") or {}
    free = (report.get("metrics") or {}).get("store_free_bytes", {})
    lines.append(f"{'Tiers':<10}{'records':>10}{'bytes':>14}{'cap':>14}{'fs free':>14}")
    for tier, usage in sorted(tiers.items()):
        cap = usage.get("max_bytes")
        lines.append(f"  {tier:<8}{usage.get('records', 0):>10}{human_bytes(usage.get('bytes')):>14}"
                     f"{(human_bytes(cap) if cap else 'none'):>14}{human_bytes(free.get(tier)):>14}")
    if not tiers:
        lines.append("  (none until an engine registers)")
    lines.append("")

    staging = report.get("staging") or {}
    if staging:
        lines.append(f"{'Staging':<10}{'slots':>10}{'free':>10}{'used':>10}{'slot':>12}")
        for pool, s in staging.items():
            slots, free_slots = s.get("slots", 0), s.get("free", 0)
            slot = human_bytes(s.get("slot_bytes"))
            lines.append(f"  {pool:<8}{slots:>10}{free_slots:>10}{slots - free_slots:>10}{slot:>12}")
        lines.append("")

    in_flight = report.get("requests_in_flight")
    others = max(0, in_flight - 1) if isinstance(in_flight, int) else "?"  # one of them is this status call
    lines.append(f"In flight     {others} requests, {report.get('pending_writes')} records waiting to be written, "
                 f"{report.get('write_tasks')} write tasks")

    rates = report.get("rates")
    if rates:
        per_s = rates["per_s"]
        lines += ["", f"Rates over {rates['interval_s']:.1f} s"]
        for tier, records in sorted(per_s.get("stored_records", {}).items()):
            growth = per_s.get("stored_bytes", {}).get(tier, 0.0)
            lines.append(f"  stored        {tier} {records:+.1f} records/s, {'+' if growth >= 0 else '-'}"
                         f"{human_bytes(abs(growth))}/s")
        if "requests" in per_s:
            lines.append(f"  requests/s    {_rate_list(per_s['requests'])}")
            lines.append(f"  errors/s      {_rate_list(per_s['errors'])}")
            lines.append(f"  bytes         {_rate_list(per_s['bytes'], lambda v: human_bytes(v) + '/s')}")
            lines.append(f"  swap_out      {_rate_list(per_s['swap_out_blocks'])} blocks/s")
            lines.append(f"  swap_in       {_rate_list(per_s['swap_in_blocks'])} blocks/s")
            ratio = rates.get("lookup_hit_ratio")
            lines.append(f"  lookup hits   {'-' if ratio is None else f'{ratio:.1%}'} of "
                         f"{sum(rates['deltas']['lookup_keys'].values()):.0f} keys asked")
            if any(per_s.get("evictions", {}).values()):
                lines.append(f"  evictions/s   {_rate_list(per_s['evictions'])}")
        else:
            lines.append("  (request, byte and hit rates need /metrics: see below, or pass --metrics-url HOST:PORT)")
    if report.get("metrics_error"):
        lines += ["", f"Metrics       {report['metrics_url']}: {report['metrics_error']} (rates from stats only)"]
    return "\n".join(lines) + "\n"


@click.command("status", context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.argument("endpoint", default="tcp://127.0.0.1:55500")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@click.option("--interval", "interval_s", type=click.FloatRange(0), default=1.0,
              help="Seconds between the two samples the rates come from (0: one sample, no rates).")
@click.option("--metrics-url", default=None,
              help="The daemon's /metrics for request, byte and hit rates: a URL, HOST:PORT or PORT. "
                   "[default: the metrics port the daemon reports]")
@click.option("--timeout", "timeout_s", type=click.FloatRange(0.1), default=5.0, help="Seconds to wait for an answer.")
@click.option("--curve-server-key-file", default=None, help="The daemon's public key certificate, when CURVE is on.")
@click.option("--curve-secret-key-file", default=None, help="This client's secret key certificate, when CURVE is on.")
def status(endpoint: str, as_json: bool, interval_s: float, metrics_url: str | None, timeout_s: float,
           curve_server_key_file: str | None, curve_secret_key_file: str | None) -> None:
    """Show a running kvswapd: registration, tiers, staging, work in flight, recent rates.

    ENDPOINT is the daemon's cache-queue socket: tcp://HOST:PORT, HOST:PORT or just PORT.
    """
    from kvswap.protocol import Client, KvswapError

    target = normalize_endpoint(endpoint)
    try:
        with Client(target, timeout=timeout_s, curve_server_key_file=curve_server_key_file or None,
                    curve_secret_key_file=curve_secret_key_file or None) as client:
            report = collect(client, interval_s, normalize_metrics_url(metrics_url) if metrics_url else None,
                             timeout_s)
    except KvswapError as exc:
        hint = ""
        if exc.code in ("timeout", "unavailable") and not (curve_server_key_file or curve_secret_key_file):
            hint = {"curve": "; the daemon demands CURVE: pass --curve-server-key-file (its .key) and "
                             "--curve-secret-key-file (this client's .key_secret)",
                    "refused": "; nothing accepts connections there (is kvswapd running, on this port?)",
                    }.get(diagnose_handshake(target, min(timeout_s, 2.0)), "")
        click.echo(f"kvswap status: {target}: {exc.code}: {exc.message}{hint}", err=True)
        sys.exit(1)
    except ValueError as exc:  # bad CURVE key files
        raise click.UsageError(str(exc)) from None
    if report.get("metrics_error"):
        click.echo(f"kvswap status: {report['metrics_url']}: {report['metrics_error']}; "
                   "the report below has no request rates", err=True)
    if as_json:
        click.echo(json.dumps(report, indent=2, sort_keys=True))
    else:
        click.echo(render_table(report), nl=False)
