"""Model hosting shared by the target and draft services: loading, per-session
KV caches, the model worker, metrics, and the grpc.aio server bootstrap."""
