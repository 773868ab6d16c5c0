"""What the target and draft services share: flags, the servicer base, main().

Each service adds only its verb (target_service: Score, draft_service:
Propose) as a thin servicer: decode -> ModelHost -> encode.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import grpc
import torch

from specdec.errors import InvalidArgument
from specdec.hosting import loader
from specdec.hosting.engine import HostLimits, ModelHost
from specdec.hosting.server import (
    ServerOptions,
    add_server_args,
    configure_logging,
    env_default,
    options_from_args,
    run_server,
)
from specdec.core.sampling import SamplingParams
from specdec.v1 import common_pb2
from specdec.wire import sampling_from_proto, wants_probs

log = logging.getLogger(__name__)


class ModelServicerBase:
    """Release and GetInfo, identical for both roles."""

    role = ""

    def __init__(self, host: ModelHost):
        self.host = host

    def decode(self, request: Any, field: str, count: int) -> tuple[list[int], SamplingParams, bool]:
        """Checks shared by Score and Propose: (tokens, sampling, want_probs).

        `field`/`count` name the request's draft length (k), bounded by --max-k.
        """
        host = self.host
        tokens = list(request.tokens)
        host.check_request(request.session_id, request.cache_position, tokens, min_tokens=1)
        if count > host.limits.max_k:
            raise InvalidArgument(f"{field} {count} exceeds this server's max of {host.limits.max_k}")
        sampling = sampling_from_proto(request.sampling if request.HasField("sampling") else None)
        return tokens, sampling, wants_probs(request.output_mode)

    async def Release(self, request: common_pb2.ReleaseRequest, context: Any) -> common_pb2.ReleaseResponse:
        if not request.session_id:
            raise InvalidArgument("session_id must not be empty")
        timed = await self.host.run(self.host.release, request.session_id)
        return common_pb2.ReleaseResponse(released=timed.value)

    async def GetInfo(self, request: common_pb2.GetInfoRequest, context: Any) -> common_pb2.ModelInfo:
        m = self.host.loaded
        return common_pb2.ModelInfo(
            model_name=m.name,
            role=self.role,
            vocab_size=m.vocab_size,
            tokenizer_fingerprint=m.tokenizer_fingerprint,
            eos_token_ids=list(m.eos_token_ids),
            context_length=m.context_length,
            device=str(m.device),
            dtype=str(m.dtype).removeprefix("torch."),
            parameter_count=m.parameter_count,
            max_k=self.host.limits.max_k,
            replica_id=self.host.replica_id,
        )


def timing(queue_ms: float, forward_ms: float, started: float) -> common_pb2.ServerTiming:
    return common_pb2.ServerTiming(
        queue_ms=queue_ms, forward_ms=forward_ms, total_ms=(time.perf_counter() - started) * 1e3
    )


def build_parser(role: str, default_port: int) -> argparse.ArgumentParser:
    verb = "Score (verify drafted tokens)" if role == "target" else "Propose (draft k tokens)"
    parser = argparse.ArgumentParser(
        prog=f"python -m {role}_service",
        description=f"specdec {role} service: one causal LM over gRPC, serving {verb}, "
        "Release and GetInfo, with grpc.health.v1, reflection and Prometheus metrics. "
        "Every flag has a SPECDEC_* environment equivalent; flags win.",
    )
    g = parser.add_argument_group("model")
    g.add_argument("--model", default=env_default("model", None),
                   help="local Hugging Face folder or .gguf file; omitted = the embedded "
                        "SmolLM2-135M-Instruct (converted once to a cached folder) [SPECDEC_MODEL]")
    g.add_argument("--device", default=env_default("device", "cpu"),
                   help="cpu, cuda, cuda:N [SPECDEC_DEVICE]")
    g.add_argument("--dtype", default=env_default("dtype", None),
                   choices=sorted(loader.DTYPES), help="weights and KV dtype; default float32, or the "
                   "dtype a distilled draft folder names if the device supports it [SPECDEC_DTYPE]")
    g.add_argument("--threads", type=int, default=env_default("threads", os.cpu_count() or 1),
                   help="torch CPU threads [SPECDEC_THREADS] (default %(default)s)")
    layers_help = ("keep only the first N decoder layers (early exit; Llama-like models)"
                   " [SPECDEC_NUM_LAYERS]")
    if role == "draft":
        layers_help += ("; without --model the committed distilled draft (specdec/drafts/smollm2-135m) is "
                        "served, or, if absent or with --num-layers, the embedded model's first N "
                        "layers (default 2)")
    g.add_argument("--num-layers", "--draft-layers", dest="num_layers", type=int,
                   default=env_default("num_layers", None), help=layers_help)
    c = parser.add_argument_group("sessions and limits")
    c.add_argument("--max-sessions", type=int, default=env_default("max_sessions", 64),
                   help="sessions holding a KV cache; the least recently used is evicted "
                        "[SPECDEC_MAX_SESSIONS] (default %(default)s)")
    c.add_argument("--cache-budget-mb", type=float, default=env_default("cache_budget_mb", 2048),
                   help="memory for all KV caches; LRU sessions are evicted beyond it "
                        "[SPECDEC_CACHE_BUDGET_MB] (default %(default)s)")
    c.add_argument("--session-ttl", type=float, default=env_default("session_ttl", 600),
                   help="seconds before an idle session's cache is freed [SPECDEC_SESSION_TTL]")
    c.add_argument("--max-k", type=int, default=env_default("max_k", env_default("max_draft", 16)),
                   help="largest k (drafted tokens in one Propose or Score) accepted [SPECDEC_MAX_K]")
    # The old names (--max-draft, SPECDEC_MAX_DRAFT) still work, hidden.
    c.add_argument("--max-draft", dest="max_k", type=int, help=argparse.SUPPRESS)
    c.add_argument("--max-request-tokens", type=int,
                   default=env_default("max_request_tokens", 8192),
                   help="tokens in one request before RESOURCE_EXHAUSTED "
                        "[SPECDEC_MAX_REQUEST_TOKENS]")
    c.add_argument("--replica-id", default=env_default("replica_id", ""),
                   help="name in GetInfo and the registry; default hostname:port [SPECDEC_REPLICA_ID]")
    add_server_args(parser, default_port=default_port)
    return parser


def _canceller(task: asyncio.Task) -> Callable[[], Awaitable[None]]:
    """The shutdown callback of an on_serving hook's background task."""

    async def cleanup() -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return cleanup


