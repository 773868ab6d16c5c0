"""The gateway's body limit against a huge body: how soon the 413 comes, what it costs in memory.

    python -m benchmarks.faults.attack_bench --gateway-body-mb 100 [--json out.json]

A client sends an --gateway-body-mb MB body to /v1/chat/completions one 1 MiB block at a time,
its length declared (Content-Length) or not (chunked). The figures: the time from the request's
first byte to the response's status line, the status (413 expected), the bytes the client got
to send before the answer, and the gateway process's peak resident memory growth while it
lasted (Linux: VmHWM in /proc, reset first through clear_refs). The gateway runs alone: the
limit answers before any route, so no orchestrator is involved. Goal: 413 within 1 s, growth
<= 20 MB.

The anonymous flood (`anonymous_flood`, `--anonymous-flood` of attack_bench): N concurrent
requests without a token, each a valid JSON body of MB megabytes (a prompt of token ids, the
costliest kind to parse), to a gateway whose orchestrator requires tokens. The figures: every
status (401 expected, from the headers alone) and the gateway's peak memory growth. Goal: all 401,
growth <= 30 MB.
"""
from __future__ import annotations

import socket
import tempfile
import threading
import time
from pathlib import Path

BLOCK = b"x" * (1 << 20)


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak(pid: int) -> None:
    """Make VmHWM (the peak RSS) start again from the current RSS (Linux >= 4.0)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def _head(port: int, total: int, chunked: bool, path: str = "/v1/chat/completions",
          extra: str = "") -> bytes:
    length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\n{extra}{length}\r\n\r\n").encode()


def _send_body(sock: socket.socket, total: int, chunked: bool, sent: list[int]) -> None:
    """Write the body until it is all sent or the server stops taking it; `sent[0]` counts
    the bytes the kernel took."""
    frame = (f"{len(BLOCK):x}\r\n".encode(), b"\r\n") if chunked else (b"", b"")
    block = memoryview(frame[0] + BLOCK + frame[1])
    try:
        while sent[0] < total:
            view = block
            while view:
                n = sock.send(view)
                sent[0] += n
                view = view[n:]
        if chunked:
            sock.sendall(b"0\r\n\r\n")
    except OSError:  # the server answered and closed: what the limit is for
        pass


def huge_body(port: int, pid: int, total: int, *, chunked: bool, timeout_s: float = 30.0) -> dict:
    """Send a `total`-byte body; the status, seconds to it, bytes sent, peak RSS growth (MB)."""
    reset_peak(pid)
    before_kib = _status_kib(pid, "VmRSS")
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    sent = [0]
    started = time.perf_counter()
    sock.sendall(_head(port, total, chunked))
    writer = threading.Thread(target=_send_body, args=(sock, total, chunked, sent), daemon=True)
    writer.start()
    status = None
    try:
        first = sock.recv(64)  # the status line
        seconds = time.perf_counter() - started
        if first.startswith(b"HTTP/1.1 "):
            status = int(first.split()[1])
    except OSError:
        seconds = time.perf_counter() - started
    finally:
        sock.close()
        writer.join(timeout_s)
    growth_mb = max(0, _status_kib(pid, "VmHWM") - before_kib) / 1024
    return {"status": status, "seconds": seconds, "sent_mb": sent[0] / (1 << 20),
            "rss_growth_mb": growth_mb}


def token_id_body(total: int) -> bytes:
    """A valid /v1/completions body of exactly `total` bytes: a prompt of token ids."""
    head, tail = b'{"model": "specdec", "max_tokens": 1, "prompt": [1', b"]}"
    count = (total - len(head) - len(tail)) // 2
    body = head + b",1" * count + tail
    return body + b" " * (total - len(body))


def anonymous_flood(port: int, pid: int, *, requests: int = 12, total: int = 4_000_000,
                    authorization: str = "", timeout_s: float = 60.0) -> dict:
    """`requests` concurrent POSTs of a `total`-byte body, without a token (or with
    `authorization`); their statuses, the slowest answer, the gateway's peak RSS growth (MB)."""
    body = token_id_body(total)
    extra = f"Authorization: {authorization}\r\n" if authorization else ""
    reset_peak(pid)
    before_kib = _status_kib(pid, "VmRSS")
    statuses: list[int | None] = [None] * requests
    seconds = [0.0] * requests

    def one(i: int) -> None:
        started = time.perf_counter()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
                sock.sendall(_head(port, total, False, "/v1/completions", extra))
                writer = threading.Thread(target=_send_all, args=(sock, body), daemon=True)
                writer.start()
                first = sock.recv(64)
                if first.startswith(b"HTTP/1.1 "):
                    statuses[i] = int(first.split()[1])
        except OSError:
            pass
        seconds[i] = time.perf_counter() - started

    threads = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    growth_mb = max(0, _status_kib(pid, "VmHWM") - before_kib) / 1024
    return {"statuses": statuses, "worst_seconds": max(seconds), "rss_growth_mb": growth_mb,
            "requests": requests, "body_mb": total / 1e6}


