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
import time
from functools import partial
from typing import TYPE_CHECKING

# The bootstrap imports no torch and no model hosting: the loop's modules (torch, through
# the core's sampling) load in build_config, after the flags are parsed.
from orchestrator.policy.capacity import CapacityPolicy, TargetAdmission
from orchestrator.policy.costs import CostBook
from orchestrator.fleet.deadlines import DeadlinePolicy
from orchestrator.fleet.identity import PeerRoles
from orchestrator.fleet.outliers import OutlierPolicy, ReplicaHealth
from orchestrator.fleet.remote import BatchCalls, ModelClient, ServiceDown
from orchestrator.fleet.routing import Router
from orchestrator.api.settings import orchestrator_settings
from orchestrator.common.text import load_tokenizer
from orchestrator.proposers.bridge import TextBridge
from specdec.core.bounds import MAX_K
from specdec.core.fingerprint import tokenizer_fingerprint
from specdec.runtime.limits import request_limits_from_args, tenant_limits_from_args
from specdec.runtime.security import TokenTable, service_client_from_args
from specdec.runtime import loop as event_loop
from specdec.runtime.server import configure_logging, options_from_args, serve
from specdec.runtime.store import Expected, ServiceRegistry, SessionStore, connect
from specdec.v1 import orchestrator_pb2_grpc

if TYPE_CHECKING:
    from orchestrator.config import LoopConfig

log = logging.getLogger("orchestrator")


class StartupError(RuntimeError):
    """The orchestrator cannot serve with this configuration (message says why)."""


