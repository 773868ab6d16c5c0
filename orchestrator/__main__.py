"""python -m orchestrator: serve the Orchestrator gRPC API.

    python -m orchestrator --target 127.0.0.1:50061 --draft 127.0.0.1:50062 \\
        --redis-url redis://127.0.0.1:6379/0 --tokenizer /path/to/target/folder

Redis (--redis-url, default redis://127.0.0.1:6379/0) holds the sessions and
the service registry, under --redis-prefix.
Replicas are discovered from the Redis service registry; --target/--draft are
the fallback when the registry lists none. At start-up the orchestrator asks
the target (and draft) for GetInfo and refuses to serve when their tokenizers
differ from each other or from its own.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
import time
from functools import partial

from typing import TYPE_CHECKING

# The bootstrap imports no torch and no model hosting: the loop's modules (torch, through
# the core's sampling) load in build_config, after the flags are parsed.
from orchestrator.capacity import CapacityPolicy, TargetAdmission
from orchestrator.costs import CostBook
from orchestrator.deadlines import DeadlinePolicy
from orchestrator.kinds import GUESS, KINDS
from orchestrator.outliers import OutlierPolicy, ReplicaHealth
from orchestrator.remote import BatchCalls, ModelClient, ServiceDown
from orchestrator.routing import Router
from orchestrator.text import load_tokenizer
from specdec.core.fingerprint import tokenizer_fingerprint
from specdec.server import (
    add_server_args, configure_logging, env_default, env_flag, options_from_args, serve,
)
from specdec.limits import add_admission_args, admission_from_args
from specdec.security import add_service_client_args, service_client_from_args
from specdec.store import SESSION_TTL_S, ServiceRegistry, SessionStore, connect
from specdec.v1 import orchestrator_pb2_grpc

if TYPE_CHECKING:
    from orchestrator.spec import LoopConfig

log = logging.getLogger("orchestrator")
DEFAULT_PORT = 50050


class StartupError(RuntimeError):
    """The orchestrator cannot serve with this configuration (message says why)."""


def _addresses(values: list[str]) -> list[str]:
    return [a.strip() for v in values for a in v.split(",") if a.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m orchestrator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(p, default_port=DEFAULT_PORT, auth="tenants")
    add_service_client_args(p)
    add_admission_args(p)
    g = p.add_argument_group("orchestrator")
    g.add_argument("--target", action="append", default=[env_default("target", "")],
                   help="static target address(es), comma-separated or repeated [SPECDEC_TARGET]")
    g.add_argument("--draft", action="append", default=[env_default("draft", "")],
                   help="static draft address(es) [SPECDEC_DRAFT]")
    g.add_argument("--tokenizer", default=env_default("tokenizer", None),
                   help="the target's model folder or .gguf (for its tokenizer and chat template); "
                        "default: the embedded default target [SPECDEC_TOKENIZER]")
    g.add_argument("--session-ttl", type=int, default=env_default("session_ttl", SESSION_TTL_S),
                   help="seconds an idle session is kept [SPECDEC_SESSION_TTL]")
    g.add_argument("--redis-outage-s", type=float, default=env_default("redis_outage_s", 5.0),
                   help="a Redis outage up to this many seconds is invisible to streams (writes "
                        "are retried, reads at session start too); past it a stream ends with "
                        "UNAVAILABLE and its committed tokens are saved once Redis answers "
                        "[SPECDEC_REDIS_OUTAGE_S]")
    g.add_argument("--record-interval-ms", type=float, default=env_default("record_interval_ms", 200.0),
                   help="write a session's record after a round only if the last write began at least "
                        "this long ago (a turn's last state, and a failed turn's, are always written; a "
                        "record behind by a few rounds only costs a resumed turn some KV reuse) "
                        "[SPECDEC_RECORD_INTERVAL_MS] (default %(default)s)")
    g.add_argument("--default-proposer", choices=[k for k in KINDS if k != GUESS],
                   default=env_default("default_proposer", "combined"),
                   help="proposer when a request leaves it unspecified [SPECDEC_DEFAULT_PROPOSER]")
    g.add_argument("--default-k", default=env_default("default_k", "5"),
                   help="drafted tokens per round when a request sends k = 0, or 'auto': pick k "
                        "each round from the observed acceptance and draft/target costs "
                        "[SPECDEC_DEFAULT_K]")
    g.add_argument("--parallel", action=argparse.BooleanOptionalAction,
                   default=env_flag("parallel", False),
                   help="parallel speculation by default: the draft drafts the next round while "
                        "the target verifies this one (requests may choose either; "
                        "orchestrator.parallel) [SPECDEC_PARALLEL]")
    g.add_argument("--speculation-gate", action=argparse.BooleanOptionalAction,
                   default=env_flag("speculation_gate", True),
                   help="for requests that give no k: measure each target replica's tokens/s with and "
                        "without drafting, in alternating epochs per load level, and draft only where "
                        "it measured faster (orchestrator.gate) [SPECDEC_SPECULATION_GATE] (default on)")
    g.add_argument("--max-new-tokens-limit", type=int,
                   default=env_default("max_new_tokens_limit", 4096),
                   help="largest max_new_tokens a request may ask for")
    g.add_argument("--rpc-timeout", type=float, default=env_default("rpc_timeout", 60.0),
                   help="seconds before a model-service call counts as down")
    g.add_argument("--startup-timeout", type=float, default=env_default("startup_timeout", 60.0),
                   help="seconds to wait for a target replica at start-up")
    g.add_argument("--threads", type=int, default=env_default("threads", 1),
                   help="torch CPU threads (verification is light) [SPECDEC_THREADS]")
    b = p.add_argument_group("batch calls (orchestrator.batching): many sessions' calls to one replica in one RPC")
    b.add_argument("--batch-calls", action=argparse.BooleanOptionalAction,
                   default=env_flag("batch_calls", True),
                   help="gather this orchestrator's Score/Propose calls to a replica into ScoreBatch/"
                        "ProposeBatch RPCs; off (or with tracing on) every call is its own RPC "
                        "[SPECDEC_BATCH_CALLS] (default on)")
    b.add_argument("--batch-max-wait-ms", type=float, default=env_default("batch_max_wait_ms", 20.0),
                   help="longest a gathered call waits for this orchestrator's other live sessions "
                        "on the same replica (never when they are all there; at most half a batch "
                        "RPC's measured time) [SPECDEC_BATCH_MAX_WAIT_MS] (default %(default)s)")
    b.add_argument("--batch-max-items", type=int, default=env_default("batch_max_items", 64),
                   help="calls in one batch RPC [SPECDEC_BATCH_MAX_ITEMS] (default %(default)s)")
    g.add_argument("--text-threads", type=int, default=env_default("text_threads", 2),
                   help="threads tokenising, templating and decoding off the event loop "
                        "[SPECDEC_TEXT_THREADS]")
    add_gray_args(p)
    args = p.parse_args(argv)
    args.redis_url = args.redis_url or "redis://127.0.0.1:6379/0"
    args.target = _addresses(args.target)
    args.draft = _addresses(args.draft)
    return args


def add_gray_args(p: argparse.ArgumentParser) -> None:
    """Deadlines, outlier routing and overload shedding (orchestrator.deadlines, .outliers, .capacity)."""
    d, o, c = DeadlinePolicy(), OutlierPolicy(), CapacityPolicy()
    g = p.add_argument_group("gray failures and overload")

    def flag(name: str, kind: type, default, text: str) -> None:
        env = name.replace("-", "_")
        g.add_argument(f"--{name}", type=kind, default=env_default(env, default),
                       help=f"{text} [SPECDEC_{env.upper()}] (default %(default)s)")

    flag("deadline-factor", float, d.factor, "a model-service call's deadline, x that replica's usual "
         "wall time for the same size of work (0 = no learned deadlines: --rpc-timeout only)")
    flag("deadline-floor-ms", float, d.floor_ms, "shortest learned deadline")
    flag("deadline-cold-s", float, d.cold_s, "deadline before any call of a role has answered")
    flag("outlier-ratio", float, o.slow_ratio, "eject a replica whose wall time for the same work is "
         "this x its peers' median (0 = off)")
    flag("eject-s", float, o.eject_s, "an ejected replica is probed after this long, doubling while "
         "its probes fail")
    flag("max-eject-s", float, o.max_eject_s, "longest time between probes of an ejected replica")
    flag("target-wait-s", float, 10.0, "how long a round (or a new session) waits for some target "
         "replica to answer when none other is usable; then UNAVAILABLE")
    flag("target-capacity", int, c.sessions, "streams per target replica (0 = measured from its "
         "batches and queues: orchestrator.capacity)")
    flag("capacity-pace", float, c.pace, "measured capacity also caps a replica at the sessions whose "
         "shared forward costs at most this x a lone session's, fed back from the admitted streams' "
         "measured pace (0 = off: the batch size and queue saturation only)")
    flag("admission-queue", int, c.queue_depth, "streams that may wait for a target slot at once "
         "(more: RESOURCE_EXHAUSTED admission_queue)")
    flag("admission-wait-s", float, c.wait_s, "longest wait for a target slot (then "
         "RESOURCE_EXHAUSTED target_capacity, with retry-after)")


def gray_from_args(args: argparse.Namespace, costs: CostBook) -> tuple[ReplicaHealth, TargetAdmission]:
    deadlines = DeadlinePolicy(factor=args.deadline_factor, floor_ms=args.deadline_floor_ms,
                               cold_s=args.deadline_cold_s)
    outliers = OutlierPolicy(slow_ratio=args.outlier_ratio, eject_s=args.eject_s,
                             max_eject_s=max(args.eject_s, args.max_eject_s))
    capacity = CapacityPolicy(sessions=args.target_capacity, pace=args.capacity_pace,
                              queue_depth=args.admission_queue, wait_s=args.admission_wait_s)
    return ReplicaHealth(deadlines, outliers), TargetAdmission(capacity, costs)


async def build_config(args: argparse.Namespace) -> LoopConfig:
    """Load the tokenizer, reach Redis and the services, check they all agree."""
    from orchestrator.spec import LoopConfig

    tokenizer, folder = load_tokenizer(args.tokenizer)
    fingerprint = tokenizer_fingerprint(tokenizer)
    client = connect(args.redis_url)
    store = SessionStore(client, url=args.redis_url, prefix=args.redis_prefix, ttl_s=args.session_ttl)
    registry = ServiceRegistry(client, url=args.redis_url, prefix=args.redis_prefix)
    try:
        await store.ping()
    except Exception as exc:  # noqa: BLE001 - serve anyway; requests get UNAVAILABLE
        log.warning("%s; requests will fail with UNAVAILABLE until it answers", exc)
        registry = None
    security = service_client_from_args(args)
    batch = BatchCalls(enabled=bool(args.batch_calls), max_items=max(1, int(args.batch_max_items)),
                       max_wait_s=max(0.0, float(args.batch_max_wait_ms)) / 1e3)
    costs = CostBook()
    health, admission = gray_from_args(args, costs)
    router = Router(registry, {"target": args.target, "draft": args.draft}, health=health,
                    fingerprint=fingerprint, timeout_s=args.rpc_timeout,
                    connect=lambda address, role: ModelClient(
                        address, role, timeout_s=args.rpc_timeout, security=security, batch=batch))

    target_info = await _first_info(router, "target", args.startup_timeout)
    if target_info is None:
        raise StartupError("no target service answered GetInfo (give --target or register one in Redis)")
    if target_info.tokenizer_fingerprint != fingerprint:
        raise StartupError(
            f"the target {target_info.model_name!r} has another tokenizer than --tokenizer {folder} "
            f"(fingerprints {target_info.tokenizer_fingerprint[:12]} vs {fingerprint[:12]})"
        )
    max_k = int(target_info.max_k) or 16
    if target_info.max_request_tokens:  # a Score carries the k drafts and one committed token
        max_k = max(1, min(max_k, int(target_info.max_request_tokens) - 1))
    draft_info = await _first_info(router, "draft", 5.0)
    if draft_info is not None:
        if (draft_info.tokenizer_fingerprint != target_info.tokenizer_fingerprint
                or draft_info.vocab_size != target_info.vocab_size):
            raise StartupError(
                f"draft {draft_info.model_name!r} and target {target_info.model_name!r} do not "
                f"share a vocabulary (tokenizer fingerprints {draft_info.tokenizer_fingerprint[:12]} "
                f"vs {target_info.tokenizer_fingerprint[:12]}, vocab sizes {draft_info.vocab_size} "
                f"vs {target_info.vocab_size}); refusing to pair them"
            )
        max_k = min(max_k, int(draft_info.max_k) or max_k)
    else:
        log.warning("no draft service answered; proposer 'draft' will fall back to target-only")
    log.info("target %s (vocab %d, context %d), draft %s, tokenizer %s",
             target_info.model_name, target_info.vocab_size, target_info.context_length,
             draft_info.model_name if draft_info else "none", folder)
    return LoopConfig(
        store=store,
        router=router,
        tokenizer=tokenizer,
        eos_ids=frozenset(target_info.eos_token_ids),
        context_length=int(target_info.context_length),
        max_k=max_k,
        target_max_k=int(target_info.max_k) or 16,
        default_k=min(5 if args.default_k == "auto" else int(args.default_k), max_k),
        adaptive_k=args.default_k == "auto",
        default_proposer=args.default_proposer,
        parallel=args.parallel,
        max_new_tokens_limit=args.max_new_tokens_limit,
        redis_outage_s=args.redis_outage_s,
        record_interval_s=max(0.0, float(args.record_interval_ms)) / 1e3,
        speculation_gate=bool(args.speculation_gate),
        costs=costs,
        admission=admission,
        target_wait_s=args.target_wait_s,
    )


async def _first_info(router: Router, role: str, timeout_s: float):
    """GetInfo from the first replica of `role` that answers, retrying until `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            options = await router.candidates(role)
        except Exception:  # noqa: BLE001 - registry down: static addresses only
            options = [(a, 0.0, 0.0) for a in router.static.get(role, [])]
        for address, _, _ in options:
            try:
                return await router.client(address, role).get_info()
            except ServiceDown:
                continue
        if not options and role == "draft" or time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.2)


async def main_async(args: argparse.Namespace) -> None:
    from orchestrator.servicer import OrchestratorServicer

    config = await build_config(args)
    limits = admission_from_args(args)
    servicer = OrchestratorServicer(config, limits, text_threads=args.text_threads)
    options = dataclasses.replace(options_from_args(args),
                                  max_receive_bytes=limits.grpc_receive_bytes)
    await serve(
        [partial(orchestrator_pb2_grpc.add_OrchestratorServicer_to_server, servicer)],
        ["specdec.v1.Orchestrator"],
        options,
    )
    await config.router.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    import torch

    torch.set_num_threads(max(1, args.threads))
    try:
        asyncio.run(main_async(args))
    except StartupError as exc:
        log.error("refusing to start: %s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
