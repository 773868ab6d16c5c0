"""python -m benchmarks.run: specdec side by side with transformers, per-round costs, RTT sweep.

Runs on one prompt set, one max_new_tokens, one machine, with every
configuration interleaved (round-robin per prompt and repetition, the order
rotated each time) so drift hits all alike:

  services   svc-none (target-only through the same path), svc-draft-k{K},
             svc-draft-auto (k = 0: the orchestrator picks k each round),
             svc-lookup-k{K} (prompt lookup), svc-draft-par-k{K} (parallel
             speculation), svc-combined-k{K} (per round lookup, draft or neither;
             k = 0: svc-combined-auto), svc-default (the orchestrator's defaults),
             svc-draft-tree{N}-k{K} (--tree-k: token trees, a second orchestrator)
  in-process hf-target (`model.generate`), hf-assisted-k{K} (`assistant_model=`
             with the same draft, constant K), hf-lookup-k{K}
             (`prompt_lookup_num_tokens=K`)

for greedy and for sampling (temperature 0.7, top_p 0.9). Then, through an
emulated link between orchestrator and services (a userspace delay/rate
proxy: this kernel has no netem), an RTT sweep (greedy) and a bandwidth cap
(sampling, where distributions cross the wire). Last, the predicted-output cell
(greedy, edit prompts: svc-prediction-source-k{K} predicts the text being edited,
svc-prediction-exact-k{K} the answer itself) and the structured-output cell
(greedy, the first --structured-prompts pairs of structured-v1.jsonl, as
benchmarks.features.structured runs them). Every configuration and cell is described in
docs/benchmarks.md, "What one run does".

Greedy outputs of every service configuration must equal target-only through
the services token for token; otherwise the run exits 1 and lists the prompts.

Sizes. --quick (with --tiny: the tiny test models) finishes in well under
5 minutes. Full mode on the embedded models is sized for <= 25 minutes on a
2-core CPU (5 prompts, 32 new tokens, 3 repetitions, k = 1..8 greedy, 2, 4, 8
sampling, the RTT sweep and the rate cap; one torch thread per process).
Scale with --per-category, --max-new-tokens, --reps.

Outputs (--out, default benchmarks/results/latest): results.json (every raw
figure + environment), results.md, PNG plots. With --trace-dir DIR every
process started here writes its OpenTelemetry spans to DIR/<name>.jsonl, each
service request carries its own trace id (records' "trace_id"), and
`specdec trace DIR --trace-id ID` draws one of them.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from benchmarks import suite
from benchmarks.features import structured
from benchmarks.linkemu import LinkSettings, netem_available
from benchmarks.run import analysis, report

GREEDY, SAMPLING = "greedy", "sampling"
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Config:
    """One way of decoding: family "svc" (through the services) or "hf" (in-process)."""

    family: str
    proposer: str  # svc: none / draft / lookup / combined / default; hf: target / assisted / lookup
    k: int = 0  # svc-draft: 0 = adaptive (the orchestrator picks k each round)
    parallel: bool = False  # svc-draft: parallel speculation (Speculation.PARALLEL)
    prediction: str = ""  # svc-prediction: "source" (the edited text) or "exact" (the answer)
    tree: int = 0  # svc: token trees of at most this many tokens (an orchestrator with --tree-nodes)

    @property
    def adaptive(self) -> bool:
        return self.family == "svc" and self.proposer == "draft" and self.k == 0

    @property
    def name(self) -> str:
        if self.proposer in ("none", "target", "default"):  # default: the orchestrator's choice
            return f"{self.family}-{self.proposer}"
        if self.adaptive or (self.proposer == "combined" and self.k == 0):
            return f"{self.family}-{self.proposer}-auto"  # k = 0: the orchestrator's default bound
        if self.parallel:
            return f"{self.family}-{self.proposer}-par-k{self.k}"
        if self.tree:
            return f"{self.family}-{self.proposer}-tree{self.tree}-k{self.k}"
        if self.prediction:
            return f"{self.family}-{self.proposer}-{self.prediction}-k{self.k}"
        return f"{self.family}-{self.proposer}-k{self.k}"


@dataclass(frozen=True)
class Item:
    """One request to make: a config, a mode, a prompt, a repetition, a link."""

    phase: str
    mode: str
    config: Config
    prompt: suite.Prompt
    rep: int
    link: LinkSettings | None = None
    top_p: float | None = None  # overrides --top-p (the rate phase ships dense distributions)
    prediction: str = ""  # GenerateRequest.prediction (the prediction phase)
    grammar: tuple[str, str] = ()  # (Constraint field, text): GenerateRequest.constraint (structured)


# ---------------------------------------------------------------------------- arguments

def _ints(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if "-" in part[1:] if part else False:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        elif part:
            out.append(int(part))
    return out


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


FULL = dict(per_category=1, max_new_tokens=32, reps=3, k="1-8", sampling_k="2,4,8", parallel_k="1,2,4",
            lookup_k="4", combined_k="4", tree_k="", peer_k="2,4", rtts="0,1,2,5,10,20", rtt_k="2,4", rtt_prompts=2,
            rates="0,1000,100", rate_k="4", rate_rtt=0.0, rate_prompts=1, prediction_prompts=2,
            prediction_tokens=96, structured_prompts=6, structured_tokens=128)
QUICK = dict(per_category=1, max_new_tokens=16, reps=3, k="1,2,4", sampling_k="2", parallel_k="1",
             lookup_k="4", combined_k="4", tree_k="", peer_k="2", rtts="0,5", rtt_k="2", rtt_prompts=1,
             rates="0,10", rate_k="2", rate_rtt=0.0, rate_prompts=1, prediction_prompts=1,
             prediction_tokens=48, structured_prompts=1, structured_tokens=128)
# The predicted-output cell's edit prompts, in order: the text after the instruction's blank line
# is what is edited (and the "source" prediction).
PREDICTION_PROMPTS = ("code-05", "code-04", "code-06", "code-09")
PREDICTION_K = 8
# The structured-output cell's speculating configurations (benchmarks.features.structured.CONFIGS), after
# constrained target-only. max_new_tokens there is a bound: an output ends when its grammar does.
STRUCTURED_CONFIGS = ("draft-k4", "default")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _stack_args(p)
    _cell_args(p)
    _phase_args(p)
    p.add_argument("--seed", type=int, default=1234, help="base seed for sampling")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "latest")
    p.add_argument("--redis-url", default=os.environ.get("SPECDEC_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--trace-dir", type=Path, default=None,
                   help="record round-level traces: each started process writes DIR/<name>.jsonl "
                        "(--trace-file); each record gets its trace_id")
    return _resolved(p, p.parse_args(argv))


def _stack_args(p: argparse.ArgumentParser) -> None:
    """What runs: the stack (or a running orchestrator), the models, the device, the threads."""
    p.add_argument("--quick", action="store_true", help="CI smoke sizes (see the defaults below)")
    p.add_argument("--tiny", action="store_true",
                   help="use tiny random models (tests.tiny.build_pair) instead of the embedded ones")
    p.add_argument("--tiny-head", action="store_true",
                   help="with --tiny: the draft is a feature head of the tiny target "
                        "(tests.tiny.build_feature_head)")
    p.add_argument("--orchestrator", metavar="ADDR",
                   help="use a running orchestrator instead of starting a stack (no link phases)")
    p.add_argument("--target", help="target --model (folder or .gguf); default: the embedded one")
    p.add_argument("--draft", help="draft --model; default: the draft service's own default "
                                   "(the committed distilled draft)")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="use an early-exit draft of the target with this many layers instead")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="target dtype (default %(default)s)")
    p.add_argument("--draft-dtype", default=None,
                   help="draft dtype (default: the draft's own choice; bfloat16 for the "
                        "distilled draft where the device supports it)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per process (default 1: on 2 shared cores, 2 threads per "
                        "process oversubscribe and a forward pass gets several times slower)")


def _cell_args(p: argparse.ArgumentParser) -> None:
    """The main cells: prompts, sizes, the k lists, the modes and which configurations run."""
    p.add_argument("--suite", type=Path, default=suite.DEFAULT_SUITE)
    p.add_argument("--per-category", type=int, help=f"prompts per category (full {FULL['per_category']})")
    p.add_argument("--max-new-tokens", type=int, help=f"(full {FULL['max_new_tokens']})")
    p.add_argument("--reps", type=int, help=f"repetitions, >= 3 for a median (full {FULL['reps']})")
    p.add_argument("--k", help=f"greedy draft k list, e.g. 1-8 or 1,2,4 (full {FULL['k']})")
    p.add_argument("--sampling-k", help=f"sampling draft k list (full {FULL['sampling_k']})")
    p.add_argument("--parallel-k", help=f"parallel-speculation draft k list, both modes; '' for "
                                        f"none (full {FULL['parallel_k']})")
    p.add_argument("--lookup-k", help=f"prompt-lookup k list (full {FULL['lookup_k']})")
    p.add_argument("--combined-k", help=f"combined proposer (lookup or draft per round) k list; '' "
                                        f"for none (full {FULL['combined_k']})")
    p.add_argument("--peer-k", help=f"in-process assisted k list (full {FULL['peer_k']})")
    p.add_argument("--tree-k", help="draft k list with token trees (svc-draft-tree{N}-k{K}, through a "
                                    "second orchestrator started with --tree-nodes N); '' for none (the "
                                    "default)")
    p.add_argument("--tree-nodes", type=int, default=12, help="N: the trees' node budget (default 12)")
    p.add_argument("--tree-width", type=int, default=3, help="candidates per tree node (default 3)")
    p.add_argument("--no-auto", action="store_true",
                   help="skip svc-draft-auto (adaptive k); with --orchestrator it is only adaptive "
                        "if that orchestrator runs with --default-k auto")
    p.add_argument("--modes", default="greedy,sampling")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--no-peer", action="store_true", help="skip the in-process peer")
    p.add_argument("--no-default", action="store_true",
                   help="skip svc-default (a request naming neither proposer nor k: the orchestrator's "
                        "default configuration)")


def _phase_args(p: argparse.ArgumentParser) -> None:
    """The later phases: the RTT sweep, the rate cap, the predicted- and structured-output cells."""
    p.add_argument("--no-network", action="store_true", help="skip the RTT and rate phases")
    p.add_argument("--rtts", help=f"RTT sweep, ms (full {FULL['rtts']})")
    p.add_argument("--rtt-k", help=f"draft k values in the RTT sweep (full {FULL['rtt_k']})")
    p.add_argument("--rtt-prompts", type=int, help=f"prompts in the RTT sweep (full {FULL['rtt_prompts']})")
    p.add_argument("--rates", help=f"link rate caps, Mbit/s, 0 = uncapped (full {FULL['rates']})")
    p.add_argument("--rate-k", help=f"draft k values under the rate cap (full {FULL['rate_k']})")
    p.add_argument("--rate-rtt", type=float, help="RTT during the rate phase, ms (default 0)")
    p.add_argument("--rate-prompts", type=int, help=f"prompts in the rate phase (full {FULL['rate_prompts']})")
    p.add_argument("--rate-top-p", type=float, default=1.0,
                   help="top_p in the rate phase (default 1.0: nothing truncated, so the "
                        "distributions travel dense, the case a rate cap hurts)")
    p.add_argument("--prediction-prompts", type=int,
                   help=f"edit prompts in the predicted-output cell, 0 to skip "
                        f"(full {FULL['prediction_prompts']})")
    p.add_argument("--prediction-tokens", type=int,
                   help=f"max_new_tokens there (full {FULL['prediction_tokens']})")
    p.add_argument("--structured-prompts", type=int,
                   help=f"schema/regex pairs in the structured-output cell, 0 to skip "
                        f"(full {FULL['structured_prompts']})")
    p.add_argument("--structured-tokens", type=int,
                   help=f"max_new_tokens there (full {FULL['structured_tokens']})")


def _resolved(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The --quick or full sizes where a flag was not given, the lists parsed, the checks."""
    sizes = QUICK if args.quick else FULL
    for key, value in sizes.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.k, args.sampling_k = _ints(args.k), _ints(args.sampling_k)
    args.lookup_k, args.peer_k = _ints(args.lookup_k), _ints(args.peer_k)
    args.combined_k, args.tree_k = _ints(args.combined_k), _ints(args.tree_k)
    args.parallel_k = _ints(args.parallel_k)
    args.rtts, args.rtt_k = _floats(args.rtts), _ints(args.rtt_k)
    args.rates, args.rate_k = _floats(args.rates), _ints(args.rate_k)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in args.modes:
        if mode not in (GREEDY, SAMPLING):
            p.error(f"--modes: unknown mode {mode!r}")
    if args.reps < 1 or args.max_new_tokens < 1 or args.per_category < 1:
        p.error("--reps, --max-new-tokens and --per-category must be >= 1")
    if args.orchestrator:
        args.no_network = True
    return args


