"""Model hosting shared by the target and draft services: the loader and the
draft-folder format, per-session KV caches, the model worker, request decoding,
the servicer base and the grpc.aio server bootstrap. Nothing here depends on
which role it serves: the role packages pass that in (specdec.hosting.role)."""