def _addresses(values: list[str]) -> list[str]:
    return [a.strip() for v in values for a in v.split(",") if a.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = orchestrator_settings(__doc__).parse(argv)
    args.redis_url = args.redis_url or "redis://127.0.0.1:6379/0"
    args.target = _addresses(args.target)
    args.draft = _addresses(args.draft)
    return args


def gray_from_args(args: argparse.Namespace, costs: CostBook) -> tuple[ReplicaHealth, TargetAdmission]:
    deadlines = DeadlinePolicy(factor=args.deadline_factor, floor_ms=args.deadline_floor_ms,
                               cold_s=args.deadline_cold_s)
    outliers = OutlierPolicy(slow_ratio=args.outlier_ratio, eject_s=args.eject_s,
                             max_eject_s=max(args.eject_s, args.max_eject_s))
    if not 0 < float(args.tenant_share) <= 1:
        raise StartupError(f"--tenant-share: must be in (0, 1], got {args.tenant_share}")
    if args.suffix_cache_tokens < 0:
        raise StartupError(f"--suffix-cache-tokens: must be >= 0, got {args.suffix_cache_tokens}")
    capacity = CapacityPolicy(sessions=args.target_capacity, pace=args.capacity_pace,
                              queue_depth=args.admission_queue, wait_s=args.admission_wait_s,
                              tenant_share=float(args.tenant_share))
    tenants = len(TokenTable.from_file(args.auth_tokens).tenants) if args.auth_tokens else 1
    return ReplicaHealth(deadlines, outliers), TargetAdmission(capacity, costs, tenants=tenants)


def _tokenizer(args: argparse.Namespace) -> tuple[object, str]:
    """(tokenizer, folder) of --tokenizer at --tokenizer-revision, with --chat-template's template."""
    from engine.model.loader import read_chat_template, resolve

    try:
        path, _ = resolve(args.tokenizer, args.tokenizer_revision, flag="--tokenizer")
        tokenizer, folder = load_tokenizer(str(path))
        if args.chat_template:
            tokenizer.chat_template = read_chat_template(args.chat_template)
            log.info("chat template: %s", args.chat_template)
    except (OSError, ValueError) as exc:  # no such folder, a Hub id not to be had, a broken template
        raise StartupError(str(exc)) from None
    return tokenizer, folder


async def build_config(args: argparse.Namespace) -> LoopConfig:
    """Load the tokenizer, reach Redis and the services, check they all agree."""
    from orchestrator.config import LoopConfig

    tokenizer, folder = _tokenizer(args)
    fingerprint = tokenizer_fingerprint(tokenizer)
    client = connect(args.redis_url)
    store = SessionStore(client, url=args.redis_url, prefix=args.redis_prefix, ttl_s=args.record_ttl)
    expected = Expected(fingerprint)  # registry entries must carry our tokenizer (and, below, model)
    registry = ServiceRegistry(client, url=args.redis_url, prefix=args.redis_prefix, expected=expected)
    try:
        await store.ping()
    except Exception as exc:  # noqa: BLE001 - serve anyway; requests get UNAVAILABLE
        log.warning("%s; requests will fail with UNAVAILABLE until it answers", exc)
        registry = None
    security = service_client_from_args(args)
    batch = BatchCalls(enabled=bool(args.batch_calls), max_items=max(1, int(args.batch_max_items)),
                       max_wait_s=max(0.0, float(args.batch_max_wait_ms)) / 1e3,
                       stream=bool(args.batch_stream), overlap=bool(args.batch_overlap))
    costs = CostBook()
    health, admission = gray_from_args(args, costs)
    roles = PeerRoles(security, args.service_role_id)
    if roles.on:
        log.info("model replicas must present a certificate naming %s", args.service_role_id)
    router = Router(registry, {"target": args.target, "draft": args.draft}, health=health, roles=roles,
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
    expected.models["target"] = target_info.model_name
    max_k = int(target_info.max_k) or MAX_K
    if target_info.max_request_tokens:  # a Score carries the k drafts and one committed token
        max_k = max(1, min(max_k, int(target_info.max_request_tokens) - 1))
    bridge = _draft_tokenizer(args, tokenizer, fingerprint, expected, router)
    draft_info = await _first_info(router, "draft", 5.0)
    if draft_info is not None:
        bridge = _pair_draft(draft_info, target_info, bridge)
        expected.models["draft"] = draft_info.model_name
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
        model_name=target_info.model_name,
        vocab_size=int(target_info.vocab_size),
        max_k=max_k,
        target_max_k=int(target_info.max_k) or MAX_K,
        default_k=min(5 if args.default_k == "auto" else int(args.default_k), max_k),
        adaptive_k=args.default_k == "auto",
        default_proposer=args.default_proposer,
        suffix_cache_tokens=args.suffix_cache_tokens,
        parallel=args.parallel,
        max_new_tokens_limit=args.max_new_tokens_limit,
        redis_outage_s=args.redis_outage_s,
        record_interval_s=max(0.0, float(args.record_interval_ms)) / 1e3,
        speculation_gate=bool(args.speculation_gate),
        sampler=args.sampler,
        tree_nodes=max(0, args.tree_nodes),
        tree_width=max(1, args.tree_width),
        costs=costs,
        admission=admission,
        target_wait_s=args.target_wait_s,
        bridge=bridge,
    )


def _draft_tokenizer(args: argparse.Namespace, tokenizer, fingerprint: str, expected: Expected,
                     router: Router) -> TextBridge | None:
    """--draft-tokenizer: the draft's tokenizer, which the registry and the router then expect of
    draft replicas. None when not given, or when it is the target's own."""
    if not args.draft_tokenizer:
        return None
    from engine.model.loader import resolve

    try:
        path, _ = resolve(args.draft_tokenizer, flag="--draft-tokenizer")
        draft_tokenizer, folder = load_tokenizer(str(path))
    except (OSError, ValueError) as exc:  # no such folder, a Hub id not to be had, no tokenizer there
        raise StartupError(str(exc)) from None
    draft_fingerprint = tokenizer_fingerprint(draft_tokenizer)
    if draft_fingerprint == fingerprint:
        log.info("--draft-tokenizer %s is the target's tokenizer: drafts share its vocabulary", folder)
        return None
    expected.fingerprints["draft"] = router.fingerprints["draft"] = draft_fingerprint
    return TextBridge(tokenizer, draft_tokenizer)


def _pair_draft(draft, target, bridge: TextBridge | None) -> TextBridge | None:
    """How the draft's tokens reach the target (the bridge, for a draft with another tokenizer),
    or StartupError for a pair that cannot be served exactly."""
    shared = (draft.tokenizer_fingerprint == target.tokenizer_fingerprint
              and draft.vocab_size == target.vocab_size)
    from specdec.runtime.wire import parse_feature_kind  # (torch: not at the entry point's import)

    layers = parse_feature_kind(draft.feature_kind) if draft.feature_dim else ()
    wide = target.feature_dim * max(len(layers), 1)  # an EAGLE-3 head reads several target layers
    missing = [i for i in layers if target.num_layers and i >= target.num_layers]
    if draft.feature_dim and (not shared or draft.feature_dim != wide or missing):
        raise StartupError(
            f"draft {draft.model_name!r} is a feature draft reading {draft.feature_dim}-wide "
            f"target features ({draft.feature_kind}), but the target {target.model_name!r} "
            + ("has another tokenizer" if not shared else
               f"has {target.num_layers} decoder layers (no layer {missing[0]})" if missing else
               f"returns {wide}-wide ones" if target.feature_dim else
               "returns none (served through the stock forward, or an older service)")
            + "; refusing to pair them")
    if shared:
        log.info("draft %s shares the target's vocabulary: its tokens are verified as drafted",
                 draft.model_name)
        return None
    if bridge is None:
        raise StartupError(
            f"draft {draft.model_name!r} and target {target.model_name!r} do not share a vocabulary "
            f"(tokenizer fingerprints {draft.tokenizer_fingerprint[:12]} vs "
            f"{target.tokenizer_fingerprint[:12]}, vocab sizes {draft.vocab_size} vs {target.vocab_size}); "
            "give --draft-tokenizer (the draft's model folder or .gguf) to draft across tokenizers")
    if tokenizer_fingerprint(bridge.draft) != draft.tokenizer_fingerprint:
        raise StartupError(
            f"--draft-tokenizer is not the tokenizer of the draft {draft.model_name!r} (fingerprints "
            f"{tokenizer_fingerprint(bridge.draft)[:12]} vs {draft.tokenizer_fingerprint[:12]})")
    log.info("draft %s has another tokenizer than the target: its drafted text is re-encoded in the "
             "target's vocabulary and verified as a deterministic proposal (draft mode: text)",
             draft.model_name)
    return bridge


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
    from orchestrator.api.servicer import OrchestratorServicer

    from orchestrator.api import metrics

    if args.stream_interval < 1:
        raise StartupError(f"--stream-interval: must be >= 1 (tokens a chunk), got {args.stream_interval}")
    config = await build_config(args)
    metrics.bind(config)  # vLLM's model_name label; running and waiting from the admission
    limits = tenant_limits_from_args(args)
    servicer = OrchestratorServicer(config, limits, text_threads=args.text_threads,
                                    bounds=request_limits_from_args(args),
                                    stream_interval=args.stream_interval)
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
        event_loop.run(main_async(args), args.event_loop)
    except StartupError as exc:
        log.error("refusing to start: %s", exc)
        return 2
    return 0


if __name__ == "__main__":
    from specdec.runtime.procs import exit_now

    exit_now(main())
