"""The `specdec` console command.

    specdec generate "prompt"      stream a generation from a running orchestrator
    specdec up                     start what is missing (Redis, target, draft, orchestrator),
                                   and the HTTP gateway with the playground page
    specdec demo "prompt"          up + one streamed generation + clean shutdown
    specdec health ADDRESS         exit 0 if the gRPC server there is SERVING (container probes)
    specdec secrets DIR            make a CA, certificates and tokens for a secured deployment

Every process `up` starts is its own process group, watched and stopped by
pid on exit, Ctrl-C or SIGTERM: nothing is left behind.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.proposers.registry import kinds, names, plugin_names
from specdec.runtime.launch import (
    Processes, available_cores, child_env, orchestrator_argv, service_argv, split_threads,
)
from specdec.runtime.procs import free_port, wait_healthy
from specdec.runtime.settings import APPEND, CLIENT_TLS, ON, POSITIONAL, SWITCH, Flag, Group, Settings

DEFAULT_ADDRESS = "127.0.0.1:50050"
REDIS_DEFAULT = ("127.0.0.1", 6379)


# ------------------------------------------------------------------- generate


GENERATION = Group("generation", (
    Flag("max-new-tokens", "tokens to generate at most", 128, int, env=False),
    Flag("temperature", "0 = greedy", 0.0, float, env=False),
    Flag("top-k", "keep the k most likely tokens, 0 = all", 0, int, env=False),
    Flag("top-p", "nucleus sampling: the smallest set of tokens with this much probability", None, float,
         env=False),
    Flag("min-p", "drop tokens below this fraction of the most likely one's probability", 0.0, float,
         env=False),
    Flag("seed", "0 = random (printed in the stats)", 0, int, env=False),
    Flag("stop", "stop string (repeatable)", [], kind=APPEND, env=False),
    Flag("proposer", "'default' (the server's), or a kind it serves (its ServedModel.proposers): "
         + "; ".join(f"{k.name} = {k.summary}" for k in kinds(plugins=False).values() if k.requestable),
         "default", env=False),
    Flag("k", "drafted tokens per round (0 = server default)", 0, int, env=False),
    Flag("guess", "expected continuation (--proposer guess)", "", env=False),
    Flag("session-id", "continue this session", "", env=False),
    Flag("keep-session", "keep the session for later turns (its id is printed; --session-id continues it)",
         False, kind=ON, env=False),
    Flag("strict", "fail if the draft service is down", False, kind=ON, env=False),
    Flag("speculation", "parallel: the draft drafts the next round while the target verifies (same text; "
         "--proposer draft)", "default", choices=["default", "sequential", "parallel"], env=False),
    Flag("raw", "send the prompt as is, without the chat template", False, kind=ON, env=False),
))


def _request_options(args: argparse.Namespace) -> dict:
    options = dict(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=args.stop,
        proposer=args.proposer, k=args.k, guess=args.guess, session_id=args.session_id,
        strict=args.strict, keep_session=args.keep_session,
        parallel={"default": None, "sequential": False, "parallel": True}[args.speculation],
    )
    if not args.raw:
        options["messages"] = [{"role": "user", "content": args.prompt}]
    return options


def format_stats(stats) -> str:
    """The closing summary: speed, passes, acceptance, where the time went."""
    secs = stats.total_ms / 1e3
    tps = stats.new_tokens / secs if secs else 0.0
    lines = [
        f"{stats.new_tokens} tokens in {secs:.2f} s: {tps:.1f} tokens/s "
        f"(first token after {stats.ttft_ms:.0f} ms), finish: {stats.finish_reason}",
        f"target passes {stats.target_passes} ({stats.new_tokens / max(stats.target_passes, 1):.2f} "
        f"tokens/pass), proposer {stats.proposer}, draft calls {stats.draft_calls}, "
        f"acceptance {stats.acceptance_rate:.0%} ({stats.accepted_tokens}/{stats.drafted_tokens})",
        f"time: target {stats.target_ms:.0f} ms, draft {stats.draft_ms:.0f} ms, network "
        f"{stats.network_ms:.0f} ms, serialization {stats.serialize_ms:.0f} ms, orchestrator {stats.orchestrator_ms:.0f} ms, redis "
        f"{stats.redis_ms:.0f} ms; bytes sent {stats.bytes_sent}, received {stats.bytes_received}",
        f"session {stats.session_id or '(single-turn)'} (seed {stats.seed}, prompt {stats.prompt_tokens} tokens, "
        f"{stats.reused_prompt_tokens} reused)",
    ]
    if stats.fallback_reason:
        lines.append(f"fallback: {stats.fallback_reason}")
    return "\n".join(lines)


CONNECTION = Group("connection", (
    Flag("token", "bearer token for the orchestrator", None),
    *CLIENT_TLS,
))


def _connection(args: argparse.Namespace) -> dict:
    return dict(token=getattr(args, "token", None), ca=getattr(args, "tls_ca", None),
                cert=getattr(args, "client_cert", None), key=getattr(args, "client_key", None))


def stream_generation(address: str, prompt: str, options: dict, out=sys.stdout, err=sys.stderr,
                      connection: dict | None = None, result: dict | None = None) -> int:
    """Stream one generation to `out`, its stats to `err`; `result` (if given) gets "stats"."""
    import grpc

    from client import Client

    ids: list[int] = []
    with Client(address, **(connection or {})) as c:
        stream = c.generate(None if "messages" in options else prompt, **options)
        try:
            for chunk in stream:
                out.write(chunk.text)
                out.flush()
                ids.extend(chunk.token_ids)
        except grpc.RpcError as exc:
            err.write(f"\nerror: {exc.code().name}: {exc.details()}\n")
            return 1
        except KeyboardInterrupt:
            stream.cancel()
            err.write("\ncancelled\n")
            return 130
    out.write("\n")
    err.write(format_stats(stream.stats) + "\n")
    if result is not None:
        result["stats"] = stream.stats
        result["token_ids"] = ids
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    return stream_generation(args.address, args.prompt, _request_options(args),
                             connection=_connection(args))


# ------------------------------------------------------------------- up / demo


@dataclass
class Launch:
    """Processes started by `up`, stopped (by pid, newest first) in `stop()`."""

    logs: Path
    prefix: str = field(default_factory=lambda: f"specdec-up-{uuid.uuid4().hex[:8]}:")
    redis_url: str = ""  # set once Redis answers; its keys under `prefix` go at stop()
    processes: Processes = field(init=False)
    target_folder: Path | None = None  # what the target service loaded (the demo's in-process peer)
    target_threads: int = 1

    def __post_init__(self) -> None:
        self.processes = Processes(self.logs)

    def stop(self) -> None:
        own_redis = "redis" in self.processes.running
        self.processes.stop_all()
        if self.redis_url and not own_redis:  # a shared Redis: drop our namespace
            self._forget_keys()

    def _forget_keys(self) -> None:
        import asyncio

        from specdec.runtime.store import StoreUnavailable, delete_prefix

        try:
            asyncio.run(delete_prefix(self.redis_url, self.prefix))
        except StoreUnavailable as exc:
            print(f"could not clean up Redis keys {self.prefix}*: {exc}", file=sys.stderr)


def _answers(host: str, port: int, timeout: float = 0.5) -> bool:
    """True when a Redis server answers PING at host:port (no redis import here)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _port_or_free(port: int) -> int:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
            return port
        except OSError:
            return free_port()