def feature_draft(args) -> bool:
    """Whether the draft the services serve is a feature head (engine.model.drafts kind "eagle", or an
    EAGLE-3 head in the published layout)."""
    from draft_service.role import default_draft
    from engine.model import drafts, eagle3

    folder = args.draft or (None if args.draft_layers else default_draft())
    if not folder:
        return False
    return eagle3.is_eagle3_folder(Path(folder)) or (
        drafts.is_draft_folder(Path(folder)) and drafts.Manifest.read(Path(folder)).kind == drafts.EAGLE)


# ---------------------------------------------------------------------------- plan

def main_configs(args, mode: str) -> list[Config]:
    ks = args.k if mode == GREEDY else args.sampling_k
    configs = [Config("svc", "none")]
    configs += [Config("svc", "draft", k) for k in ks]
    configs += [Config("svc", "draft", k, parallel=True) for k in args.parallel_k]
    if not args.no_auto:
        configs.append(Config("svc", "draft", 0))  # k = 0: adaptive
    configs += [Config("svc", "lookup", k) for k in args.lookup_k]
    configs += [Config("svc", "combined", k) for k in args.combined_k]
    if not args.orchestrator:  # trees need an orchestrator of their own
        configs += [Config("svc", "draft", k, tree=args.tree_nodes) for k in args.tree_k]
    if not args.no_default:
        configs.append(Config("svc", "default"))  # no proposer, no k: what a plain request gets
    if not args.no_peer:
        configs.append(Config("hf", "target"))
        configs += [Config("hf", "assisted", k) for k in args.peer_k]
        configs += [Config("hf", "lookup", k) for k in args.lookup_k]
    return configs


