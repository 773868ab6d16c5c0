"""What TLS + a token cost per round: 1-token Score round trips, plain vs secured, interleaved.

    python -m benchmarks.micro.tls_bench [--pairs 2000] [--mutual]

Two tiny targets: one plaintext, one with TLS (a `specdec secrets` CA; with
--mutual also a client certificate) and a service token. Each pair sends the
same 1-token Score (cropping back to a 37-token cached prefix) to both, in
alternating order; the report is the median of the paired differences (and the
medians of each side). Goal: <= 0.3 ms per round.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=2000)
    p.add_argument("--mutual", action="store_true", help="mutual TLS as well as the token")
    args = p.parse_args(argv)

    import grpc

    from specdec.runtime import procs
    from specdec.core.fingerprint import fingerprint
    from specdec.runtime.credentials import generate
    from specdec.runtime.launch import Processes, child_env, service_argv
    from specdec.runtime.security import channel_credentials
    from specdec.v1 import model_pb2, model_pb2_grpc
    from tests.tiny import build_model

    work = Path(tempfile.mkdtemp(prefix="specdec-tls-"))
    (work / "logs").mkdir()
    model = build_model(work / "tiny")
    generate(work / "secrets", hosts=("localhost",))
    sec = work / "secrets"
    token = "bench-service-token-0123456789"
    group = Processes(work / "logs", env=child_env(1, quiet=True))
    try:
        plain_port, tls_port = procs.free_port(), procs.free_port()
        group.serve("plain", service_argv("target", plain_port, model=model, threads=1), plain_port)
        target, orchestrator = sec / "target", sec / "orchestrator"  # each role's own files
        extra = ["--tls-cert", str(target / "server.crt"), "--tls-key", str(target / "server.key"),
                 f"--service-token={token}"]
        if args.mutual:
            extra += ["--tls-client-ca", str(target / "ca.crt")]
        group.start("tls", service_argv("target", tls_port, model=model, threads=1, extra=extra))
        client = (str(orchestrator / "client.crt"), str(orchestrator / "client.key"))
        creds = channel_credentials(str(orchestrator / "ca.crt"), *(client if args.mutual else (None, None)))
        stubs = {
            "plain": (model_pb2_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{plain_port}")), None),
            "tls": (model_pb2_grpc.TargetServiceStub(grpc.secure_channel(f"localhost:{tls_port}", creds)),
                    (("authorization", f"Bearer {token}"),)),
        }
        prompt = [5] * 37
        deadline = time.monotonic() + 120
        for stub, md in stubs.values():
            while True:
                try:
                    stub.Score(model_pb2.ScoreRequest(session_id="t", tokens=prompt), timeout=5, metadata=md)
                    break
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
        request = model_pb2.ScoreRequest(session_id="t", cache_position=37,
                                         prefix_hash=fingerprint(prompt), tokens=[11])

        def once(name: str) -> float:
            stub, md = stubs[name]
            t0 = time.perf_counter()
            stub.Score(request, timeout=30, metadata=md)
            return (time.perf_counter() - t0) * 1e3

        for _ in range(100):  # warm up both
            once("plain"), once("tls")
        diffs, plain, secured = [], [], []
        for i in range(args.pairs):
            order = ("plain", "tls") if i % 2 == 0 else ("tls", "plain")
            t = {name: once(name) for name in order}
            plain.append(t["plain"]), secured.append(t["tls"])
            diffs.append(t["tls"] - t["plain"])
        kind = "mutual TLS + token" if args.mutual else "TLS + token"
        print(f"1-token Score round trip, {args.pairs} interleaved pairs: plaintext median "
              f"{statistics.median(plain):.3f} ms, {kind} {statistics.median(secured):.3f} ms; "
              f"paired difference median {statistics.median(diffs):+.3f} ms "
              f"(mean {statistics.fmean(diffs):+.3f} ms)")
    finally:
        group.stop_all()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