def _ensure_redis(launch: Launch, url: str | None) -> str:
    if url:
        return url
    if _answers(*REDIS_DEFAULT):
        return "redis://127.0.0.1:6379/0"
    port = free_port()
    launch.processes.start("redis", ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                           "--save", "", "--appendonly", "no", "--dir", str(launch.logs)])
    deadline = time.monotonic() + 10
    while not _answers("127.0.0.1", port):
        if time.monotonic() > deadline:
            raise RuntimeError(f"redis-server did not answer on port {port}; see {launch.logs}")
        time.sleep(0.1)
    return f"redis://127.0.0.1:{port}/0"


def bring_up(args: argparse.Namespace, launch: Launch, say=print) -> str:
    """Start Redis (if none answers), target, draft, orchestrator; return the orchestrator address."""
    from engine.model.loader import resolve

    # The models first, before anything starts: converts the embedded GGUF once (~15 s); a Hub id
    # is fetched into the hub cache here, once, and the services (HF_HUB_OFFLINE=1) read it there.
    target_folder, _ = resolve(args.target_model, args.target_revision, flag="--target-model")
    # A draft with a tokenizer of its own (another family): the orchestrator is handed it, and runs
    # the pair in draft mode "text" when it differs from the target's (orchestrator.proposers.bridge).
    draft_tokenizer = []
    if args.draft_model:
        draft_folder, _ = resolve(args.draft_model, args.draft_revision, flag="--draft-model")
        if (draft_folder / "tokenizer_config.json").is_file() or (draft_folder / "tokenizer.json").is_file():
            draft_tokenizer = ["--draft-tokenizer", str(draft_folder)]
    redis_url = launch.redis_url = _ensure_redis(launch, args.redis_url)
    say(f"redis         {redis_url} (key prefix {launch.prefix})")
    common = dict(redis_url=redis_url, redis_prefix=launch.prefix, device=args.device)
    if args.threads:
        threads = {"target": args.threads, "draft": args.threads}
        say(f"threads       {args.threads} per service (--threads)")
    else:  # share the cores instead of giving every process all of them (specdec.runtime.launch.split_threads)
        split = split_threads()
        threads = {"target": split.target, "draft": split.draft}
        say(f"threads       {split.describe(available_cores())}")
    launch.target_folder, launch.target_threads = Path(target_folder), threads["target"]
    ports = {"target": free_port(), "draft": free_port()}
    # The embedded target is named by the service itself (SmolLM2-135M-Instruct, the API's model
    # id), not by its converted folder; the conversion is cached, so it is not done twice.
    models = {"target": args.target_model or None, "draft": args.draft_model}
    own = {"target": dict(revision=args.target_revision if args.target_model else None,
                          max_model_len=args.max_model_len),
           "draft": dict(revision=args.draft_revision if args.draft_model else None)}
    started = {role: launch.processes.start(role, service_argv(
                   role, port, model=models[role], threads=threads[role], **own[role], **common),
                   env=child_env(threads[role]))
               for role, port in ports.items()}
    for role, proc in started.items():
        wait_healthy(f"127.0.0.1:{ports[role]}", proc, timeout=args.timeout)
        say(f"{role:<13} 127.0.0.1:{ports[role]}")
    port = _port_or_free(args.port)
    address = launch.processes.serve("orchestrator", orchestrator_argv(
        port, tokenizer=target_folder, targets=[f"127.0.0.1:{ports['target']}"],
        drafts=[f"127.0.0.1:{ports['draft']}"], redis_url=redis_url, redis_prefix=launch.prefix,
        threads=1, default_proposer=args.default_proposer, default_k=args.default_k,
        chat_template=args.chat_template,
        extra=[*draft_tokenizer, *(["--parallel"] if args.parallel else [])],
    ), port, timeout=args.timeout, env=child_env(1))
    say(f"orchestrator  {address}")
    return address