def _registration(host: ModelHost, options: ServerOptions, role: str):
    """on_serving hook: announce this replica in Redis with a heartbeat (--redis-url)."""

    async def on_serving(address: str) -> Callable[[], Awaitable[None]]:
        from specdec import store  # imports redis: only when registration is asked for

        registry = store.ServiceRegistry(
            store.connect(options.redis_url), url=options.redis_url, prefix=options.redis_prefix
        )
        entry = store.ServiceEntry(
            address=options.public_address,
            role=role,
            replica_id=host.replica_id,
            model_name=host.loaded.name,
            tokenizer_fingerprint=host.loaded.tokenizer_fingerprint,
        )
        task = asyncio.create_task(
            store.heartbeat(registry, entry, load=lambda: float(len(host.sessions)))
        )
        log.info("registering as %s %s at %s in %s", role, host.replica_id, entry.address,
                 options.redis_url)
        return _canceller(task)

    return on_serving


def _sweeper(host: ModelHost):
    """on_serving hook: free sessions idle beyond --session-ttl."""

    async def on_serving(address: str) -> Callable[[], Awaitable[None]]:
        period = max(0.5, min(host.limits.session_ttl_s / 4, 30.0))

        async def loop() -> None:
            while True:
                await asyncio.sleep(period)
                expired = (await host.run(host.expire)).value
                if expired:
                    log.info("freed %d idle session(s)", expired)

        return _canceller(asyncio.create_task(loop()))

    return on_serving


def _chain(*hooks):
    async def on_serving(address: str):
        cleanups = [await hook(address) for hook in hooks]

        async def cleanup() -> None:
            for c in reversed(cleanups):
                if c is not None:
                    await c()

        return cleanup

    return on_serving


def main(
    role: str,
    servicer_cls: type[ModelServicerBase],
    add_to_server: Callable[[Any, grpc.aio.Server], None],
    service_name: str,
    default_port: int,
    argv: list[str] | None = None,
) -> int:
    """Parse flags, load the model, serve until SIGTERM; the process exit code."""
    args = build_parser(role, default_port).parse_args(argv)
    options = options_from_args(args)
    configure_logging(options.log_level)
    torch.set_num_threads(max(1, int(args.threads)))
    num_layers = args.num_layers
    model = args.model
    if role == "draft" and num_layers is None and not model:
        model = loader.default_draft()  # the committed distilled draft, if present
    if role == "draft" and num_layers is None and not model:
        num_layers = 2
    try:
        loaded = loader.load(model, device=args.device, dtype=args.dtype,
                             num_layers=int(num_layers) if num_layers is not None else None)
    except (FileNotFoundError, ValueError) as exc:
        log.error("cannot load the model: %s", exc)
        return 2
    limits = HostLimits(
        max_sessions=int(args.max_sessions),
        cache_budget_bytes=int(float(args.cache_budget_mb) * 2**20),
        session_ttl_s=float(args.session_ttl),
        max_k=int(args.max_k),
        max_request_tokens=int(args.max_request_tokens),
    )
    replica_id = args.replica_id or f"{socket.gethostname()}:{options.port}"
    host = ModelHost(loaded, limits, replica_id=replica_id)
    servicer = servicer_cls(host)
    hooks = [_sweeper(host)]
    if options.redis_url:
        hooks.append(_registration(host, options, role))
    try:
        return run_server([partial(add_to_server, servicer)], [service_name], options,
                          on_serving=_chain(*hooks))
    finally:
        host.shutdown()


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run python -m target_service or python -m draft_service")
