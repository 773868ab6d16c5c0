"""Draw one request's trace as a timeline PNG: per round, draft / network / target (and the rest).

    python -m specdec.runtime.tracing.plot TRACE.jsonl [MORE.jsonl | DIR ...] [--trace-id ID] [--out trace.png]
    specdec trace ...                      (the same command)
    python -m specdec.runtime.tracing.plot DIR --list

Reads the JSON-lines files every process wrote (--trace-file; a folder means
every *.jsonl in it), picks the request (--trace-id, default the latest
Generate), prints its per-round breakdown and writes a Gantt chart: one lane per
kind of time (draft service, network, target service, serialization,
orchestrator, Redis), rounds shaded alternately and labelled accepted/drafted.
Needs matplotlib (pip install 'specdec[bench]').
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdec.runtime.tracing.timeline import Timeline, load, ms, requests, table, timeline

LANES = [  # top to bottom: (lane, label, colour)
    ("draft", "draft service", "#4c72b0"),
    ("network", "network", "#dd8452"),
    ("target", "target service", "#55a868"),
    ("serialize", "serialize", "#8172b3"),
    ("orchestrator", "orchestrator", "#937860"),
    ("redis", "Redis wait", "#c44e52"),
    ("redis write", "Redis write", "#e8a3a5"),
]


def render(t: Timeline, out: Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("specdec trace needs matplotlib: pip install 'specdec[bench]' "
                         "(or pip install matplotlib)") from None
    t0 = t.start_ns
    x = lambda ns: (ns - t0) / 1e6  # noqa: E731 - ms since the request started
    width = min(40.0, max(10.0, 0.35 * len(t.rounds) + 8))
    fig, ax = plt.subplots(figsize=(width, 4.6))
    rows = {lane: i for i, (lane, _, _) in enumerate(LANES)}
    visible = 0.0015 * x(t.request["end_ns"])  # shorter bars are drawn this wide (the table has the figures)
    for r in t.rounds:
        a, b = x(r.span["start_ns"]), x(r.span["end_ns"])
        if r.index % 2 == 0:
            ax.axvspan(a, b, color="#f0f0f0", zorder=0)
        attrs = r.attributes
        ax.text((a + b) / 2, -1.3, f"{r.index}\n{attrs.get('specdec.accepted', '?')}/"
                f"{attrs.get('specdec.drafted', '?')}", ha="center", va="top", fontsize=7)
        for lane, start, end in r.pieces:
            _, _, colour = LANES[rows[lane]]
            ax.barh(rows[lane], max(visible, x(end) - x(start)), left=x(start), height=0.7, color=colour,
                    zorder=2, hatch="//" if lane == "redis write" else None, linewidth=0)
    ax.set_yticks(range(len(LANES)), [label for _, label, _ in LANES])
    ax.set_ylim(len(LANES) - 0.4, -1.4)
    ax.set_xlim(0, x(t.request["end_ns"]))
    ax.set_xlabel("ms since the request started")
    req = t.request.get("attributes", {})
    totals = {f: sum(getattr(r, f) for r in t.rounds) for f in ("draft_ms", "network_ms", "target_ms")}
    ax.set_title(
        f"trace {t.trace_id[:16]}…  {req.get('specdec.proposer', '')}  {len(t.rounds)} rounds, "
        f"{req.get('specdec.new_tokens', '?')} tokens, {ms(t.request):.1f} ms\n"
        f"(draft {totals['draft_ms']:.1f}, network {totals['network_ms']:.1f}, "
        f"target {totals['target_ms']:.1f} ms; round number and accepted/drafted on top)",
        fontsize=9, loc="left")
    ax.grid(axis="x", alpha=0.3, zorder=1)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path, help="JSON-lines trace files or folders of them")
    p.add_argument("--trace-id", default=None, help="the request's trace id (default: the latest Generate)")
    p.add_argument("--out", type=Path, default=Path("trace.png"), help="PNG to write (default %(default)s)")
    p.add_argument("--list", action="store_true", help="list the requests in the files and exit")
    args = p.parse_args(argv)
    spans = load(args.files)
    if args.list:
        for g in requests(spans):
            a = g.get("attributes", {})
            print(f"{g['trace_id']}  {ms(g):9.1f} ms  {a.get('specdec.rounds', '?'):>4} rounds  "
                  f"{a.get('specdec.new_tokens', '?'):>5} tokens  {a.get('specdec.proposer', '')}")
        return 0
    try:
        t = timeline(spans, args.trace_id)
    except LookupError as exc:
        print(f"specdec trace: {exc}", file=sys.stderr)
        return 1
    print(table(t))
    print(f"wrote {render(t, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
