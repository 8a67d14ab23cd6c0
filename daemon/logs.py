"""Log output of ``kvswapd``: human-readable lines by default, or one JSON object per line
(``--log-format json``) for collectors such as Loki, Fluent Bit or Vector.

A JSON line has the keys ``ts`` (UTC, ISO 8601 with milliseconds), ``level`` (``debug``,
``info``, ``warning``, ``error``, ``critical``), ``logger`` and ``msg``, plus ``exc`` when the
record carries a traceback, plus the fields the line carries (``extra=`` of the logging call),
each as its own key so a collector can filter on it without parsing ``msg``. Example::

    {"ts": "2025-01-31T09:12:03.418Z", "level": "error", "logger": "kvswap.daemon",
     "msg": "bad configuration: KVSWAP_FSYNC=maybe: ...", "exit_code": 2, "source": "KVSWAP_FSYNC"}
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone
from typing import Final

LOG_FORMATS: Final = ("text", "json")
TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: The keys every JSON line has; a field of the same name from ``extra=`` cannot replace them.
CORE_KEYS: Final = ("ts", "level", "logger", "msg", "exc")
#: Attributes every LogRecord has: whatever else a record carries came from ``extra=``.
_RECORD_ATTRS: Final = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: newlines inside a message or a traceback are
    escaped by ``json.dumps``, so a collector never splits a record."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and key not in CORE_KEYS:
                out[key] = value
        return json.dumps(out, ensure_ascii=False, default=str)


def configure_logging(level: str, fmt: str = "text") -> None:
    """Send every log record to stderr in ``fmt`` (``text`` or ``json``) at ``level``."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    # force=True: replace a handler an imported library may have installed, so no line
    # reaches stderr in the other format.
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)
