"""The serving benchmark: a standard load generator (guidellm) against a running gateway.

Run it with `python -m benchmarks.serving --gateway URL` (see benchmarks.serving.bench): fixed
concurrencies and a Poisson arrival rate, target-only and the default configuration side by side,
in the figures published serving benchmarks report (TTFT, ITL, end-to-end latency, throughput).
"""
