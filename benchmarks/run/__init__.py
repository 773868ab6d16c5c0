"""The single-stream benchmark: specdec side by side with transformers, per-round costs, RTT sweep.

Run it with `python -m benchmarks.run` (`--quick --tiny` in seconds); `python -m benchmarks.run.report
DIR/results.json` re-renders a saved run's tables and plots.
"""
