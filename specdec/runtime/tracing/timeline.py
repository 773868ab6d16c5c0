"""Read JSON-lines traces back and recompute one request's per-round breakdown from its spans.

No OpenTelemetry or matplotlib needed. Figures per round (milliseconds), each
defined on the spans exactly as the Stats field of the same name:

    total_ms        the round span's duration
    draft_ms        Σ draft service Propose spans (SERVER, status not ERROR) in the round
    target_ms       Σ target service Score spans (SERVER, not ERROR)
    serialize_ms    Σ encode + decode children of the round's answered Score/Propose rpc
                    spans (CLIENT)
    network_ms      Σ those rpc spans − draft_ms − target_ms − serialize_ms
    redis_ms        Σ "redis wait" spans in the round
    redis_write_ms  the round's "redis write" span of its own state (specdec.round_state)
    orchestrator_ms total_ms − all of the above but redis_write_ms (which overlaps the next round)
"""
from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

COMPUTE = {"Propose": "draft", "Score": "target"}  # the service span's method -> its Stats field


def load(paths: Iterable[str | Path]) -> list[dict]:
    """Every span record in the files (or every *.jsonl in a folder)."""
    spans: list[dict] = []
    for path in paths:
        path = Path(path)
        files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
        for f in files:
            for line in f.read_text().splitlines():
                if line.strip():
                    spans.append(json.loads(line))
    return spans


def requests(spans: list[dict]) -> list[dict]:
    """The Generate spans, oldest first."""
    return sorted((s for s in spans if s["name"] == "Generate"), key=lambda s: s["start_ns"])


def ms(span: dict) -> float:
    return (span["end_ns"] - span["start_ns"]) / 1e6


@dataclass
class Round:
    index: int
    span: dict
    attributes: dict
    total_ms: float = 0.0
    draft_ms: float = 0.0
    target_ms: float = 0.0
    serialize_ms: float = 0.0
    network_ms: float = 0.0
    redis_ms: float = 0.0
    redis_write_ms: float = 0.0
    orchestrator_ms: float = 0.0
    # (lane, start_ns, end_ns) pieces to draw; lanes: draft, target, network, serialize,
    # orchestrator, redis, redis write
    pieces: list[tuple[str, int, int]] = field(default_factory=list)


@dataclass
class Timeline:
    trace_id: str
    request: dict
    rounds: list[Round]
    spans: list[dict]

    @property
    def start_ns(self) -> int:
        return self.request["start_ns"]


def _subtract(start: int, end: int, holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end] minus the holes."""
    out, cursor = [], start
    for a, b in sorted(holes):
        a, b = max(a, start), min(b, end)
        if b <= a:
            continue
        if a > cursor:
            out.append((cursor, a))
        cursor = max(cursor, b)
    if cursor < end:
        out.append((cursor, end))
    return out


def timeline(spans: list[dict], trace_id: str | None = None) -> Timeline:
    """One request's rounds from its spans (`trace_id`, default: the latest Generate)."""
    gens = requests(spans)
    if trace_id:
        gens = [g for g in gens if g["trace_id"] == trace_id]
    if not gens:
        raise LookupError(f"no Generate span{' in trace ' + trace_id if trace_id else ''} in these files")
    request = gens[-1]
    mine = [s for s in spans if s["trace_id"] == request["trace_id"]]
    by_id = {s["span_id"]: s for s in mine}
    children: dict[str, list[dict]] = defaultdict(list)
    for s in mine:
        if s["parent_id"]:
            children[s["parent_id"]].append(s)

    def descendants(span_id: str) -> Iterable[dict]:
        for child in children.get(span_id, ()):
            yield child
            yield from descendants(child["span_id"])

    rounds = []
    round_spans = sorted((s for s in children[request["span_id"]] if s["name"] == "round"),
                         key=lambda s: s["start_ns"])
    for i, rs in enumerate(round_spans, 1):
        r = Round(i, rs, rs.get("attributes", {}), total_ms=ms(rs))
        for s in descendants(rs["span_id"]):
            ok = s.get("status") != "ERROR"
            method = s["name"].rsplit("/", 1)[-1]
            if s["kind"] == "SERVER" and method in COMPUTE:
                if ok:
                    lane = COMPUTE[method]
                    setattr(r, f"{lane}_ms", getattr(r, f"{lane}_ms") + ms(s))
                    r.pieces.append((lane, s["start_ns"], s["end_ns"]))
            elif s["kind"] == "CLIENT" and method in COMPUTE:  # (a GetInfo on the way is not booked)
                parts = [c for c in children.get(s["span_id"], ()) if c["name"] in ("encode", "decode")]
                servers = [c for c in children.get(s["parent_id"], ())
                           if c["kind"] == "SERVER" and c["start_ns"] >= s["start_ns"]
                           and c["end_ns"] <= s["end_ns"]]
                holes = [(c["start_ns"], c["end_ns"]) for c in parts + servers]
                if ok:
                    serialize = sum(ms(c) for c in parts)
                    r.serialize_ms += serialize
                    r.network_ms += ms(s) - serialize
                    r.pieces += [("serialize", c["start_ns"], c["end_ns"]) for c in parts]
                    r.pieces += [("network", a, b) for a, b in _subtract(s["start_ns"], s["end_ns"], holes)]
            elif s["name"] == "redis wait":
                r.redis_ms += ms(s)
                r.pieces.append(("redis", s["start_ns"], s["end_ns"]))
            elif s["name"] == "redis write":
                if s.get("attributes", {}).get("specdec.round_state", True):
                    r.redis_write_ms += ms(s)
                r.pieces.append(("redis write", s["start_ns"], s["end_ns"]))
            elif s["name"] in ("verify", "commit") and by_id.get(s["parent_id"]) is rs:
                r.pieces.append(("orchestrator", s["start_ns"], s["end_ns"]))
        r.network_ms -= r.draft_ms + r.target_ms
        r.orchestrator_ms = max(0.0, r.total_ms - r.draft_ms - r.target_ms - r.serialize_ms
                                - r.network_ms - r.redis_ms)
        rounds.append(r)
    return Timeline(request["trace_id"], request, rounds, mine)


FIELDS = ("total_ms", "draft_ms", "target_ms", "serialize_ms", "network_ms", "orchestrator_ms",
          "redis_ms", "redis_write_ms")


def table(t: Timeline) -> str:
    """The per-round breakdown as text."""
    head = f"{'round':>5} {'k':>3} {'acc':>7} " + " ".join(f"{f[:-3]:>12}" for f in FIELDS)
    lines = [head]
    for r in t.rounds:
        a = r.attributes
        acc = f"{a.get('specdec.accepted', '?')}/{a.get('specdec.drafted', '?')}"
        lines.append(f"{r.index:>5} {a.get('specdec.k', ''):>3} {acc:>7} "
                     + " ".join(f"{getattr(r, f):12.3f}" for f in FIELDS))
    return "\n".join(lines)