def interleave(cells: list[tuple[str, Config, LinkSettings | None]], prompts, reps: int,
               phase: str, top_p: float | None = None) -> list[Item]:
    """Every cell once per prompt and repetition, the cell order rotated each time."""
    items = []
    turn = 0
    for rep in range(reps):
        for prompt in prompts:
            shift = turn % len(cells)
            for mode, config, link in cells[shift:] + cells[:shift]:
                items.append(Item(phase, mode, config, prompt, rep, link, top_p))
            turn += 1
    return items


def plan(args, prompts: list[suite.Prompt]) -> list[Item]:
    cells = [(mode, c, None) for mode in args.modes for c in main_configs(args, mode)]
    items = interleave(cells, prompts, args.reps, "main")
    if args.no_network:
        return items
    net_prompts = suite.subset(prompts, 1)
    if args.rtts and GREEDY in args.modes:
        configs = [Config("svc", "none")] + [Config("svc", "draft", k) for k in args.rtt_k]
        # The direct svc-none cell, interleaved with the rest, shows what the link itself costs.
        cells = [(GREEDY, Config("svc", "none"), None)]
        cells += [(GREEDY, c, LinkSettings(rtt_ms=r)) for r in args.rtts for c in configs]
        items += interleave(cells, net_prompts[: args.rtt_prompts], args.reps, "rtt")
    if args.rates and SAMPLING in args.modes:
        configs = [Config("svc", "none")] + [Config("svc", "draft", k) for k in args.rate_k]
        cells = [(SAMPLING, Config("svc", "none"), None)]
        cells += [(SAMPLING, c, LinkSettings(rtt_ms=args.rate_rtt, rate_mbps=r))
                  for r in args.rates for c in configs]
        items += interleave(cells, net_prompts[: args.rate_prompts], args.reps, "rate",
                            top_p=args.rate_top_p)
    return items


