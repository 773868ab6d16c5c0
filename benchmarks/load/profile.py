"""Where an orchestrator's CPU goes: py-spy samples of it during a cell, summed by part.

`benchmarks.load --profile` samples each cell's orchestrator process(es) and the
target service with py-spy (`Sampler`: `py-spy record --format raw --nonblocking`,
so the process is never stopped to be read) and writes the collapsed stacks to
OUT/profiles/. `parts(text)` puts each sample in one part by its
innermost frame that a rule names (`PARTS`, first match from the leaf up), so a
Redis call made from the round's commit counts as Redis and a Score batch's gRPC
write as gRPC:

  grpc calls         the orchestrator's own calls to the services (grpc/aio/_call.py)
  grpc server        the callers' streams: the servicer's messages and gRPC's server
  grpc C             gRPC's Cython work run from the event loop with no Python frame
                     above it: the callers' messages sent, completions handled
  threads in C       threads with no Python frame inside: gRPC's completion-queue poller
  redis              the session records (redis-py, specdec.runtime.store)
  metrics            Prometheus observations
  round              the round's steps, policy and proposers, specdec.core
  fleet              routing, batching, deadlines, the replicas' clients
  request            a request's set-up and answer (tokenising, parsing, Stats)
  event loop         asyncio's own scheduling
  waiting            the event loop in epoll with nothing to run (not CPU)

`python -m benchmarks.load.profile FILE...` prints the parts and the top functions.
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

# (part, frame pattern): the innermost frame matching a pattern names the sample's part.
PARTS: tuple[tuple[str, str], ...] = (
    ("waiting", r"^EpollSelector\.select "),
    ("redis", r"\(redis/|specdec/runtime/store\.py"),
    ("metrics", r"\(prometheus_client/|orchestrator/api/metrics\.py"),
    ("grpc calls", r"\(grpc/aio/_call\.py|orchestrator/fleet/streams\.py"),
    ("grpc server", r"\(grpc/aio/_server\.py|orchestrator/api/servicer\.py|specdec/runtime/errors\.py"),
    ("round", r"orchestrator/(round|policy|proposers)/|specdec/core/"),
    ("fleet", r"orchestrator/fleet/"),
    ("request", r"orchestrator/(api|common)/|\(transformers/|\(tokenizers/|orchestrator/config"),
    ("threads in C", r"^Thread\.run \(threading\.py"),
    ("grpc C", r"^Handle\._run \(asyncio/events\.py"),
    ("event loop", r"\(asyncio/"),
)
ORDER = ("grpc calls", "grpc server", "grpc C", "threads in C", "redis", "metrics", "round", "fleet",
         "request", "event loop", "other", "waiting")
_RULES = tuple((part, re.compile(pattern)) for part, pattern in PARTS)


def _samples(text: str):
    """(frames, root first; count) per line of py-spy's raw (collapsed) output."""
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            yield stack.split(";"), int(count)


def part_of(frames: list[str]) -> str:
    """The part of one sample (see the module docstring)."""
    for frame in reversed(frames):
        for part, rule in _RULES:
            if rule.search(frame):
                return part
    return "other"


def parts(text: str) -> dict[str, float]:
    """{part: share of the busy samples} (the busy ones: all but "waiting"), and "samples"."""
    counts: collections.Counter[str] = collections.Counter()
    for frames, n in _samples(text):
        counts[part_of(frames)] += n
    busy = sum(n for part, n in counts.items() if part != "waiting")
    out = {part: counts[part] / busy for part in ORDER if part != "waiting" and busy}
    out["samples"] = float(busy)
    return out


def top_functions(text: str, n: int = 15) -> list[tuple[str, float]]:
    """The functions most often innermost (self time), as shares of the busy samples."""
    leaves: collections.Counter[str] = collections.Counter()
    busy = 0
    for frames, count in _samples(text):
        if part_of(frames) == "waiting":
            continue
        busy += count
        leaves[re.sub(r":\d+\)$", ")", frames[-1])] += count
    return [(name, count / busy) for name, count in leaves.most_common(n)] if busy else []


class Sampler:
    """py-spy recording processes while a cell runs; `stop` writes their files."""

    def __init__(self, rate: int = 200, *, stopping: bool = False) -> None:
        self.rate = rate
        self.stopping = stopping  # stop the process for each sample: whole stacks, more overhead
        self._running: list[tuple[subprocess.Popen, Path]] = []
        self.errors: list[str] = []  # py-spy's messages for the recordings that wrote nothing

    @staticmethod
    def available() -> str | None:
        """py-spy's path (next to this interpreter, as a venv installs it, or on PATH), or None."""
        beside = Path(sys.executable).parent / "py-spy"
        return str(beside) if beside.is_file() else shutil.which("py-spy")

    def start(self, pid: int, out: Path) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        argv = [self.available() or "py-spy", "record", "--pid", str(pid), "--rate", str(self.rate),
                "--format", "raw", *(() if self.stopping else ("--nonblocking",)),
                "--output", str(out)]
        with out.with_suffix(".log").open("wb") as log:  # py-spy's own messages
            self._running.append((subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), out))

    def stop(self) -> list[Path]:
        """Stop every recording (SIGINT: py-spy writes its file) and return the files written."""
        written = []
        for proc, out in self._running:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if out.is_file() and out.stat().st_size:
                written.append(out)
                out.with_suffix(".log").unlink(missing_ok=True)
            else:
                self.errors.append(out.with_suffix(".log").read_text(errors="replace").strip())
        self._running = []
        return written


def merged(paths: list[Path]) -> str:
    return "\n".join(p.read_text() for p in paths)


def table(shares: dict[str, float]) -> list[str]:
    """A Markdown row's cells, in ORDER (percent)."""
    return [f"{100 * shares.get(part, 0.0):.0f}%" for part in ORDER if part != "waiting"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.load.profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path, help="py-spy raw outputs (OUT/profiles/*.txt), merged")
    p.add_argument("--top", type=int, default=15, help="functions to list by self time (default 15)")
    args = p.parse_args(argv)
    text = merged(args.files)
    shares = parts(text)
    print(f"{shares['samples']:.0f} busy samples")
    for part in ORDER:
        if part != "waiting":
            print(f"  {part:18s} {100 * shares.get(part, 0.0):5.1f}%")
    print("top functions by self time:")
    for name, share in top_functions(text, args.top):
        print(f"  {100 * share:5.1f}%  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
