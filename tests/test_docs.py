"""The reference docs agree with the code: every flag, op, field, error code, limit, metric
and worked example in ``docs/`` is checked against the objects it describes.

Conventions the docs follow so these tests can read them:

- configuration.md: one table row per flag, ``| `--flag` | `KVSWAP_FLAG` | `default` ... |``;
- protocol.md: ``### `op` `` sections with request-field rows ``| `field` | type | required |``
  or ``| `field` | type | default `<json>` |``; error rows ``| `code` | yes/no | ... |``; limit
  rows ``| `CONSTANT` | value | ... |``; record-header rows ``| offset | size | `field` | ... |``;
  worked examples as fenced blocks of ``hex:`` lines (one frame) and one ``msg:`` line (JSON);
- operations.md: metric rows ``| `exposed_name` | type | `label`, ... | ... |``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import re
import struct
from pathlib import Path

import click
import msgpack
import pytest
from prometheus_client.metrics import MetricWrapperBase

from kvswap.backends import record
from kvswap.backends.base import GetStatus
from kvswap.daemon import server
from kvswap.daemon.cli import main
from kvswap.daemon.config import Config
from kvswap.daemon.metrics import Metrics, StoreCollector
from kvswap.protocol import limits
from kvswap.protocol import messages as m
from kvswap.protocol.errors import ERRORS_BY_CODE
from kvswap.protocol.layout import CacheLayout

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _read(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _spans(text: str) -> list[str]:
    """Inline code spans, outside fenced blocks."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", prose)


def _code_spans(text: str) -> set[str]:
    return set(_spans(text))


def _rows(text: str, first_cell: str) -> list[list[str]]:
    """Table rows whose first cell fully matches ``first_cell`` (a regex)."""
    return [_cells(line) for line in text.splitlines()
            if line.startswith("|") and re.fullmatch(first_cell, _cells(line)[0])]


def _fenced_blocks(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)