def prediction_phase(args, runner: ServiceRunner, prompts: list[suite.Prompt],
                     index: dict[str, int]) -> Iterator[dict]:
    """The predicted-output cell: per edit prompt and repetition, target-only, then the
    edited text as the prediction, then the target-only answer as the prediction."""
    chosen = [p for name in PREDICTION_PROMPTS[: args.prediction_prompts]
              for p in prompts if p.id == name]
    if chosen:
        print(f"predicted-output cell: {len(chosen)} prompts x {args.reps} reps", file=sys.stderr)
    for rep in range(args.reps):
        for prompt in chosen:
            source = prompt.messages[-1][1].split("\n\n", 1)[1]
            reference = None
            predicted = [Config("svc", "prediction", PREDICTION_K, prediction=kind)
                         for kind in ("source", "exact")]
            # None: the answer itself (the target-only text, run first).
            for config, text in zip([Config("svc", "none"), *predicted], ["", source, None]):
                item = Item("prediction", GREEDY, config, prompt, rep,
                            prediction=reference["text"] if text is None else text)
                result = runner.run(item, args, _seed(args, index[prompt.id]), args.prediction_tokens)
                reference = reference or result
                yield _record(item, args, args.prediction_tokens, result)


def structured_phase(args, runner: ServiceRunner) -> Iterator[dict]:
    """The structured-output cell: per pair and repetition, constrained target-only, then each of
    STRUCTURED_CONFIGS under the same grammar (the order rotated each time); each record says
    whether its text is valid for the pair (benchmarks.features.structured.valid)."""
    pairs = structured.load_pairs()[: args.structured_prompts]
    if not pairs:
        return
    configs = [Config("svc", "none")] + [Config("svc", c["proposer"], c["k"])
                                         for c in map(structured.CONFIGS.get, STRUCTURED_CONFIGS)]
    prompts = [suite.Prompt(f"structured-{p['id']}", "structured", (("user", p["prompt"]),))
               for p in pairs]
    grammars = [next(iter(structured.grammar(p).items())) for p in pairs]
    print(f"structured-output cell: {len(pairs)} pairs x {args.reps} reps", file=sys.stderr)
    # Warm-up, not recorded: the first constrained request builds the grammar's tokenizer.
    runner.run(Item("structured", GREEDY, configs[0], prompts[0], 0, grammar=grammars[0]), args,
               _seed(args, 0), 8)
    turn = 0
    for rep in range(args.reps):
        for i, (pair, prompt, grammar) in enumerate(zip(pairs, prompts, grammars)):
            shift = turn % len(configs)
            for config in configs[shift:] + configs[:shift]:
                item = Item("structured", GREEDY, config, prompt, rep, grammar=grammar)
                result = runner.run(item, args, _seed(args, i), args.structured_tokens)
                result.update(pair_id=pair["id"], constraint=grammar[0],
                              valid=structured.valid(pair, result["text"]))
                yield _record(item, args, args.structured_tokens, result)
            turn += 1


