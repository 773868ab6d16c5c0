"""The load benchmark: many concurrent streams, with and without batching, and the in-process peer.

Run it with `python -m benchmarks.load` (`--quick --tiny` in about a minute); `python -m
benchmarks.load.report DIR/results.json` re-renders a saved run's tables and plots.
"""
