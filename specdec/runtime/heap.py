"""The garbage collector of a long-running server: start-up objects frozen, young collections rarer.

A service holds a large heap of objects made once at start-up (torch, transformers,
the tokenizer, protobuf descriptors, the model's modules): several hundred thousand
tracked containers. CPython's cyclic collector walks all of them at each full
(generation 2) collection, and a decoding round allocates enough small objects
(messages, futures, timer handles, lists) to set one off every few seconds:
measured on the tiny models at 64 streams, 150-230 ms per full collection in the
orchestrator and in the target service, inside cells that last about 1.6 s.

`settle()` runs once, when the server is about to serve:

- one full collection, then `gc.freeze()`: what survives it moves to the permanent
  generation, which later collections never walk;
- a larger young-generation threshold (GEN0): the round's short-lived garbage is
  freed by reference counting anyway; the collector is only there for cycles, so
  it can run less often.

Nothing here disables the collector: cycles made while serving are still found.
"""
from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)

# Allocations (minus deallocations) of tracked objects between young collections; CPython's
# default is 700. The older generations keep their defaults (10 young collections per
# middle one, 10 middle ones per full one).
GEN0 = 20_000


def settle(gen0: int = GEN0) -> int:
    """Collect, freeze what is left, widen the young generation; the number of objects frozen."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0, gen1, gen2)
    frozen = gc.get_freeze_count()
    log.debug("heap settled: %d objects frozen in %.0f ms, young threshold %d", frozen,
              (time.perf_counter() - started) * 1e3, gen0)
    return frozen