def _record(item: Item, args, max_new_tokens: int, result: dict) -> dict:
    """One request's record (records.jsonl): the cell it belongs to, then its figures."""
    return {
        "phase": item.phase, "mode": item.mode, "config": item.config.name,
        "family": item.config.family, "proposer": item.config.proposer,
        "k": item.config.k, "adaptive": item.config.adaptive,
        "parallel": item.config.parallel,
        "prompt_id": item.prompt.id,
        "category": item.prompt.category, "rep": item.rep,
        "max_new_tokens": max_new_tokens,
        "top_p": (item.top_p or args.top_p) if item.mode == SAMPLING else None,
        "rtt_ms": item.link.rtt_ms if item.link else None,
        "rate_mbps": item.link.rate_mbps if item.link else None,
        **result,
    }


# ---------------------------------------------------------------------------- requests

def _message_dict(message) -> dict:
    """Every field of a protobuf message, repeated fields as lists, nested
    messages (Stats.rounds) as dicts."""
    out = {}
    for f in message.DESCRIPTOR.fields:
        value = getattr(message, f.name)
        convert = _message_dict if f.message_type is not None else (lambda v: v)
        out[f.name] = [convert(v) for v in value] if f.is_repeated else convert(value)
    return out


def _seed(args, prompt_index: int) -> int:
    return args.seed + prompt_index + 1  # the same per prompt for every config and repetition


