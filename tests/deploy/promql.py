"""Metric and label names used by a PromQL expression, for checking deploy files against the served
metrics. A tokenizer, not a full parser: it knows the PromQL lexical rules that matter here
(https://prometheus.io/docs/prometheus/latest/querying/basics/): string literals, ``{...}`` label
matchers, ``[...]`` ranges, durations and numbers, function calls (an identifier before ``(``), grouping
clauses (``by``/``without``/``on``/``ignoring``/``group_left``/``group_right`` + a label list), binary
keywords, Grafana ``$variables`` and prometheus-adapter ``<<.Templates>>``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_TOKEN = re.compile(r"""
    (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<braces>\{(?:[^}"']|"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')*\})
  | (?P<range>\[[^\]]*\])
  | (?P<tmpl><<[^>]*>>|\$\{?\w+\}?)
  | (?P<dur>\d+(?:ms|[smhdwy])\b)
  | (?P<num>\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<other>\S)
""", re.VERBOSE)
_GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = {"bool", "and", "or", "unless", "offset", "atan2", "inf", "nan"}
_AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
                 "topk", "quantile", "limitk", "limit_ratio"}  # may take `by (...)` before their "("
_MATCHER_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_STRING = re.compile(r""""(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'""")


@dataclass
class Names:
    """What one expression names: metric names (selectors) and label names (matchers, grouping)."""

    metrics: set[str] = field(default_factory=set)
    labels: set[str] = field(default_factory=set)


def _matcher_labels(braces: str) -> set[str]:
    body = _STRING.sub('""', braces[1:-1])
    return {m for m in _MATCHER_LABEL.findall(body) if m != "__name__"}


def names(expr: str) -> Names:
    """Metric and label names in ``expr``.

    Raises:
        ValueError: a grouping keyword not followed by a parenthesised label list.
    """
    toks = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(expr)]
    out = Names()
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1][1] if i + 1 < len(toks) else ""
        if kind == "braces":
            out.labels |= _matcher_labels(text)
        elif kind == "ident" and text.lower() in _GROUPING:
            if nxt != "(":
                if text.lower() in ("group_left", "group_right"):
                    i += 1
                    continue
                raise ValueError(f"{text!r} without a label list in {expr!r}")
            j = i + 2
            while j < len(toks) and toks[j][1] != ")":
                if toks[j][0] == "ident":
                    out.labels.add(toks[j][1])
                j += 1
            i = j
        elif kind == "ident" and text.lower() not in _KEYWORDS and nxt != "(" and not (
                text.lower() in _AGGREGATIONS and nxt.lower() in _GROUPING):
            out.metrics.add(text)
        i += 1
    return out


def legend_labels(legend: str) -> set[str]:
    """Label names a Grafana ``legendFormat`` interpolates (``{{label}}``)."""
    return set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