def _section(text: str, heading: str) -> str:
    """The body under ``heading`` (a full heading line), up to the next heading of the same or
    a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.splitlines()
    assert heading in lines, f"missing heading {heading!r}"
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines))
                if re.match(rf"^#{{1,{level}}} ", lines[i])), len(lines))
    return "\n".join(lines[start:end])


# -- configuration.md and the kvswapd command -------------------------------------------------


def _cli_options() -> dict[str, click.Option]:
    return {opt: p for p in main.params if isinstance(p, click.Option) and p.name not in ("help", "version")
            for opt in p.opts if opt.startswith("--")}


def _flag_rows() -> dict[str, list[str]]:
    rows = _rows(_read("configuration.md"), r"`--[a-z0-9-]+`")
    table = {}
    for row in rows:
        flag = row[0].strip("`")
        assert flag not in table, f"{flag} is listed twice in configuration.md"
        table[flag] = row
    return table


def test_configuration_lists_exactly_the_cli_flags():
    documented = set(_flag_rows())
    actual = set(_cli_options())
    assert actual, "found no options on kvswapd"
    assert documented == actual, (f"missing from configuration.md: {sorted(actual - documented)}; "
                                  f"not flags of kvswapd: {sorted(documented - actual)}")


def test_configuration_env_vars_are_kvswap_upper_snake_and_read_by_click(monkeypatch):
    options = _cli_options()
    ctx = click.Context(main, auto_envvar_prefix="KVSWAP")
    for flag, row in _flag_rows().items():
        param = options[flag]
        expected = "KVSWAP_" + param.name.upper()
        assert row[1] == f"`{expected}`", f"{flag}: env var column is {row[1]}, expected `{expected}`"
        # The documented variable is the one click actually reads.
        monkeypatch.setenv(expected, "sentinel-value")
        assert param.resolve_envvar_value(ctx) == "sentinel-value", f"click does not read {expected} for {flag}"
        monkeypatch.delenv(expected)


def test_configuration_defaults_match_the_cli():
    options = _cli_options()
    for flag, row in _flag_rows().items():
        param = options[flag]
        default = param.default
        spans = _spans(row[2])
        if param.name == "storage_dir":
            assert default is None and "FILE_BACKEND_STORAGE_DIR" in row[2], f"{flag}: the default is the fallback"
        elif param.is_flag:
            assert row[2] == ("on" if default else "off"), f"{flag}: documented default {row[2]!r}, CLI has {default!r}"
        elif default in (None, ""):
            assert row[2] == "unset", f"{flag}: documented default {row[2]!r}, CLI has {default!r}"
        else:
            assert spans and spans[0] == str(default), f"{flag}: documented default {spans[:1]}, CLI has {default!r}"


def test_configuration_storage_dir_fallback_and_exit_codes():
    text = _read("configuration.md")
    assert "FILE_BACKEND_STORAGE_DIR" in _code_spans(text)
    codes = {row[0] for row in _rows(_section(text, "## Exit codes"), r"\d+")}
    assert {str(server.EXIT_OK), str(server.EXIT_STARTUP_FAILED), "2"} <= codes


# -- protocol.md: ops, fields, errors, limits -------------------------------------------------


def test_protocol_names_every_op_and_only_real_ones():
    text = _read("protocol.md")
    spans = _code_spans(text)
    missing = [op for op in m.REQUEST_TYPES if op not in spans]
    assert not missing, f"ops missing from protocol.md: {missing}"
    summary = _section(text, "## Ops").split("\n### ")[0]  # the table before the per-op sections
    listed = {row[0].strip("`") for row in _rows(summary, r"`[a-z_]+`")}
    assert listed == set(m.REQUEST_TYPES)


@pytest.mark.parametrize("op", sorted(m.REQUEST_TYPES))
def test_protocol_request_fields_match_the_message_classes(op):
    cls = m.REQUEST_TYPES[op]
    body = _section(_read("protocol.md"), f"### `{op}`")
    documented = {}
    for row in _rows(body, r"`[a-z_]+`"):
        if len(row) >= 3 and re.match(r"required$|default `", row[2]):
            documented[row[0].strip("`")] = row[2]
    # Same fields, in the order the decoder checks them (protocol.md says the first failure wins).
    assert list(documented) == list(cls.checks), f"{op}: documented fields {list(documented)}"
    defaults = {f.name: f for f in dataclasses.fields(cls)}
    for name, rule in documented.items():
        required = name in m.REQUIRED.get(op, ())
        assert (rule == "required") == required, f"{op}.{name}: doc says {rule!r}"
        if not required:
            f = defaults[name]
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            default = list(default) if isinstance(default, tuple) else default  # a tuple goes out as a list
            assert json.loads(_spans(rule)[0]) == default, f"{op}.{name}: default {rule!r}, code has {default!r}"


def test_protocol_layout_fields_match_cache_layout():
    rows = _rows(_section(_read("protocol.md"), "### Layout"), r"`[a-z_]+`")
    documented = {row[0].strip("`"): row[2] for row in rows}
    fields = {f.name: f for f in dataclasses.fields(CacheLayout) if f.init}
    assert set(documented) == set(fields)
    for name, rule in documented.items():
        f = fields[name]
        if f.default is dataclasses.MISSING:
            assert rule == "required", f"layout.{name}: doc says {rule!r}"
        else:
            assert json.loads(_spans(rule)[0]) == f.default, f"layout.{name}: default {rule!r}, code has {f.default!r}"


def test_protocol_names_every_error_code_with_its_retryability():
    text = _read("protocol.md")
    spans = _code_spans(text)
    missing = [code for code in ERRORS_BY_CODE if code not in spans]
    assert not missing, f"error codes missing from protocol.md: {missing}"
    rows = {row[0].strip("`"): row for row in _rows(_section(text, "## Errors"), r"`[a-z_]+`")}
    assert set(rows) == set(ERRORS_BY_CODE)
    for code, row in rows.items():
        assert row[1] == ("yes" if ERRORS_BY_CODE[code].retryable else "no"), f"{code}: retryable is {row[1]}"


def test_protocol_names_every_per_key_status():
    spans = _code_spans(_section(_read("protocol.md"), "## Per-key statuses"))
    statuses = {s.value for s in GetStatus} | {"error", "queued", "stored", "exists"}
    assert statuses <= spans, f"missing: {sorted(statuses - spans)}"


def test_protocol_limits_table_matches_limits_module():
    rows = {row[0].strip("`"): row[1] for row in _rows(_read("protocol.md"), r"`[A-Z_]+`")}
    constants = {name: value for name, value in vars(limits).items()
                 if name.isupper() and not name.startswith("_") and isinstance(value, int)}
    assert constants
    for name, value in constants.items():
        assert rows.get(name) == str(value), f"{name}: documented {rows.get(name)!r}, code has {value}"
    assert rows.get("MAX_REQUEST_ID") == str(m.MAX_REQUEST_ID)


def test_protocol_states_the_key_grammar():
    blocks = _fenced_blocks(_read("protocol.md"))
    assert any(b.strip() == limits._KEY_RE.pattern for b in blocks), "the key regex is not in protocol.md"


# -- protocol.md: worked examples -------------------------------------------------------------


def _examples() -> list[tuple[bytes, object]]:
    out = []
    for block in _fenced_blocks(_read("protocol.md")):
        lines = block.splitlines()
        hex_lines = [ln[len("hex:"):] for ln in lines if ln.startswith("hex:")]
        if not hex_lines:
            continue
        msgs = [ln[len("msg:"):] for ln in lines if ln.startswith("msg:")]
        assert len(msgs) == 1, f"an example needs exactly one msg: line:\n{block}"
        out.append((bytes.fromhex("".join(hex_lines)), json.loads(msgs[0])))
    return out


def test_protocol_has_request_ok_and_error_examples():
    stated = [msg for _, msg in _examples()]
    assert any("op" in s for s in stated)
    assert any(s.get("ok") is True for s in stated)
    assert any(s.get("ok") is False for s in stated)


@pytest.mark.parametrize("frame,stated", _examples(), ids=lambda v: v.hex()[:24] if isinstance(v, bytes) else "")
def test_protocol_examples_decode_to_the_stated_message(frame, stated):
    assert msgpack.unpackb(frame, raw=False) == stated
    if "op" in stated:
        request = m.decode_request(frame)
        assert (request.op, request.id, request.timeout_ms) == (stated["op"], stated["id"], stated.get("timeout_ms"))
        assert m.encode_request(request) == frame  # the bytes are exactly what the encoder writes
    else:
        reply = m.decode_reply(frame)
        assert reply.id == stated["id"] and reply.ok == stated["ok"]
        if reply.ok:
            assert reply.result == stated["result"]
        else:
            assert reply.error is not None
            assert type(reply.error) is ERRORS_BY_CODE[stated["error"]["code"]]
            assert reply.error.message == stated["error"]["message"]
        assert m.encode_reply(reply) == frame


def test_protocol_fingerprint_example_is_computed_as_described():
    block = next(b for b in _fenced_blocks(_read("protocol.md")) if b.startswith("layout:"))
    fields = dict(line.split(": ", 1) for line in block.splitlines())
    layout = CacheLayout.from_wire(json.loads(fields["layout"]))
    assert layout.fingerprint() == fields["fingerprint"]
    assert hashlib.sha256(fields["canonical"].encode()).hexdigest()[:32] == fields["fingerprint"]


# -- protocol.md: record header ---------------------------------------------------------------


def test_protocol_record_header_table_matches_the_struct():
    fmt = record._FIXED.format + record._HEADER_CHECKSUM.format.lstrip("<")
    assert fmt.startswith("<")
    computed, offset = [], 0
    for count, code in re.findall(r"(\d*)([a-zA-Z])", fmt[1:]):
        size = struct.calcsize("<" + count + code)
        computed.append((offset, size))
        offset += size
    assert offset == record.HEADER_CORE_BYTES
    rows = _rows(_section(_read("protocol.md"), "## On-disk record"), r"\d+")
    documented = [(int(row[0]), int(row[1])) for row in rows]
    assert documented == computed
    assert f"{record.HEADER_CORE_BYTES} bytes" in _read("protocol.md")
    assert record.MAGIC.decode() in _code_spans(_read("protocol.md"))


# -- operations.md and the metrics registry ---------------------------------------------------


def _exposed(name: str, kind: str) -> str:
    return name + "_total" if kind == "counter" else name


@pytest.fixture(scope="module")
def daemon_registry(tmp_path_factory):
    """The registry of a whole daemon, started as far as it goes without sockets: its own
    metrics, the store collector the swapper adds, the CURVE counter and the KV events' counts."""
    root = tmp_path_factory.mktemp("store")
    daemon = server.Daemon(Config(storage_dir=str(root), curve_secret_key_file=str(root / "unused.key_secret"),
                                  authorized_keys=str(root / "unused"), kv_events_endpoint="ipc:///unused"))
    daemon.swapper.start()
    try:
        yield daemon.metrics.registry
    finally:
        asyncio.run(daemon.swapper.stop())


