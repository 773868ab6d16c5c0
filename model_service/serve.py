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

from engine.model import loader
from model_service import hooks
from specdec.runtime.drain import Drain
from engine.host import HostLimits, Inexact, ModelHost
from engine.model.dtypes import AUTO
from model_service.role import Role
from model_service.settings import service_settings
from specdec.runtime.server import configure_logging, options_from_args, run_server
from specdec.runtime.limits import model_message_caps

log = logging.getLogger(__name__)


def build_parser(role: Role) -> argparse.ArgumentParser:
    return service_settings(role).parser()


def limits_from_args(args: argparse.Namespace, role: Role | None = None) -> HostLimits:
    return HostLimits(
        max_sessions=int(args.max_sessions),
        cache_budget_bytes=(None if args.cache_budget_mb is None
                            else int(float(args.cache_budget_mb) * 2**20)),
        session_ttl_s=float(args.kv_idle_ttl),
        max_k=int(args.max_k),
        max_request_tokens=int(args.max_request_tokens),
        max_batch=max(1, int(args.max_batch)),
        max_batch_tokens=max(1, int(args.max_batch_tokens)),
        max_wait_us=max(0, int(args.max_wait_us)),
        batch_invariant=bool(args.batch_invariant),
        stall_timeout_s=max(0.0, float(args.stall_timeout)),
        compile=bool(args.compile),
        require_exact=role is not None and role.name == "target",  # a draft's rounding only changes its guesses
    )


def _load(args: argparse.Namespace, role: Role, dtype: str):
    model, num_layers = role.model_defaults(args.model, args.num_layers)
    return loader.load(model, device=args.device, dtype=dtype,
                       num_layers=int(num_layers) if num_layers is not None else None,
                       revision=args.revision, max_model_len=args.max_model_len,
                       base=getattr(args, "base_model", None))


def open_host(args: argparse.Namespace, role: Role, replica_id: str) -> ModelHost | None:
    """The model loaded and its host made, or None once the reason is logged. `--dtype auto` is the
    fastest dtype the device computes exactly: where the start-up check finds the one it picked
    (bfloat16 on a CPU whose bf16 kernels round by the token count) not exact, float32 is served
    instead, with a warning; a dtype asked for by name is served or refused as it is."""
    try:
        loaded = _load(args, role, args.dtype)
    except (OSError, ValueError) as exc:  # no such folder or file, a Hub id not to be had, bad flags
        log.error("cannot load the model: %s", exc)
        return None
    limits = limits_from_args(args, role)
    try:
        return ModelHost(loaded, limits, replica_id=replica_id, on_fatal=hooks.exit_on_fatal)
    except Inexact as exc:
        if args.dtype != AUTO or loaded.dtype == torch.float32:
            log.error("cannot serve the model: %s", exc)
            return None
        log.warning("--dtype auto: %s is not exact on this device (%s); serving float32 instead",
                    str(loaded.dtype).removeprefix("torch."), exc)
    except ValueError as exc:  # a feature head the engine cannot serve
        log.error("cannot serve the model: %s", exc)
        return None
    del loaded
    try:
        return ModelHost(_load(args, role, "float32"), limits, replica_id=replica_id, on_fatal=hooks.exit_on_fatal)
    except (OSError, ValueError) as exc:
        log.error("cannot serve the model: %s", exc)
        return None


def main(role: Role, argv: list[str] | None = None) -> int:
    """Parse flags, load the model, serve until SIGTERM; the process exit code."""
    args = build_parser(role).parse_args(argv)
    options = options_from_args(args)
    configure_logging(options.log_level)
    threads = (os.cpu_count() or 1) if args.threads is None else int(args.threads)
    torch.set_num_threads(max(1, threads))
    replica_id = args.replica_id or f"{socket.gethostname()}:{options.port}"
    host = open_host(args, role, replica_id)
    if host is None:
        return 2
    loaded = host.loaded
    pooled = getattr(host.runner, "pooled", False)
    receive, send = model_message_caps(
        loaded.vocab_size, host.limits.max_k, host.limits.max_request_tokens, reads_features=loaded.feature_dim,
        returns_features=int(loaded.model.config.hidden_size) if pooled and role.name == "target" else 0)
    options = dataclasses.replace(options, max_receive_bytes=receive, max_send_bytes=send)
    on_serving = [hooks.sweeper(host)]
    if options.redis_url:
        on_serving.append(hooks.registration(host, options, role.name))
    servicer, drain = role.make_servicer(host), Drain.for_service(role.service_name)
    servicer.drain = drain  # the batch stream gates each of its batches
    try:
        code = run_server([partial(role.add_to_server, servicer)], [role.service_name],
                          options, on_serving=hooks.chain(*on_serving), drain=drain)
    finally:
        if host.fatal is None:
            host.shutdown()
    if host.fatal is not None:
        log.critical("exiting: the model worker is unusable (%s)", host.fatal)
        logging.shutdown()
        os._exit(3)  # a wedged worker thread must not hold the interpreter's exit
    return code