# What stops `up` and `demo` from starting, told in one line (the log tail included) rather than a
# traceback: a model path that is not there, a service that died or never answered.
START_FAILURES = (FileNotFoundError, TimeoutError, RuntimeError)  # procs.ServiceDied is a RuntimeError


@contextmanager
def launched(args: argparse.Namespace):
    """A Launch that is always torn down: on return, exception, Ctrl-C or SIGTERM."""
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="specdec-up-"))
    logs.mkdir(parents=True, exist_ok=True)
    launch = Launch(logs=logs)

    def on_term(signum, frame):  # SIGTERM: unwind like Ctrl-C so `finally` runs
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    # Ctrl-C stops everything even when this process was started with SIGINT ignored (a
    # background job of a non-interactive shell inherits SIG_IGN, and Python then leaves it).
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield launch
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        launch.stop()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def start_gateway(launch: Launch, orchestrator: str, port: int, timeout: float, say=print) -> str:
    """`python -m gateway` (the OpenAI API and the playground page) in front of `orchestrator`."""
    port = _port_or_free(port)
    proc = launch.processes.start("gateway", ["python", "-m", "gateway", "--orchestrator",
                                              orchestrator, "--port", str(port)], env=child_env(1))
    deadline = time.monotonic() + timeout
    while not _listens("127.0.0.1", port):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the gateway did not start on port {port}; see {launch.logs}/gateway.log")
        time.sleep(0.1)
    base = f"http://127.0.0.1:{port}"
    say(f"gateway       {base}/v1 (OpenAI-compatible)")
    say(f"playground    {base}/playground")
    return base


