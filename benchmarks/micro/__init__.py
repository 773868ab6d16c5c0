"""Component benchmarks: one part of the system measured alone, each `python -m benchmarks.micro.<module>`.

core_bench (verify, prompt lookup), engine_ops (torch ops per forward), batch_invariance and
batch_throughput (the batched target), service_bench, tls_bench and gateway_bench (what gRPC,
TLS and the HTTP gateway add per call or token).
"""