def test_metrics_registry_of_a_plain_metrics_object_is_documented():
    text = _read("operations.md")
    families = list(Metrics().registry.collect())
    assert families
    spans = _code_spans(text)
    missing = [_exposed(f.name, f.type) for f in families if _exposed(f.name, f.type) not in spans]
    assert not missing, f"metrics missing from operations.md: {missing}"


def test_operations_names_every_metric(daemon_registry):
    text = _read("operations.md")
    families = list(daemon_registry.collect())
    assert len(families) > len(list(Metrics().registry.collect())), "the store collector and CURVE counter are missing"
    spans = _code_spans(text)
    missing = [_exposed(f.name, f.type) for f in families if _exposed(f.name, f.type) not in spans]
    assert not missing, f"metrics missing from operations.md: {missing}"
    rows = {row[0].strip("`"): row for row in _rows(text, r"`(kvswap|process)_[a-z_]+`")}
    assert set(rows) == {_exposed(f.name, f.type) for f in families}, "a documented metric does not exist"
    assert any(f.name == "process_resident_memory_bytes" for f in families), "no process collector"
    for f in families:
        assert rows[_exposed(f.name, f.type)][1] == f.type


def test_operations_metric_labels_match(daemon_registry):
    rows = {row[0].strip("`"): row for row in _rows(_read("operations.md"), r"`kvswap_[a-z_]+`")}
    labels: dict[str, set[str]] = {}
    for v in vars(Metrics()).values():  # the daemon's own instruments know their label names
        if isinstance(v, MetricWrapperBase):
            labels[_exposed(v._name, v._type)] = set(v._labelnames)
    store = StoreCollector(lambda: [_FakeStore()])  # collector families show labels on their samples
    for family in store.collect():
        labels[_exposed(family.name, family.type)] = {k for s in family.samples for k in s.labels}
    assert len(labels) > 10
    for name, expected in labels.items():
        assert name in rows, f"{name} is not in the metrics table"
        assert set(_spans(rows[name][2])) == expected, f"{name}: documented labels {rows[name][2]}, code has {expected}"


class _FakeStore:
    tier = "file"

    def stats(self) -> dict:
        return dict.fromkeys(StoreCollector.GAUGES, 0)  # every gauge the collector knows gets a sample

    def free_bytes(self) -> int:
        return 0


def test_operations_mentions_corrupt_counter_and_health_paths():
    spans = _code_spans(_read("operations.md"))
    assert {"kvswap_corrupt_records_total", "/healthz", "/readyz", "/metrics"} <= spans
