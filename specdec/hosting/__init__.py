"""The gRPC shell both model services share: request decoding, the servicer base
(Release, GetInfo), the grpc.aio server bootstrap with health, reflection,
errors, TLS and drain, background hooks, and `main()` for a `Role`. The model
work itself is the engine's (the `engine` package). Nothing here depends on
which role it serves: the role packages pass that in (specdec.hosting.role)."""