def _send_all(sock: socket.socket, body: bytes) -> None:
    try:
        sock.sendall(body)
    except OSError:  # answered and closed before the body went
        pass


def start_gateway(max_body_bytes: int | None = None, logs: Path | None = None):
    """`python -m gateway` on a free port (no orchestrator behind it); (process, port)."""
    from specdec.runtime import procs
    from specdec.runtime.launch import child_env
    from tests.integration.stack import wait_http

    port = procs.free_port()
    argv = ["python", "-m", "gateway", "--port", str(port), "--no-playground",
            "--orchestrator", f"127.0.0.1:{procs.free_port()}"]
    if max_body_bytes:
        argv += ["--max-body-bytes", str(max_body_bytes)]
    logs = logs or Path(tempfile.mkdtemp(prefix="specdec-gateway-attack-"))
    proc = procs.start(argv, env=child_env(1, quiet=True), log_path=logs / "gateway.log")
    wait_http(f"http://127.0.0.1:{port}/v1/models", proc)
    return proc, port


def run(mb: int, repeats: int = 3) -> dict:
    """The figures for a `mb` MB body, declared and chunked, `repeats` times each (the worst kept)."""
    from specdec.runtime import procs

    proc, port = start_gateway()
    try:
        results = {}
        for chunked in (False, True):
            runs = [huge_body(port, proc.pid, mb << 20, chunked=chunked) for _ in range(repeats)]
            results["chunked" if chunked else "content-length"] = {
                "statuses": sorted({r["status"] for r in runs}, key=str),
                "worst_seconds": max(r["seconds"] for r in runs),
                "worst_rss_growth_mb": max(r["rss_growth_mb"] for r in runs),
                "most_sent_mb": max(r["sent_mb"] for r in runs),
            }
        return results
    finally:
        procs.stop(proc)


def run_flood(requests: int = 12, mb: float = 4.0) -> dict:
    """The anonymous flood against a gateway whose orchestrator requires tokens (tiny target,
    loopback): anonymous, with a token nobody holds, and with a real one (the control: its bodies
    are read and parsed)."""
    import secrets

    from specdec.runtime import procs
    from specdec.runtime.launch import Processes, child_env, orchestrator_argv, service_argv
    from tests.integration.stack import wait_http
    from tests.tiny import build_pair

    work = Path(tempfile.mkdtemp(prefix="specdec-flood-"))
    target, _ = build_pair(work / "models")
    (work / "logs").mkdir()
    token = secrets.token_urlsafe(24)
    (work / "tokens").write_text(f"alice:{token}\n")
    group = Processes(work / "logs", env=child_env(1, quiet=True))
    try:
        tport, oport, gport = procs.free_port(), procs.free_port(), procs.free_port()
        group.serve("target", service_argv("target", tport, model=target, threads=1), tport)
        orch = group.serve("orch", orchestrator_argv(oport, tokenizer=target, targets=[f"127.0.0.1:{tport}"],
                                                      extra=("--auth-tokens", str(work / "tokens"))), oport)
        gateway = procs.start(["python", "-m", "gateway", "--orchestrator", orch, "--port", str(gport),
                               "--no-playground"], env=child_env(1, quiet=True),
                              log_path=work / "logs" / "gateway.log")
        try:
            wait_http(f"http://127.0.0.1:{gport}/health", gateway)
            total = int(mb * 1e6)
            return {name: anonymous_flood(gport, gateway.pid, requests=requests, total=total,
                                          authorization=auth)
                    for name, auth in (("anonymous", ""), ("unknown token", "Bearer nobodys"),
                                       ("valid token (control)", f"Bearer {token}"))}
        finally:
            procs.stop(gateway)
    finally:
        group.stop_all()