class ServiceRunner:
    """Generate requests against one orchestrator (direct or through the link)."""

    def __init__(self, address: str, *, traced: bool = False) -> None:
        from specdec.v1 import orchestrator_pb2_grpc

        self.traced = traced  # send a traceparent with each request, so its trace id is known
        self.channel = grpc.insecure_channel(address)
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)

    def run(self, item: Item, args, seed: int, max_new_tokens: int) -> dict:
        from specdec.v1 import common_pb2, orchestrator_pb2 as pb

        # A registered kind's name; the default and a prediction leave it unset.
        proposer = "" if item.config.proposer in ("default", "prediction") else item.config.proposer
        sampling = (common_pb2.SamplingParams(temperature=0.0) if item.mode == GREEDY else
                    common_pb2.SamplingParams(temperature=args.temperature,
                                              top_p=item.top_p or args.top_p))
        request = pb.GenerateRequest(
            messages=[pb.ChatMessage(role=r, content=c) for r, c in item.prompt.messages],
            max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, proposer_name=proposer,
            k=item.config.k, strict=True,
            speculation=(pb.SPECULATION_UNSPECIFIED if item.config.proposer == "default" else
                         pb.SPECULATION_PARALLEL if item.config.parallel else pb.SPECULATION_SEQUENTIAL),
            prediction=item.prediction,
        )
        if item.grammar:
            request.constraint.CopyFrom(pb.Constraint(**dict([item.grammar])))
        token_ids: list[int] = []
        texts: list[str] = []
        stats = None
        ttft = None
        trace_id = secrets.token_hex(16) if self.traced else ""
        metadata = [("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-01")] if trace_id else None
        start = time.perf_counter()
        for event in self.stub.Generate(request, timeout=600, metadata=metadata):
            if event.HasField("chunk"):
                if ttft is None and event.chunk.token_ids:
                    ttft = time.perf_counter() - start
                token_ids.extend(event.chunk.token_ids)
                texts.append(event.chunk.text)
            else:
                stats = event.stats
        wall = time.perf_counter() - start
        if stats is None:
            raise RuntimeError(f"{item.config.name} {item.prompt.id}: stream ended without Stats")
        # Not timed: free the session's KV on both services (a single-turn session has no id left).
        if stats.session_id:
            self.stub.EndSession(pb.EndSessionRequest(session_id=stats.session_id), timeout=30)
        s = _message_dict(stats)
        return dict(token_ids=token_ids, text="".join(texts), new_tokens=len(token_ids), wall_s=wall,
                    ttft_s=ttft if ttft is not None else wall, target_passes=s["target_passes"],
                    draft_passes=s["draft_calls"], prompt_tokens=s["prompt_tokens"], stats=s,
                    **({"trace_id": trace_id} if trace_id else {}))

    def close(self) -> None:
        self.channel.close()


class PeerRunner:
    """The in-process peer on the same weights, loaded with the services' loader."""

    def __init__(self, args) -> None:
        from draft_service.role import default_draft
        from engine.model.loader import load

        self.target = load(args.target, device=args.device, dtype=args.dtype)
        self.draft = None
        if args.draft_layers and not args.draft:
            self.draft = load(args.target, device=args.device, dtype=args.draft_dtype,
                              num_layers=args.draft_layers)
        elif args.peer_k:  # (a feature head has no assisted peer: parse_args emptied peer_k)
            self.draft = load(args.draft or default_draft(), device=args.device,
                              dtype=args.draft_dtype)
        self.eos = list(self.target.eos_token_ids)
        self._ids: dict[str, object] = {}

    def input_ids(self, prompt: suite.Prompt):
        import torch

        from orchestrator.common.text import encode_prompt

        if prompt.id not in self._ids:
            ids = encode_prompt(self.target.tokenizer, "", prompt.messages)
            self._ids[prompt.id] = torch.tensor([ids], dtype=torch.long, device=self.target.device)
        return self._ids[prompt.id]

    def run(self, item: Item, args, seed: int, max_new_tokens: int) -> dict:
        from benchmarks.inprocess import PeerConfig, generate

        cfg = PeerConfig(item.config.proposer, item.config.k)
        temperature = 0.0 if item.mode == GREEDY else args.temperature
        r = generate(self.target.model, self.draft.model if self.draft else None, self.input_ids(item.prompt), cfg,
                     max_new_tokens=max_new_tokens, temperature=temperature, top_p=args.top_p,
                     seed=seed, eos_token_ids=self.eos)
        return dict(token_ids=r.token_ids, new_tokens=len(r.token_ids), wall_s=r.wall_s,
                    ttft_s=r.ttft_s, target_passes=r.target_passes, draft_passes=r.draft_passes,
                    prompt_tokens=r.prompt_tokens)


# ---------------------------------------------------------------------------- environment

def environment(args, stack, model_info: dict) -> dict:
    import grpc as grpc_mod
    import torch
    import transformers

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "threads_per_process": args.threads,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "grpcio": grpc_mod.__version__,
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "target_model": model_info.get("target", {}).get("model_name", args.target or "embedded"),
        "draft_model": model_info.get("draft", {}).get("model_name", args.draft or ("early exit" if args.draft_layers else "default draft")),
        "models": model_info,
        "stack": "started by benchmarks.run" if stack else f"external orchestrator {args.orchestrator}",
    }


def _model_info(stack) -> dict:
    if stack is None:
        return {}
    from specdec.v1 import common_pb2, model_pb2_grpc

    out = {}
    for role, address, stub_type in (("target", stack.target_address, model_pb2_grpc.TargetServiceStub),
                                     ("draft", stack.draft_address, model_pb2_grpc.DraftServiceStub)):
        with grpc.insecure_channel(address) as channel:
            info = stub_type(channel).GetInfo(common_pb2.GetInfoRequest(), timeout=10)
            out[role] = _message_dict(info)
    return out


