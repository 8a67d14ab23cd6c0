"""Metric and label names referenced by a PromQL expression, for checking dashboards and
alert rules against what a live daemon exports. A small lexer, not a parser: it drops string
literals, range selectors and grouping clauses, then reads the identifiers left that are
not functions, keywords or numbers."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Final

KEYWORDS: Final = frozenset({
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
    "offset", "inf", "nan", "start", "end",
})
_GROUPING_RE: Final = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_SELECTOR_RE: Final = re.compile(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{([^}]*)\}")
_MATCHER_RE: Final = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_IDENT_RE: Final = re.compile(r"(?<![\w:.$])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])\s*(\()?")


@dataclass
class References:
    #: metric name -> label names its selectors match on
    metrics: dict[str, set[str]] = field(default_factory=dict)
    #: label names in by/without/on/ignoring/group_* clauses
    grouping: set[str] = field(default_factory=set)


def references(expr: str) -> References:
    """What ``expr`` reads.

    >>> r = references('sum by (op) (rate(kvswap_requests_total{job="kvswapd", op=~"swap.*"}[$__rate_interval])) > 1e3')
    >>> sorted(r.metrics), sorted(r.metrics["kvswap_requests_total"]), r.grouping
    (['kvswap_requests_total'], ['job', 'op'], {'op'})
    """
    out = References()
    for clause in _GROUPING_RE.finditer(expr):
        out.grouping.update(x.strip() for x in clause.group(2).split(",") if x.strip())
    text = _GROUPING_RE.sub(" ", expr)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries: [5m], [$__rate_interval], [1h:5m]

    def selector(match: re.Match) -> str:
        name, body = match.group(1), match.group(2)
        labels = {m.group(1) for m in _MATCHER_RE.finditer(body)}
        if not name:  # {__name__="x"}
            named = [m.group(3) for m in _MATCHER_RE.finditer(body) if m.group(1) == "__name__" and m.group(2) == "="]
            name = named[0] if named else None
            labels.discard("__name__")
        if name and name not in KEYWORDS:
            out.metrics.setdefault(name, set()).update(labels)
        return " "

    text = _SELECTOR_RE.sub(selector, text)
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', " ", text)  # strings left: function args
    for match in _IDENT_RE.finditer(text):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in KEYWORDS:
            continue
        out.metrics.setdefault(name, set())
    return out
