"""The benchmarks: each sub-package is one question, run with `python -m benchmarks.<package>[.<module>]`.

- run/       one stream at a time: every proposer against target-only and transformers' own
             `generate`, where a round's time goes, the RTT sweep (`python -m benchmarks.run`)
- load/      many concurrent streams, batched and unbatched, against the physical limit
             (`python -m benchmarks.load`)
- serving/   a standard load generator (guidellm) against a running gateway: TTFT, ITL, end-to-end
             latency and throughput at fixed concurrencies and a Poisson rate, target-only and the
             default configuration side by side (`python -m benchmarks.serving --gateway URL`)
- features/  one request feature end to end: structured output, seeded sampling, tool calls
- micro/     one component alone: verify and lookup, the engine's forward, batching, and what
             gRPC, TLS and the HTTP gateway cost
- faults/    hung and slow replicas, overload, huge prompts and request bodies

Shared by them: stack.py (a benchmark's own services and orchestrators), linkemu.py (the emulated
network link), suite.py (the prompt suite in prompts/) and inprocess.py (the transformers peer).
Results go to results/ unless --out says otherwise; docs/benchmarks.md describes every figure.
"""