# ---------------------------------------------------------------------------- main

def _json_safe(value):
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _progress(total: int):
    try:
        from tqdm import tqdm

        return tqdm(total=total, unit="req", dynamic_ncols=True, file=sys.stderr)
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None


class Terminated(Exception):
    """SIGTERM arrived: stop the stack and write what was measured."""


def _on_sigterm(signum, _frame) -> None:
    raise Terminated(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    from benchmarks.stack import prepare_run

    workdir = prepare_run(args, "specdec-bench-")
    if args.peer_k and feature_draft(args):
        print("the draft is a feature head, which transformers' assistant_model= cannot run: "
              "no hf-assisted configurations", file=sys.stderr)
        args.peer_k = []

    prompts = suite.subset(suite.load(args.suite), args.per_category)
    items = plan(args, prompts)
    started = time.time()
    link_note = {} if args.no_network else _link_note()
    print(f"benchmarks.run: {len(prompts)} prompts x {args.reps} reps, {len(items)} requests; "
          f"out {args.out}", file=sys.stderr)

    stack = None
    runners: dict[str, object] = {}
    records: list[dict] = []  # what was measured, written out whatever happens
    failure: str | None = None
    model_info: dict = {}
    try:
        if not args.orchestrator:
            stack = _stack(args, workdir)
        _start(args, stack, runners)
        model_info = _model_info(stack)
        _measure(args, items, stack, runners, records)
    except BaseException as exc:  # noqa: BLE001 - still write what was measured
        failure = f"{type(exc).__name__}: {exc}"
        if stack is not None:
            for log in stack.logs():
                tail = log.read_text(errors="replace").splitlines()[-15:]
                print(f"--- {log.name} (tail)\n" + "\n".join(tail), file=sys.stderr)
            print(f"service logs kept in {workdir / 'logs'}", file=sys.stderr)
        raise
    finally:
        for runner in runners.values():
            if hasattr(runner, "close"):
                runner.close()
        if stack is not None:
            stack.stop()
        if records or failure:
            _write(args, records, stack, link_note, started, failure, model_info)

    shutil.rmtree(workdir, ignore_errors=True)  # kept (with the service logs) only on failure
    return _verdict(args, started)


def _link_note() -> dict:
    """What the network phases' link is, for the report."""
    ok, why = netem_available()
    return {
        "kind": "emulated link (userspace proxy)",
        "netem_available": ok,
        "netem_probe": why,
        "note": "a TCP proxy per service holds every chunk for RTT/2 each way after "
                "serialising it at the rate cap (like netem delay + tbf); the sweep uses it "
                "even where netem works, so results compare across machines",
    }


def _stack(args, workdir: Path):
    """The benchmark's own target, draft and orchestrator(s), not started yet."""
    from benchmarks.stack import Stack, StackSpec

    return Stack(StackSpec(target=args.target, draft=args.draft,
                           draft_layers=args.draft_layers, device=args.device,
                           dtype=args.dtype, draft_dtype=args.draft_dtype,
                           threads=args.threads, trace_dir=args.trace_dir,
                           redis_url=args.redis_url, log_dir=workdir / "logs"))


def _start(args, stack, runners: dict[str, object]) -> None:
    """Start the stack (without one: --orchestrator) and fill `runners`: "direct", "linked", "peer"."""
    if args.orchestrator:
        runners["direct"] = ServiceRunner(args.orchestrator, traced=args.trace_dir is not None)
    else:
        print("starting target, draft and orchestrator...", file=sys.stderr)
        stack.start(with_link=not args.no_network)
        traced = args.trace_dir is not None
        runners["direct"] = ServiceRunner(stack.orchestrator_address, traced=traced)
        if stack.linked_address:
            runners["linked"] = ServiceRunner(stack.linked_address, traced=traced)
        if args.tree_k:  # token trees: an orchestrator with --tree-nodes on the same services
            address = stack.start_orchestrator(stack.target_address, stack.draft_address, "orchestrator-tree",
                                               extra=("--tree-nodes", str(args.tree_nodes),
                                                      "--tree-width", str(args.tree_width)))
            runners["tree"] = ServiceRunner(address, traced=traced)
    if not args.no_peer:
        print("loading the in-process peer...", file=sys.stderr)
        runners["peer"] = PeerRunner(args)


def _measure(args, items: list[Item], stack, runners: dict[str, object], records: list[dict]) -> None:
    """Every planned request, then the predicted- and structured-output cells; each record is
    appended to `records` and to records.jsonl as it comes."""
    index = {p.id: i for i, p in enumerate(suite.load(args.suite))}

    def runner_for(item: Item):
        if item.config.family == "hf":
            return runners["peer"]
        if item.config.tree:
            return runners["tree"]
        if item.link is not None:
            stack.links[0].set(item.link)
            stack.links[1].set(item.link)
            return runners["linked"]
        return runners["direct"]

    _warm_up(args, items, runner_for)
    raw = (args.out / "records.jsonl").open("w")
    bar = _progress(len(items))
    for item in items:
        if bar is not None:
            bar.set_description(f"{item.phase} {item.mode[:4]} {item.config.name}", refresh=False)
        result = runner_for(item).run(item, args, _seed(args, index[item.prompt.id]),
                                      args.max_new_tokens)
        record = _record(item, args, args.max_new_tokens, result)
        records.append(record)
        raw.write(json.dumps(record) + "\n")
        raw.flush()
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    for record in itertools.chain(
            prediction_phase(args, runners["direct"], suite.load(args.suite), index),
            structured_phase(args, runners["direct"])):
        records.append(record)
        raw.write(json.dumps(record) + "\n")
    raw.close()


def _warm_up(args, items: list[Item], runner_for) -> None:
    """Each distinct (runner, mode, config) once, short, not recorded; its seconds per token give a
    rough estimate of the whole run."""
    per_token: dict[tuple, float] = {}
    for item in items:
        key = (item.link, item.mode, item.config)
        if key not in per_token:
            r = runner_for(item).run(item, args, _seed(args, 0), min(8, args.max_new_tokens))
            per_token[key] = r["wall_s"] / max(1, r["new_tokens"])
    eta = sum(per_token[(i.link, i.mode, i.config)] for i in items) * args.max_new_tokens
    print(f"estimated measuring time ~{eta / 60:.1f} min (from the warm-up)", file=sys.stderr)


def _verdict(args, started: float) -> int:
    """0, or 1 with the list when a greedy speculative output differs from target-only."""
    checks = json.loads((args.out / "results.json").read_text())["checks"]
    print(f"wrote {args.out}/results.json, results.md, plots "
          f"({time.time() - started:.0f} s)", file=sys.stderr)
    if not checks["greedy_passed"]:
        bad = checks["greedy_mismatches"]
        print(f"GREEDY IDENTITY FAILED: {len(bad)} speculative outputs differ from target-only:",
              file=sys.stderr)
        for m in bad:
            print(f"  {m['prompt_id']} {m['config']} phase={m['phase']} rep={m['rep']} "
                  f"first difference at token {m['first_difference']}", file=sys.stderr)
        return 1
    return 0


def _write(args, records, stack, link_note, started, failure, model_info) -> None:
    settings = {
        "command": "python -m benchmarks.run " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "quick": args.quick, "tiny": args.tiny, "device": args.device, "dtype": args.dtype,
        "threads": args.threads, "suite": str(Path(args.suite).name),
        "per_category": args.per_category,
        "n_prompts": len({r["prompt_id"] for r in records if r["phase"] == "main"}),
        "prediction_prompts": args.prediction_prompts, "prediction_tokens": args.prediction_tokens,
        "structured_prompts": args.structured_prompts, "structured_tokens": args.structured_tokens,
        "max_new_tokens": args.max_new_tokens, "reps": args.reps, "k": args.k,
        "sampling_k": args.sampling_k, "parallel_k": args.parallel_k, "lookup_k": args.lookup_k, "peer_k": args.peer_k,
        "adaptive": not args.no_auto,
        "modes": args.modes, "temperature": args.temperature, "top_p": args.top_p,
        "rtts": args.rtts, "rtt_k": args.rtt_k, "rates": args.rates, "rate_k": args.rate_k,
        "rate_rtt": args.rate_rtt, "rate_prompts": args.rate_prompts,
        "rate_top_p": args.rate_top_p, "rtt_prompts": args.rtt_prompts, "seed": args.seed, "elapsed_s": time.time() - started,
        "failure": failure,
    }
    result = {
        "environment": environment(args, stack, model_info),
        "settings": settings,
        "link": link_note,
        "records": records,
        **analysis.analyse(records),
    }
    report.render(result, args.out)
    (args.out / "results.json").write_text(json.dumps(_json_safe(result), indent=1))

