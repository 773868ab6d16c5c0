"""A small PromQL evaluator over two scrapes, for checking dashboards' queries against real metrics.

It reads the subset dashboards use: selectors with label matchers (= != =~ !~), `rate(...[w])` and
`increase(...[w])` (the window is the two scrapes'), `sum` / `max` / `min` / `avg` with `by (...)`,
`histogram_quantile`, `scalar`, numbers, and + - * / with vector matching on identical label
sets (a scalar applies to every series). Grafana's `$variables` are substituted first. A series
is {frozenset of (label, value)}: value.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict

Vector = dict[frozenset, float]
_TOKEN = re.compile(r"\s*(?:(?P<num>\d+(?:\.\d+)?)|(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)|(?P<str>\"(?:[^\"\\]|\\.)*\")"
                    r"|(?P<op>=~|!~|!=|[-+*/(){}\[\],=]))")
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_scrape(text: str) -> dict[str, Vector]:
    """Prometheus text exposition -> {metric name: {labels: value}}."""
    out: dict[str, Vector] = defaultdict(dict)
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip()) if line and not line.startswith("#") else None
        if m:
            labels = frozenset(_LABEL.findall(m.group(2) or ""))
            out[m.group(1)][labels] = float(m.group(3))
    return out


class Evaluator:
    def __init__(self, before: dict[str, Vector], after: dict[str, Vector], seconds: float,
                 variables: dict[str, str] | None = None) -> None:
        self.before, self.after, self.seconds = before, after, seconds
        self.variables = variables or {}

    def __call__(self, expr: str):
        for name, value in sorted(self.variables.items(), key=lambda kv: -len(kv[0])):
            expr = expr.replace(f"${name}", value)
        self.tokens = [t for t in _TOKEN.findall(expr)]
        self.tokens = [next(v for v in t if v) for t in self.tokens]
        self.i = 0
        value = self._sum()
        assert self.i == len(self.tokens), f"unparsed: {self.tokens[self.i:]}"
        return value

    # ---- the grammar: sum := product (('+'|'-') product)*, product := atom (('*'|'/') atom)*
    def _peek(self):
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def _take(self, expected=None):
        token = self.tokens[self.i]
        assert expected is None or token == expected, (expected, token, self.tokens)
        self.i += 1
        return token

    def _sum(self):
        value = self._product()
        while self._peek() in ("+", "-"):
            value = _binary(self._take(), value, self._product())
        return value

    def _product(self):
        value = self._atom()
        while self._peek() in ("*", "/"):
            value = _binary(self._take(), value, self._atom())
        return value

    def _atom(self):
        token = self._take()
        if token == "(":
            value = self._sum()
            self._take(")")
            return value
        if re.fullmatch(r"\d+(\.\d+)?", token):
            return float(token)
        if token in ("sum", "max", "min", "avg"):
            return self._aggregate(token)
        if token in ("rate", "increase"):
            self._take("(")
            name, matchers = self._selector()
            self._take("[")
            while self._take() != "]":
                pass
            self._take(")")
            return self._delta(name, matchers, per_second=token == "rate")
        if token == "histogram_quantile":
            self._take("(")
            q = float(self._take())
            self._take(",")
            buckets = self._sum()
            self._take(")")
            return _quantile(q, buckets)
        if token == "scalar":
            self._take("(")
            vector = self._sum()
            self._take(")")
            return next(iter(vector.values())) if len(vector) == 1 else math.nan
        self.i -= 1
        name, matchers = self._selector()
        return _select(self.after.get(name, {}), matchers)

    def _selector(self):
        name = self._take()
        matchers = []
        if self._peek() == "{":
            self._take("{")
            while self._peek() != "}":
                label, op, value = self._take(), self._take(), self._take()[1:-1]
                matchers.append((label, op, value))
                if self._peek() == ",":
                    self._take(",")
            self._take("}")
        return name, matchers

    def _aggregate(self, how: str):
        by = None
        if self._peek() == "by":
            by = self._labels()
        self._take("(")
        vector = self._sum()
        self._take(")")
        if self._peek() == "by":
            by = self._labels()
        groups: dict[frozenset, list[float]] = defaultdict(list)
        for labels, value in vector.items():
            groups[frozenset((k, v) for k, v in labels if by is not None and k in by)].append(value)
        fold = {"sum": sum, "max": max, "min": min, "avg": lambda v: sum(v) / len(v)}[how]
        return {labels: fold(values) for labels, values in groups.items()}

    def _labels(self) -> set[str]:
        self._take("by")
        self._take("(")
        names = set()
        while self._peek() != ")":
            token = self._take()
            if token != ",":
                names.add(token)
        self._take(")")
        return names

    def _delta(self, name: str, matchers, per_second: bool) -> Vector:
        before, after = _select(self.before.get(name, {}), matchers), _select(self.after.get(name, {}), matchers)
        scale = self.seconds if per_second else 1.0
        return {labels: (value - before.get(labels, 0.0)) / scale for labels, value in after.items()}


def _select(vector: Vector, matchers) -> Vector:
    def keep(labels: frozenset) -> bool:
        have = dict(labels)
        for label, op, value in matchers:
            got = have.get(label, "")
            ok = {"=": got == value, "!=": got != value, "=~": re.fullmatch(value, got) is not None,
                  "!~": re.fullmatch(value, got) is None}[op]
            if not ok:
                return False
        return True
    return {labels: v for labels, v in vector.items() if keep(labels)}


def _binary(op: str, a, b):
    fn = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y,
          "/": lambda x, y: x / y if y else math.nan}[op]
    if isinstance(a, float) and isinstance(b, float):
        return fn(a, b)
    if isinstance(a, float):
        return {k: fn(a, v) for k, v in b.items()}
    if isinstance(b, float):
        return {k: fn(v, b) for k, v in a.items()}
    return {k: fn(v, b[k]) for k, v in a.items() if k in b}


def _quantile(q: float, buckets: Vector) -> Vector:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket holding rank q."""
    groups: dict[frozenset, list[tuple[float, float]]] = defaultdict(list)
    for labels, count in buckets.items():
        le = dict(labels)["le"]
        groups[frozenset((k, v) for k, v in labels if k != "le")].append((float(le), count))
    out = {}
    for labels, pairs in groups.items():
        pairs.sort()
        total = pairs[-1][1]
        if total <= 0:
            out[labels] = math.nan
            continue
        rank, lower, below = q * total, 0.0, 0.0
        for upper, count in pairs:
            if count >= rank:
                out[labels] = pairs[-2][0] if math.isinf(upper) else (
                    lower + (upper - lower) * (rank - below) / (count - below) if count > below else upper)
                break
            lower, below = upper, count
    return out
