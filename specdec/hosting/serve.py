"""main() of a model service: shared flags, model loading, the server with its hooks.

A role package (target_service, draft_service) calls `main(ROLE)` with its
`Role`; everything role-specific (verb, defaults, servicer) comes from there.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
from functools import partial

import torch

from engine import loader
from specdec.hosting import hooks
from specdec.drain import Drain
from engine.host import HostLimits, ModelHost
from specdec.hosting.role import Role
from specdec.server import add_server_args, configure_logging, env_default, env_flag, options_from_args, run_server
from specdec.limits import model_message_caps

log = logging.getLogger(__name__)


def build_parser(role: Role) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {role.name}_service",
        description=f"specdec {role.name} service: one causal LM over gRPC, serving {role.verb}, "
        "Release and GetInfo, with grpc.health.v1, reflection and Prometheus metrics. "
        "Every flag has a SPECDEC_* environment equivalent; flags win.",
    )
    g = parser.add_argument_group("model")
    g.add_argument("--model", default=env_default("model", None),
                   help=f"local Hugging Face folder or .gguf file; omitted = {role.model_help} [SPECDEC_MODEL]")
    g.add_argument("--device", default=env_default("device", "cpu"),
                   help="cpu, cuda, cuda:N [SPECDEC_DEVICE]")
    g.add_argument("--dtype", default=env_default("dtype", None),
                   choices=sorted(loader.DTYPES), help="weights and KV dtype; default float32, or the "
                   "dtype a distilled draft folder names if the device supports it [SPECDEC_DTYPE]")
    g.add_argument("--threads", type=int, default=env_default("threads", os.cpu_count() or 1),
                   help="torch CPU threads [SPECDEC_THREADS] (default %(default)s)")
    layers_help = ("keep only the first N decoder layers (early exit; Llama-like models)"
                   " [SPECDEC_NUM_LAYERS]" + role.layers_help)
    g.add_argument("--num-layers", "--draft-layers", dest="num_layers", type=int,
                   default=env_default("num_layers", None), help=layers_help)
    c = parser.add_argument_group("sessions and limits")
    c.add_argument("--max-sessions", type=int, default=env_default("max_sessions", 64),
                   help="sessions holding a KV cache; the least recently used is evicted "
                        "[SPECDEC_MAX_SESSIONS] (default %(default)s)")
    c.add_argument("--cache-budget-mb", type=float, default=env_default("cache_budget_mb", None),
                   help="memory of the KV pool; least recently used sessions are evicted when it is full "
                        "[SPECDEC_CACHE_BUDGET_MB] (default: 2048 on a CPU, 85%% of the GPU memory "
                        "free after loading on a GPU)")
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
    b = parser.add_argument_group("batching (concurrent calls of different sessions share a forward pass)")
    b.add_argument("--max-batch", type=int, default=env_default("max_batch", HostLimits.max_batch),
                   help="requests (sessions) per forward; 1 = batching off, one request per forward "
                        "[SPECDEC_MAX_BATCH] (default %(default)s)")
    b.add_argument("--max-batch-tokens", type=int, default=env_default("max_batch_tokens", HostLimits.max_batch_tokens),
                   help="tokens per forward; longer prompts are fed in chunks of 64 "
                        "[SPECDEC_MAX_BATCH_TOKENS] (default %(default)s)")
    b.add_argument("--max-wait-us", type=int, default=env_default("max_wait_us", HostLimits.max_wait_us),
                   help="when idle, wait this long for more requests to batch with the first "
                        "[SPECDEC_MAX_WAIT_US] (default %(default)s)")
    b.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction,
                   default=env_flag("batch_invariant", True),
                   help="keep a session's logits bitwise the same alone and batched: on a CPU each "
                        "matrix product pads its rows where its kernel needs it (calibrated at start-up; "
                        "costs a lone one-token decode a few percent), on a GPU every forward is padded "
                        "to a fixed token bucket [SPECDEC_BATCH_INVARIANT] (default on)")
    b.add_argument("--compile", action=argparse.BooleanOptionalAction,
                   default=env_flag("compile", False),
                   help="torch.compile the engine's norms and activation (CUDA graphs on a GPU); the "
                        "start-up checks run on the compiled forward; on a CPU it measured slower "
                        "[SPECDEC_COMPILE] (default off)")
    b.add_argument("--stall-timeout", type=float, default=env_default("stall_timeout", 120.0),
                   help="a forward running longer than this many seconds means a wedged device: the "
                        "service turns NOT_SERVING and exits so its sessions move; 0 = never "
                        "[SPECDEC_STALL_TIMEOUT] (default %(default)s)")
    c.add_argument("--replica-id", default=env_default("replica_id", ""),
                   help="name in GetInfo and the registry; default hostname:port [SPECDEC_REPLICA_ID]")
    add_server_args(parser, default_port=role.default_port)
    return parser


def limits_from_args(args: argparse.Namespace) -> HostLimits:
    return HostLimits(
        max_sessions=int(args.max_sessions),
        cache_budget_bytes=(None if args.cache_budget_mb is None
                            else int(float(args.cache_budget_mb) * 2**20)),
        session_ttl_s=float(args.session_ttl),
        max_k=int(args.max_k),
        max_request_tokens=int(args.max_request_tokens),
        max_batch=max(1, int(args.max_batch)),
        max_batch_tokens=max(1, int(args.max_batch_tokens)),
        max_wait_us=max(0, int(args.max_wait_us)),
        batch_invariant=bool(args.batch_invariant),
        stall_timeout_s=max(0.0, float(args.stall_timeout)),
        compile=bool(args.compile),
    )


def main(role: Role, argv: list[str] | None = None) -> int:
    """Parse flags, load the model, serve until SIGTERM; the process exit code."""
    args = build_parser(role).parse_args(argv)
    options = options_from_args(args)
    configure_logging(options.log_level)
    torch.set_num_threads(max(1, int(args.threads)))
    model, num_layers = role.model_defaults(args.model, args.num_layers)
    try:
        loaded = loader.load(model, device=args.device, dtype=args.dtype,
                             num_layers=int(num_layers) if num_layers is not None else None)
    except (FileNotFoundError, ValueError) as exc:
        log.error("cannot load the model: %s", exc)
        return 2
    replica_id = args.replica_id or f"{socket.gethostname()}:{options.port}"
    host = ModelHost(loaded, limits_from_args(args), replica_id=replica_id, on_fatal=hooks.exit_on_fatal)
    receive, send = model_message_caps(loaded.vocab_size, host.limits.max_k,
                                       host.limits.max_request_tokens)
    options = dataclasses.replace(options, max_receive_bytes=receive, max_send_bytes=send)
    on_serving = [hooks.sweeper(host)]
    if options.redis_url:
        on_serving.append(hooks.registration(host, options, role.name))
    try:
        code = run_server([partial(role.add_to_server, role.make_servicer(host))], [role.service_name],
                          options, on_serving=hooks.chain(*on_serving),
                          drain=Drain.for_service(role.service_name))
    finally:
        if host.fatal is None:
            host.shutdown()
    if host.fatal is not None:
        log.critical("exiting: the model worker is unusable (%s)", host.fatal)
        logging.shutdown()
        os._exit(3)  # a wedged worker thread must not hold the interpreter's exit
    return code
