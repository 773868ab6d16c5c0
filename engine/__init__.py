"""The model engine both services share: load a model, keep per-session KV in one pool,
and run many sessions' rows in one forward.

  scheduler -> plan -> runner:
    engine.scheduler  the worker thread: queue, continuous batching, one StepPlan per forward
    engine.plan       the plan (rows, tokens, emitted logits, wanted outputs) and a row's outputs
    engine.runner     executes a plan as one forward over the pool (engine.stock: the fallback)
  the forward:
    engine.model.llama      the Llama-family forward over the packed tokens of every row
    engine.model.attention  grouped attention over the pool (one SDPA call per group of rows)
    engine.model.linear     batch-invariant matrix products, calibrated at start-up
    engine.sampler    argmax, distributions, draws and confidence for all rows at once
  state:
    engine.pool       the KV pool and a session's block table
    engine.sessions   sessions by id: prefix fingerprints, LRU by count and bytes, TTL
  models:
    engine.model.loader, engine.model.drafts, engine.model.dtypes   HF folders, GGUF, the embedded default, draft folders
  engine.host ties them together for a service; engine.selfcheck runs at start-up.
"""