def _listens(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def cmd_up(args: argparse.Namespace) -> int:
    try:
        with launched(args) as launch:
            address = bring_up(args, launch)
            if args.gateway_port:
                start_gateway(launch, address, args.gateway_port, args.timeout)
            print(f"logs          {launch.logs}")
            print(f'ready: specdec generate --address {address} "Hello"   (Ctrl-C stops everything)',
                  flush=True)
            while (exited := launch.processes.exited()) is None:
                time.sleep(0.5)
            name, code = exited
            print(f"{name} exited with {code}; see {launch.logs}/{name}.log", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        print("\nstopped", file=sys.stderr)
        return 0
    except START_FAILURES as exc:
        print(f"specdec up: {exc}", file=sys.stderr)
        return 1


def cmd_demo(args: argparse.Namespace) -> int:
    started = time.monotonic()
    rc, logs = 1, None
    try:
        with launched(args) as launch:
            logs = launch.logs
            address = bring_up(args, launch, say=lambda line: print(line, file=sys.stderr))
            print(f"up in {time.monotonic() - started:.1f} s; generating...\n", file=sys.stderr,
                  flush=True)
            options = _request_options(args)
            _warm_up(address, args.prompt, options)
            result: dict = {}
            rc = stream_generation(address, args.prompt, options, result=result)
            if rc == 0 and options["proposer"] != "none":
                _compare_with_target_only(address, args.prompt, options, result)
            if rc == 0:
                _compare_with_generate(launch, args, options, result)
            return rc
    except KeyboardInterrupt:
        print("\nstopped", file=sys.stderr)
        rc = 130
        return rc
    except START_FAILURES as exc:
        print(f"specdec demo: {exc}", file=sys.stderr)
        return rc
    finally:
        print(f"done in {time.monotonic() - started:.1f} s; everything stopped", file=sys.stderr)
        if logs is not None and not args.logs:  # a temporary folder: gone after a clean run
            if rc == 0 or not any(logs.iterdir()):
                shutil.rmtree(logs, ignore_errors=True)
            else:
                print(f"the services' logs are kept in {logs}", file=sys.stderr)


def _warm_up(address: str, prompt: str, options: dict) -> None:
    """Two tokens through both services first, so the demo's figures are not its first forwards'."""
    from client import Client

    with Client(address) as c:
        c.complete(None if "messages" in options else prompt, **{**options, "max_new_tokens": 2})


def _compare_with_target_only(address: str, prompt: str, options: dict, result: dict, err=sys.stderr) -> None:
    """The same prompt target-only through the same stack: both speeds and their ratio, and whether
    the tokens are the same (the exactness reference: the same target in the same dtype)."""
    from client import Client

    stats = result["stats"]
    print("\nsame prompt, target-only (proposer none), for comparison...", file=err, flush=True)
    plain = {**options, "proposer": "none", "k": 0, "parallel": None}
    if not options.get("seed") and options.get("temperature"):
        plain["seed"] = stats.seed  # the demo's seed: sampled text comparable too
    with Client(address) as c:
        baseline = c.complete(None if "messages" in options else prompt, **plain)
    spec = stats.new_tokens / (stats.total_ms / 1e3) if stats.total_ms else 0.0
    base = baseline.tokens_per_second
    ratio = spec / base if base else float("nan")
    same = ""
    if result.get("token_ids") is not None and (not options.get("temperature") or plain.get("seed")):
        same = "; same tokens: " + ("yes" if list(baseline.token_ids) == list(result["token_ids"]) else "NO")
    print(f"speed: {stats.proposer} {spec:.1f} tokens/s vs target-only {base:.1f} tokens/s "
          f"= {ratio:.2f}x ({stats.new_tokens} vs {baseline.stats.new_tokens} tokens{same})", file=err)


def _compare_with_generate(launch: Launch, args: argparse.Namespace, options: dict, result: dict,
                           err=sys.stderr) -> None:
    """The same prompt through transformers' own `generate` in this process, on the target's
    weights, dtype and thread count: the plain baseline every configuration must beat. Its tokens
    are compared in float32 only: in a low-precision dtype transformers' forward rounds otherwise
    than the engine's (which rounds every position as a decode step does), so its text is not the
    exactness reference there; target-only through the services is."""
    import torch

    from engine.model.loader import load, read_chat_template
    from orchestrator.common.text import encode_prompt

    stats = result["stats"]
    greedy = not options.get("temperature")
    print(f"\nsame prompt, in-process transformers generate ({launch.target_threads} thread(s), like the "
          "target service), for comparison...", file=err, flush=True)
    previous = torch.get_num_threads()
    torch.set_num_threads(launch.target_threads)
    try:
        # The dtype the target service serves (its --dtype is SPECDEC_DTYPE's, auto by default).
        loaded = load(str(launch.target_folder), device=args.device, dtype=os.environ.get("SPECDEC_DTYPE") or "auto")
        if args.chat_template:  # the template the orchestrator applied
            loaded.tokenizer.chat_template = read_chat_template(args.chat_template)
        messages = [(m["role"], m["content"]) for m in options.get("messages", ())]
        ids = encode_prompt(loaded.tokenizer, "" if messages else args.prompt, messages)
        model, n = loaded.model, stats.new_tokens
        config = dict(do_sample=not greedy, temperature=options.get("temperature") or None,
                      top_k=options.get("top_k") or None, top_p=options.get("top_p") or None,
                      pad_token_id=loaded.eos_token_ids[0])
        prompt = torch.tensor([ids], device=loaded.device)
        with torch.inference_mode():
            model.generate(prompt, max_new_tokens=2, min_new_tokens=2, **config)  # warm-up
            started = time.perf_counter()
            out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **config)
            seconds = time.perf_counter() - started
    finally:
        torch.set_num_threads(previous)
    made = out.shape[1] - len(ids)
    base = made / seconds if seconds else 0.0
    spec = stats.new_tokens / (stats.total_ms / 1e3) if stats.total_ms else 0.0
    same = ""
    if greedy and result.get("token_ids") is not None:
        if loaded.dtype == torch.float32:
            same = "; same tokens: " + ("yes" if out[0, len(ids):].tolist() == list(result["token_ids"]) else "NO")
        else:
            same = f"; {str(loaded.dtype).removeprefix('torch.')}: transformers rounds otherwise, tokens not compared"
    print(f"speed: {stats.proposer} {spec:.1f} tokens/s vs in-process generate {base:.1f} tokens/s "
          f"= {spec / base if base else float('nan'):.2f}x ({stats.new_tokens} vs {made} tokens{same})", file=err)


def cmd_health(args: argparse.Namespace) -> int:
    """grpc.health.v1 Check, for container health probes."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec.runtime.security import channel_credentials, sync_channel

    credentials = channel_credentials(args.tls_ca, args.client_cert, args.client_key)
    with sync_channel(args.address, credentials) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


# ------------------------------------------------------------------- main


LAUNCH = Group("launch", (
    Flag("port", "orchestrator port (a free one if taken)", 50050, int),
    Flag("target-model", "target folder, .gguf or Hugging Face id ORG/NAME (fetched into the hub cache "
         "once, here, unless HF_HUB_OFFLINE is set; the services then read the cache); empty = the "
         "embedded SmolLM2-135M-Instruct", None),
    Flag("target-revision", "branch, tag or commit of a --target-model given as a Hugging Face id", "main"),
    Flag("draft-model", "draft folder, .gguf or Hugging Face id ORG/NAME; empty = the draft service's own "
         "default", None),
    Flag("draft-revision", "branch, tag or commit of a --draft-model given as a Hugging Face id", "main"),
    Flag("max-model-len", "the target's --max-model-len: cap the context length served (longer requests "
         "are refused)", None, int, default_doc="the model's own"),
    Flag("chat-template", "the orchestrator's --chat-template: a Jinja file rendering chat messages in "
         "place of the target's own template", None),
    Flag("device", "cpu, cuda:0, ... for both services", "cpu"),
    Flag("threads", "torch threads per service (0 = split the cores: target ceil(n/2), draft the rest, "
         "orchestrator 1)", 0, int),
    Flag("parallel", "the orchestrator's default is parallel speculation", False, kind=SWITCH),
    Flag("redis-url", "use this Redis; empty = 127.0.0.1:6379 if it answers, else start one", None),
    Flag("default-proposer", "proposer for requests that leave it unspecified", "combined",
         choices=names(plugins=False, default_ok=True) + plugin_names()),
    Flag("default-k", "k for requests that leave it 0: a number, or 'auto' (adaptive per round)", "auto"),
    Flag("timeout", "seconds to wait for each service to start", 180.0, float),
    Flag("logs", "folder for the processes' logs; empty = a temporary folder", None),
))
# No environment name: SPECDEC_GATEWAY_PORT is the gateway's own old name for its --port.
GATEWAY_PORT = Flag("gateway-port", "port of the HTTP gateway (OpenAI API, playground page at /playground; "
                    "a free one if taken; 0 = no gateway)", 8000, int, env=False)
DEMO_PROMPT = "Explain speculative decoding in two sentences."

GENERATE_SETTINGS = Settings("specdec generate", "stream a generation from a running orchestrator", (
    Group("", (Flag("prompt", "the prompt", kind=POSITIONAL),
               Flag("address", "the orchestrator's address", DEFAULT_ADDRESS))),
    CONNECTION, GENERATION))
UP_SETTINGS = Settings("specdec up", "start Redis (if needed), target, draft, orchestrator and gateway",
                       (LAUNCH.plus(GATEWAY_PORT),))
DEMO_SETTINGS = Settings("specdec demo", "up, stream one generation, shut everything down", (
    Group("", (Flag("prompt", "the prompt", DEMO_PROMPT, kind=POSITIONAL, nargs="?"),)),
    LAUNCH, GENERATION.with_defaults(max_new_tokens=64)))
HEALTH_SETTINGS = Settings("specdec health", "exit 0 if the gRPC server at ADDRESS is SERVING", (
    Group("", (Flag("address", "host:port of the server", kind=POSITIONAL),
               Flag("service", "service name (empty = the whole server)", "", env=False),
               Flag("timeout", "seconds to wait for the answer", 3.0, float, env=False))),
    CONNECTION))
# (subcommand, its settings, what it runs): the launcher's processes, for the parser and the page.
COMMANDS = (("generate", GENERATE_SETTINGS, cmd_generate), ("up", UP_SETTINGS, cmd_up),
            ("demo", DEMO_SETTINGS, cmd_demo), ("health", HEALTH_SETTINGS, cmd_health))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec", description="Distributed speculative decoding.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, settings, func in COMMANDS:
        settings.parser(parser=sub.add_parser(name, help=settings.description,
                                              description=settings.description))
        sub.choices[name].set_defaults(func=func)
    sub.add_parser("secrets", add_help=False,
                   help="write a CA, certificates and tokens into a folder (specdec secrets --help)")
    sub.add_parser("distill", add_help=False,
                   help="train a draft model for a target (its own flags: specdec distill --help)")
    sub.add_parser("trace", add_help=False,
                   help="draw one request's trace as a timeline PNG (specdec trace --help)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["secrets"]:
        from specdec.runtime.credentials import main as secrets_main

        return secrets_main(argv[1:])
    if argv[:1] == ["distill"]:  # its own parser: python -m distill (training, not in every install)
        try:
            from distill.cli import main as distill_main
        except ModuleNotFoundError as exc:
            if exc.name != "distill":
                raise
            print("specdec distill: this install has no training package (distill/); run it from a "
                  "source checkout (pip install -e .)", file=sys.stderr)
            return 2
        return distill_main(argv[1:])
    if argv[:1] == ["trace"]:  # its own parser: python -m specdec.runtime.tracing.plot
        from specdec.runtime.tracing.plot import main as trace_main

        return trace_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
